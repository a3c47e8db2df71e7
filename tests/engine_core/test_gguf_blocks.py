"""A float32 model from a GGUF file's quantized blocks runs its few-row steps
on those blocks (kernels/linear.BlockWeight); the parity suite checks the
outputs against transformers, this checks the weights and where they are
used."""

from __future__ import annotations

import pytest
import torch

import pagoda.kernels.linear
from pagoda.engine_core.loaders.gguf import gguf_weights, load_gguf_blocks
from pagoda.engine_core.model_config import default_model_path, load_model_config
from pagoda.engine_core.models.llama import LlamaModel
from pagoda.kernels import cpu_ops
from pagoda.kernels.linear import BLOCKS_MAX_ROWS


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
) -> torch.Tensor:
    """q * scale (+ offset) per 32-element block: the product exact, one rounding."""
    if offset is None:  # Q8_0
        q = codes.view(codes.shape[0], -1, 32)
        return (q.float() * scale[..., None]).view(codes.shape[0], -1)
    per_block = codes.view(codes.shape[0], -1, 16)
    q = torch.stack([per_block & 0xF, per_block >> 4], dim=-2).view(codes.shape[0], -1, 32)
    values = q.double() * scale.double()[..., None] + offset.double()[..., None]
    return values.float().view(codes.shape[0], -1)


def test_q4_blocks_are_exactly_the_dequantized_weights() -> None:
    config = load_model_config(default_model_path())
    dense = dict(gguf_weights(config))
    blocks = load_gguf_blocks(config)  # the second call reads the cache
    assert blocks.keys() == load_gguf_blocks(config).keys()
    # 30 layers x q, k, v, o, gate, up, down (Q4_1), and the embeddings (Q8_0)
    assert len(blocks) == 7 * config.num_layers + 1
    codes, _, offset = blocks["model.embed_tokens.weight"]
    assert codes.dtype == torch.int8 and offset is None
    for name, (codes, scale, offset) in blocks.items():
        if offset is not None:
            assert codes.dtype == torch.uint8 and codes.shape[1] * 2 == dense[name].shape[1]
        assert torch.equal(dequantize(codes, scale, offset), dense[name]), name


def test_float32_model_streams_the_blocks_for_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu_ops.load_cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    config = load_model_config(default_model_path())
    weights = dict(gguf_weights(config))
    dense_qkv = torch.cat([weights[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    model = LlamaModel(config, torch.float32, torch.device("cpu"))
    model.load_weights(weights.items(), gguf_blocks=load_gguf_blocks(config))
    layer = model.layers[0]
    for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        assert linear.blocks is not None and linear.plain is None  # no second dense copy
    assert model.lm_head.blocks is not None and model.lm_head.blocks.offset is None  # Q8_0
    # The fused q|k|v blocks give the fused dense weights, rows in order.
    qkv = layer.qkv_proj.blocks
    assert qkv is not None
    assert torch.equal(dequantize(qkv.codes, qkv.scale, qkv.offset), dense_qkv)
    x = torch.randn(BLOCKS_MAX_ROWS[torch.float32], config.hidden_size)
    torch.testing.assert_close(layer.qkv_proj(x), x @ dense_qkv.T, rtol=1e-4, atol=1e-4)
    # Half precision reads the same blocks (the unrounded weights) for few rows,
    # where the bfloat16 pairs kernel does not take over every row count.
    monkeypatch.setattr(pagoda.kernels.linear, "pairs_available", lambda: False)
    bf16 = LlamaModel(config, torch.bfloat16, torch.device("cpu"))
    bf16.load_weights(gguf_weights(config), gguf_blocks=load_gguf_blocks(config))
    assert bf16.layers[0].qkv_proj.blocks is not None and bf16.lm_head.blocks is not None
    x = torch.randn(2, config.hidden_size).bfloat16()
    torch.testing.assert_close(
        bf16.layers[0].qkv_proj(x).float(), x.float() @ dense_qkv.T, rtol=2e-2, atol=2e-2
    )
