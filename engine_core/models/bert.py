"""BERT-style encoders (BertModel, e.g. all-MiniLM-L6-v2) in plain torch.

Bidirectional attention over whole sequences, so there is no KV cache and no
chunking: a batch of variable-length sequences arrives flat ([num_tokens]
ids) with their lengths, is padded to [batch, max_len] with a key mask for
attention, and leaves as one pooled vector per sequence (mean / CLS / last
token over the real tokens, then L2-normalized when the model says so).
Weights come as (Hugging Face name, tensor) pairs from a loader
(engine_core/loaders/), with or without a `bert.` prefix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.engine_core.model_config import ModelConfig, ModelLoadError
from pagoda.engine_core.worker.pooler import pool_padded


@dataclass
class EncoderLayer:
    """One post-LayerNorm transformer block (q|k|v fused into one matmul)."""

    qkv_weight: torch.Tensor  # [3 * hidden, hidden]
    qkv_bias: torch.Tensor
    out_weight: torch.Tensor
    out_bias: torch.Tensor
    attn_norm: tuple[torch.Tensor, torch.Tensor]
    up_weight: torch.Tensor
    up_bias: torch.Tensor
    down_weight: torch.Tensor
    down_bias: torch.Tensor
    ffn_norm: tuple[torch.Tensor, torch.Tensor]


_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class BertModel:
    """Weights plus the forward pass and pooling of a BERT encoder."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        """The model's shape; its weights come from load_weights."""
        assert config.encoder is not None, "BertModel needs an encoder config"
        self.config = config
        self.dtype = dtype
        self.device = device
        self.eps = config.encoder.layer_norm_eps
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        act = _ACTIVATIONS.get(config.encoder.hidden_act)
        if act is None:
            raise ModelLoadError(
                f"{config.path}: activation {config.encoder.hidden_act!r} is not supported"
            )
        self.act = act
        self.layers: list[EncoderLayer] = []

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the checkpoint's (Hugging Face name, tensor) pairs, with or without
        the `bert.` prefix."""
        config, dtype, device = self.config, self.dtype, self.device
        weights = {name.removeprefix("bert."): tensor for name, tensor in pairs}

        def take(name: str) -> torch.Tensor:
            tensor = weights.get(name)
            if tensor is None:
                raise ModelLoadError(f"{config.path}: missing weight {name}")
            return tensor.to(device=device, dtype=dtype).contiguous()

        def norm(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            return take(f"{prefix}.weight"), take(f"{prefix}.bias")

        self.word_embeddings = take("embeddings.word_embeddings.weight")
        self.position_embeddings = take("embeddings.position_embeddings.weight")
        # Every prompt is one segment: token type 0.
        self.token_type_embedding = take("embeddings.token_type_embeddings.weight")[0]
        self.embed_norm = norm("embeddings.LayerNorm")
        self.layers = []
        for i in range(config.num_layers):
            p = f"encoder.layer.{i}"
            att = f"{p}.attention.self"
            self.layers.append(
                EncoderLayer(
                    qkv_weight=torch.cat(
                        [take(f"{att}.{n}.weight") for n in ("query", "key", "value")]
                    ),
                    qkv_bias=torch.cat(
                        [take(f"{att}.{n}.bias") for n in ("query", "key", "value")]
                    ),
                    out_weight=take(f"{p}.attention.output.dense.weight"),
                    out_bias=take(f"{p}.attention.output.dense.bias"),
                    attn_norm=norm(f"{p}.attention.output.LayerNorm"),
                    up_weight=take(f"{p}.intermediate.dense.weight"),
                    up_bias=take(f"{p}.intermediate.dense.bias"),
                    down_weight=take(f"{p}.output.dense.weight"),
                    down_bias=take(f"{p}.output.dense.bias"),
                    ffn_norm=norm(f"{p}.output.LayerNorm"),
                )
            )

    def _layer_norm(self, x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], self.eps)

    def forward(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Hidden states of a flat batch: ids [num_tokens] → padded [batch, max_len, hidden]."""
        batch, max_len = len(seq_lens), max(seq_lens)
        device = input_ids.device
        lens = torch.tensor(seq_lens, device=device)
        mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]  # [batch, max_len]
        ids = torch.zeros((batch, max_len), dtype=torch.long, device=device)
        ids[mask] = input_ids
        positions = torch.arange(max_len, device=device)
        x = (
            self.word_embeddings[ids]
            + self.position_embeddings[positions][None]
            + self.token_type_embedding
        )  # [batch, max_len, hidden]
        x = self._layer_norm(x, self.embed_norm)
        attn_mask = mask[:, None, None, :]  # keys only: padded queries are never read
        h, d = self.num_heads, self.head_dim
        for layer in self.layers:
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)  # [batch, max_len, 3 * hidden]
            q, k, v = qkv.view(batch, max_len, 3, h, d).permute(2, 0, 3, 1, 4)  # [batch, h, L, d]
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            attn = attn.transpose(1, 2).reshape(batch, max_len, h * d)
            x = self._layer_norm(
                x + F.linear(attn, layer.out_weight, layer.out_bias), layer.attn_norm
            )
            up = self.act(F.linear(x, layer.up_weight, layer.up_bias))
            x = self._layer_norm(
                x + F.linear(up, layer.down_weight, layer.down_bias), layer.ffn_norm
            )
        return x

    def embed(
        self, input_ids: torch.Tensor, seq_lens: list[int], pooling_type: str
    ) -> torch.Tensor:
        """One pooled vector per sequence, not normalized: [batch, hidden] in float32."""
        return pool_padded(self.forward(input_ids, seq_lens).float(), seq_lens, pooling_type)
