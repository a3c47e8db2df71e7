"""Weight loading: HF safetensors directories and GGUF files.

Both end as one dict of tensors under the model's own short names
(`layers.3.q_proj.weight`, `embed_tokens.weight`, ...). GGUF tensors are
dequantized to float32 here and cast to the engine dtype by the caller.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pagoda.engine_core.model_config import ModelConfig, ModelLoadError, open_gguf

_GGUF_NAMES = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "attn_output": "o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_HF_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)?\.?(\w+)\.(weight|bias)$")


def load_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    if config.is_gguf:
        return _load_gguf(config)
    return _load_safetensors(config)


def _load_safetensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(config.path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{config.path}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{file}: corrupt or unreadable safetensors file: {e}") from e
        for name, tensor in tensors.items():
            short = _hf_short_name(name)
            if short is not None:
                weights[short] = tensor
    return weights


def _hf_short_name(name: str) -> str | None:
    if name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        return "embed_tokens.weight"
    if name in ("model.norm.weight", "norm.weight"):
        return "norm.weight"
    if name == "lm_head.weight":
        return name
    m = _HF_LAYER.match(name)
    if m is None:
        return None  # e.g. rotary inv_freq buffers
    return f"layers.{m.group(1)}.{m.group(2)}.{m.group(3)}"


def _load_gguf(config: ModelConfig) -> dict[str, torch.Tensor]:
    from pagoda.engine_core.loaders import gguf_cache

    return _cached_tensors(config, gguf_cache.WEIGHTS_FILE, _dequantize_gguf)


def _cached_tensors(
    config: ModelConfig, name: str, build: Callable[[ModelConfig], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """build(config), memory-mapped from the GGUF cache when an earlier load wrote it."""
    from safetensors.torch import load_file, save_file

    from pagoda.engine_core.loaders import gguf_cache

    cached = gguf_cache.cached_weights_file(config.path, name)
    if cached is not None:
        try:
            return load_file(str(cached))
        except Exception:  # noqa: BLE001 - a damaged cache entry: build it again
            pass
    tensors = build(config)
    target = gguf_cache.weights_file_to_write(config.path, name)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, target)
    except OSError:
        pass  # a read-only cache only costs the next start its time
    return tensors


def _dequantize_gguf(config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    reader = open_gguf(config.path)
    permute_qk = config.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _gguf_short_name(tensor.name)
        if name is None:
            continue
        try:
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(
                f"{config.path}: tensor {tensor.name}: cannot dequantize: {e}"
            ) from e
        if permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            array = _undo_rotary_permute(array, heads)
        weights[name] = torch.from_numpy(array.copy())
    return weights


_INT4_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_int4_weights(config: ModelConfig) -> dict[str, tuple[torch.Tensor, ...]]:
    """The GGUF's 4-bit linear weights as stored, for `--quantization gguf`.

    Each Q4_0 / Q4_1 tensor becomes (q [out, in] uint8 in 0..15, scale and
    zero [out, in / 32] float32) with w = (q - 8) * scale + zero: the values
    `load_weights` dequantizes (up to the rounding of zero). Other tensor
    types are left out (those linears stay on the dense path).
    """
    if not config.is_gguf:
        raise ModelLoadError("--quantization gguf needs a GGUF model file")
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, (codes, scale, offset) in load_gguf_blocks(config).items():
        if offset is None or name.split(".")[-2] not in _INT4_LINEARS:
            continue  # not 4-bit, or not a layer's linear
        per_block = codes.reshape(codes.shape[0], -1, 16)
        # per block: elements 0-15 in the low nibbles, 16-31 in the high ones
        q = torch.stack([per_block & 0xF, per_block >> 4], dim=-2).reshape(codes.shape[0], -1)
        out[name] = (q, scale, offset + 8 * scale)
    return out


# What load_gguf_blocks keeps: the layers' linears and the token embeddings /
# head, in these GGUF types (bytes per 32-element block).
_BLOCK_WEIGHTS = (*_INT4_LINEARS, "embed_tokens", "lm_head")
_Q4_1, _Q4_0, _Q8_0 = "Q4_1", "Q4_0", "Q8_0"
_BLOCK_BYTES = {_Q4_0: 18, _Q4_1: 20, _Q8_0: 34}

GgufBlocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def load_gguf_blocks(config: ModelConfig) -> dict[str, GgufBlocks]:
    """The GGUF's Q4_0 / Q4_1 / Q8_0 linear and embedding weights in their own
    block layout (for pagoda.kernels.linear.BlockWeight).

    Each becomes (codes, scale, offset) with scale and offset [out, in / 32]
    float32 per 32-element block. 4-bit: codes [out, in / 2] uint8, element j
    of a block in the low nibble of byte j and j + 16 in the high one,
    w = q * scale + offset. Q8_0: codes [out, in] int8, offset None,
    w = q * scale. float32 arithmetic rounds both exactly as `load_weights`'
    dequantization does. Other tensor types are left out. Cached beside the
    dequantized weights: reading them means parsing the GGUF's metadata.
    """
    from pagoda.engine_core.loaders import gguf_cache

    if not config.is_gguf:
        raise ModelLoadError(f"{config.path}: quantized blocks need a GGUF model file")
    flat = _cached_tensors(config, gguf_cache.BLOCKS_FILE, _read_gguf_blocks)
    names = {key.rsplit(".", 1)[0] for key in flat}
    return {
        name: (flat[f"{name}.codes"], flat[f"{name}.scale"], flat.get(f"{name}.offset"))
        for name in sorted(names)
    }


def _read_gguf_blocks(config: ModelConfig) -> dict[str, torch.Tensor]:
    reader = open_gguf(config.path)
    permute_qk = config.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _gguf_short_name(tensor.name)
        kind = tensor.tensor_type.name
        if name is None or kind not in _BLOCK_BYTES or name.split(".")[-2] not in _BLOCK_WEIGHTS:
            continue
        raw = np.asarray(tensor.data)
        blocks = raw.reshape(raw.shape[0], -1, _BLOCK_BYTES[kind])
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        parts = {"scale": scale}
        if kind == _Q8_0:  # w = d * q
            parts["codes"] = blocks[..., 2:].reshape(raw.shape[0], -1).view(np.int8)
        else:
            parts["codes"] = blocks[..., -16:].reshape(raw.shape[0], -1)
            if kind == _Q4_1:  # w = d * q + m
                parts["offset"] = (
                    blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
                )
            else:  # Q4_0: w = d * (q - 8)
                parts["offset"] = -8 * scale
        for part, array in parts.items():
            if permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_heads if "q_proj" in name else config.num_kv_heads
                array = _undo_rotary_permute(array, heads)
            out[f"{name}.{part}"] = torch.from_numpy(np.ascontiguousarray(array))
    return out


def _gguf_short_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        short = _GGUF_NAMES.get(parts[2])
        return f"layers.{parts[1]}.{short}.{parts[3]}" if short else None
    if len(parts) == 2 and parts[0] in _GGUF_NAMES:
        return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"
    return None


def _undo_rotary_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rotary layout; undo it."""
    # [heads * head_dim, in] viewed as [heads, head_dim/2, 2, in], swap the middle axes
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)
