"""Pooling helpers shared by the SDK and the API routes (no torch, no numpy).

Pooled vectors arrive from the engine as little-endian float32 bytes; scores
are cosine similarities of embeddings; score requests pair their texts as
vLLM does (1 to 1, 1 to N, or N to N).
"""

from __future__ import annotations

import array
import math
import sys
from typing import TypeVar

from pagoda.protocol.sampling_params import SamplingParamsError

T = TypeVar("T")


def floats_from_bytes(data: bytes) -> list[float]:
    """Little-endian float32 bytes → Python floats (exact)."""
    values = array.array("f")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def floats_to_bytes(values: list[float]) -> bytes:
    """Python floats → little-endian float32 bytes (OpenAI's base64 payload)."""
    packed = array.array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def cosine_similarity(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm > 0.0 else 0.0


def score_pairs(text_1: T | list[T], text_2: T | list[T]) -> list[tuple[T, T]]:
    """vLLM's pairing: one with one, one with each of N, or N with N in order."""
    left = text_1 if isinstance(text_1, list) else [text_1]
    right = text_2 if isinstance(text_2, list) else [text_2]
    if not left or not right:
        raise SamplingParamsError("text_1", "text_1 and text_2 must not be empty")
    if len(left) == 1:
        return [(left[0], r) for r in right]
    if len(left) != len(right):
        raise SamplingParamsError(
            "text_2",
            f"text_1 has {len(left)} items and text_2 {len(right)}; "
            "give one text_1, or as many of each",
        )
    return list(zip(left, right, strict=True))
