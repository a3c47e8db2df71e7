"""GGUF files: their tensors as (Hugging Face name, float32 tensor) pairs.

llama.cpp's names become the Hugging Face checkpoint names
(`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`), its
rotary row permutation of q/k is undone and every tensor is dequantized to
float32, so a model's `load_weights` reads a GGUF exactly as it reads
safetensors. The few-row kernels and `--quantization gguf` also read the
quantized blocks as stored (`load_gguf_blocks`, `load_int4_weights`).
Everything derived is cached (gguf_cache.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import torch

from pagoda.engine_core.loaders import gguf_cache
from pagoda.engine_core.model_config import ModelConfig, ModelLoadError, open_gguf

# llama.cpp's tensor names → Hugging Face's, per layer and outside the layers.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_weights(config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors, dequantized to float32, under Hugging Face's names."""
    yield from _cached_tensors(config, gguf_cache.WEIGHTS_FILE, _dequantize_gguf).items()


def _cached_tensors(
    config: ModelConfig, name: str, build: Callable[[ModelConfig], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """build(config), memory-mapped from the GGUF cache when an earlier load wrote it."""
    from safetensors.torch import load_file, save_file

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
        name = hf_name(tensor.name)
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
    `gguf_weights` dequantizes (up to the rounding of zero). Other tensor
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
    w = q * scale. float32 arithmetic rounds both exactly as `gguf_weights`'
    dequantization does. Other tensor types are left out. Cached beside the
    dequantized weights: reading them means parsing the GGUF's metadata.
    """
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
        name = hf_name(tensor.name)
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


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for what models do not read)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        layer = _LAYER_NAMES.get(parts[2])
        return f"model.layers.{parts[1]}.{layer}.{parts[3]}" if layer else None
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def _undo_rotary_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rotary layout; undo it."""
    # [heads * head_dim, in] viewed as [heads, head_dim/2, 2, in], swap the middle axes
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)
