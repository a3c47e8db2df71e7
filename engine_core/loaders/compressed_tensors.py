"""int8 checkpoints in the compressed-tensors format that vLLM serves (W8A8).

Such a directory is a Hugging Face checkpoint whose config.json carries a
`quantization_config` with `quant_method: compressed-tensors`. The scheme read
here is the one `--quantization int8` runs: format `int-quantized` (or
`naive-quantized`), weights of the `Linear` targets int8, symmetric, per
output channel (or one scale per tensor), stored as `<module>.weight` int8
[out, in] beside `<module>.weight_scale` ([out, 1], or [1]); input
activations quantized dynamically per token (or not at all: weight-only
checkpoints run the same). Modules named in `ignore` (usually lm_head) are
plain float tensors. Static activation scales, zero points, group scales and
other bit widths are refused with a clear error.

`dequantized_weights` turns the pairs into plain float32 weights (w = q *
scale), so such a checkpoint loads like any other and runs in the model's
float dtype; with `--quantization int8`, `load_int8_weights` gives the
stored int8 weights and scales so that the linears run on exactly them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from pagoda.engine_core.model_config import ModelLoadError

_FORMATS = ("int-quantized", "naive-quantized")
_SCALE = ".weight_scale"
# Tensors of the scheme that the dense model does not need.
_DROPPED = (".weight_zero_point", ".input_zero_point")


def quantization_config(path: str) -> dict[str, Any] | None:
    """config.json's compressed-tensors `quantization_config`, checked to be
    the int8 scheme Pagoda runs; None for any other checkpoint."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    qc = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    _check_scheme(path, qc)
    return qc


def _check_scheme(path: str, qc: dict[str, Any]) -> None:
    def refuse(why: str) -> ModelLoadError:
        return ModelLoadError(f"{path}: compressed-tensors checkpoint not supported: {why}")

    groups = qc.get("config_groups") or {}
    if qc.get("format") not in _FORMATS:
        raise refuse(f"format {qc.get('format')!r} (supported: {', '.join(_FORMATS)})")
    if not groups:
        raise refuse("no config_groups")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if (
            weights.get("num_bits") != 8
            or weights.get("type", "int") != "int"
            or not weights.get("symmetric", True)
            or weights.get("strategy") not in ("channel", "tensor")
        ):
            raise refuse(f"{name}: weights must be int8, symmetric, per channel or per tensor")
        acts = group.get("input_activations")
        if acts is not None and not (
            acts.get("dynamic") is True
            and acts.get("strategy") == "token"
            and acts.get("num_bits") == 8
            and acts.get("symmetric", True)
        ):
            raise refuse(f"{name}: input activations must be dynamic, per token, int8, symmetric")
        if group.get("output_activations") is not None:
            raise refuse(f"{name}: output activation quantization")


def _pairs_with_scales(
    pairs: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, tensor, scale): each int8 weight with its scale, other tensors with
    None. Weights and scales may come in any order (and from different files)."""
    waiting_q: dict[str, torch.Tensor] = {}
    waiting_scale: dict[str, torch.Tensor] = {}
    for name, tensor in pairs:
        if name.endswith(_DROPPED):
            continue
        if name.endswith(".input_scale"):
            raise ModelLoadError(f"{name}: static activation scales are not supported")
        if name.endswith(_SCALE):
            weight = name[: -len(_SCALE)] + ".weight"
            if weight in waiting_q:
                yield weight, waiting_q.pop(weight), tensor
            else:
                waiting_scale[weight] = tensor
        elif tensor.dtype == torch.int8:
            if name in waiting_scale:
                yield name, tensor, waiting_scale.pop(name)
            else:
                waiting_q[name] = tensor
        else:
            yield name, tensor, None
    if waiting_q or waiting_scale:
        missing = sorted(waiting_q) or sorted(waiting_scale)
        raise ModelLoadError(f"{missing[0]}: int8 weight without its scale (or the reverse)")


def _scale_per_channel(name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale [out] float32 from the stored [out, 1], [out] or [1]."""
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        return scale.expand(q.shape[0]).contiguous()
    if q.dim() != 2 or scale.numel() != q.shape[0]:
        raise ModelLoadError(
            f"{name}: scale of shape {tuple(scale.shape)} does not match weight {tuple(q.shape)}"
        )
    return scale


def dequantized_weights(
    pairs: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's pairs with each int8 weight as float32 q * scale."""
    for name, tensor, scale in _pairs_with_scales(pairs):
        if scale is None:
            yield name, tensor
        else:
            s = _scale_per_channel(name, tensor, scale)
            yield name, tensor.float() * s[:, None]


def load_int8_weights(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The int8 weights as stored: name -> (q [out, in] int8, scale [out] float32)."""
    from pagoda.engine_core.loaders.safetensors import safetensors_weights

    return {
        name: (tensor, _scale_per_channel(name, tensor, scale))
        for name, tensor, scale in _pairs_with_scales(safetensors_weights(path))
        if scale is not None
    }
