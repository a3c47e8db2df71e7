"""Speculative decoding by prompt lookup (n-gram): the config and the proposer.

Imports no torch. Each step, for a decoding request the scheduler asks for
drafts: the longest suffix of the request's tokens (between
`prompt_lookup_min` and `prompt_lookup_max` tokens) that also occurs earlier
in them, at its earliest occurrence, and the up to `num_speculative_tokens`
tokens that followed it there (vLLM's NgramProposer semantics). The target
model computes the last token and the drafts in one pass and keeps the
drafts it would have produced itself (worker/model_runner.py).

Speculation turns itself down where it does not pay. Each request keeps a
running mean of the drafts it had accepted per step and is proposed at most
one more than that (rejected drafts cost a full token of compute each,
which a large batch feels). After `MISSES_BEFORE_PAUSE` steps in a row with
drafts and none accepted it gets no drafts for a while, a pause that
doubles each time up to `MAX_PAUSE` steps and resets when a draft is
accepted.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass

MISSES_BEFORE_PAUSE = 3
FIRST_PAUSE = 8
MAX_PAUSE = 128
_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config for prompt lookup."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    method: str = "ngram"
    # No drafts while more requests than this are running or waiting.
    disable_by_batch_size: int | None = None


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The --speculative-config JSON object, checked (ValueError with the reason)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {', '.join(_KEYS)}")
    method = value.get("method")
    if value.get("model") is not None and value["model"] != "[ngram]":
        raise ValueError(
            "--speculative-config: a draft model is not available yet; "
            'use {"method": "ngram", ...} (prompt lookup)'
        )
    if method is None and value.get("model") == "[ngram]":
        method = "ngram"
    if method != "ngram":
        raise ValueError(
            f'--speculative-config: method must be "ngram" (prompt lookup), got {method!r}'
        )
    k = _int(value, "num_speculative_tokens", None)
    if k is None:
        raise ValueError("--speculative-config needs num_speculative_tokens")
    lo = _int(value, "prompt_lookup_min", None)
    hi = _int(value, "prompt_lookup_max", None)
    if lo is None and hi is None:
        lo = hi = 5  # vLLM's default
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    assert lo is not None and hi is not None
    if k < 1 or k > 32:
        raise ValueError("--speculative-config: num_speculative_tokens must be in [1, 32]")
    if lo < 1 or hi < lo or hi > 64:
        raise ValueError(
            "--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, "
            f"got {lo} and {hi}"
        )
    limit = _int(value, "disable_by_batch_size", None)
    if limit is not None and limit < 1:
        raise ValueError("--speculative-config: disable_by_batch_size must be at least 1")
    return SpeculativeConfig(k, lo, hi, disable_by_batch_size=limit)


def _int(value: dict[str, object], key: str, default: int | None) -> int | None:
    item = value.get(key, default)
    if item is None:
        return None
    if isinstance(item, bool) or not isinstance(item, int):
        raise ValueError(f"--speculative-config: {key} must be an integer, got {item!r}")
    return item


def ngram_draft(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up to `k` tokens that followed the earliest earlier occurrence of the
    longest suffix n-gram (min_n <= n <= max_n) of token_ids; [] if none.

    The search runs on the tokens' int32 bytes (bytes.find, in C): an
    occurrence must start on a token boundary and before the suffix itself.
    """
    total = len(token_ids)
    if k <= 0 or total < min_n + 1:
        return []
    haystack = array("i", token_ids).tobytes()
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix_at = (total - n) * 4
        pattern = haystack[suffix_at:]
        found = haystack.find(pattern)
        while found % 4:
            found = haystack.find(pattern, found + 1)
        if found < suffix_at:
            start = found // 4 + n
            return token_ids[start : start + k]
    return []


class NgramProposer:
    """Drafts per request, and the pause after drafts keep being rejected."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._state: dict[str, _DraftState] = {}

    def propose(self, request_id: str, token_ids: list[int], max_drafts: int) -> list[int]:
        c = self.config
        k = min(c.num_speculative_tokens, max_drafts)
        state = self._state.get(request_id)
        if state is not None:
            if state.pause_left > 0:
                state.pause_left -= 1
                return []
            k = min(k, int(state.mean_accepted + 0.5) + 1)
        return ngram_draft(token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """How a step's drafts fared."""
        state = self._state.get(request_id)
        if state is None:
            state = self._state[request_id] = _DraftState(self.config.num_speculative_tokens)
        state.mean_accepted = 0.5 * state.mean_accepted + 0.5 * num_accepted
        if num_accepted > 0:
            state.misses, state.next_pause = 0, FIRST_PAUSE
            return
        state.misses += 1
        if state.misses >= MISSES_BEFORE_PAUSE:
            state.misses = 0
            state.pause_left = state.next_pause
            state.next_pause = min(2 * state.next_pause, MAX_PAUSE)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)


class _DraftState:
    """How one request's drafts have fared."""

    __slots__ = ("mean_accepted", "misses", "next_pause", "pause_left")

    def __init__(self, num_speculative_tokens: int) -> None:
        # Drafts accepted per step, a running mean (halved weight per step).
        self.mean_accepted = float(num_speculative_tokens)
        self.misses = 0  # steps in a row with drafts and none accepted
        self.next_pause = FIRST_PAUSE
        self.pause_left = 0  # steps still without drafts
