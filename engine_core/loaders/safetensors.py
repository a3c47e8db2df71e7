"""Hugging Face checkpoint directories: their tensors as (name, tensor) pairs.

The names are the checkpoint's own (`model.layers.0.self_attn.q_proj.weight`,
`bert.encoder.layer.0...`); each model's `load_weights` maps them onto its
layout. `*.safetensors` files are memory-mapped; a directory with only a
`pytorch_model.bin` (older encoders) is read with torch.load(weights_only).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from pagoda.engine_core.model_config import ModelLoadError


def safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint directory at `path`, file by file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        if (root / "pytorch_model.bin").is_file():
            yield from _torch_bin(root / "pytorch_model.bin")
            return
        raise ModelLoadError(f"{path}: no *.safetensors or pytorch_model.bin files")
    for file in files:
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{file}: corrupt or unreadable safetensors file: {e}") from e
        yield from tensors.items()


def _torch_bin(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types
        raise ModelLoadError(f"{file}: corrupt or unreadable weights: {e}") from e
    yield from tensors.items()
