"""Whisper (encoder-decoder speech recognition), as Hugging Face's WhisperForConditionalGeneration.

- The encoder runs once per request on its log-mel window [n_mels, 3000]:
  two GELU convolutions (the second of stride 2) to 1500 frames, learned
  positions, pre-LayerNorm transformer layers, a final LayerNorm. `encode`
  returns, per decoder layer, the cross-attention keys and values of that
  output: all the decoder ever reads of the audio, kept by the runner for
  the request's life.
- The decoder is a pre-LayerNorm transformer over learned positions: causal
  self-attention over the paged KV cache (the attention backend's, as the
  Llama decoders use it), cross-attention over one request's encoder keys
  and values, a GELU MLP; the head is the token embedding (tied).

Weights come as Hugging Face names (loaders/safetensors.py for HF
directories, loaders/ctranslate2.py for CTranslate2 ones).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagoda.engine_core.attention import AttentionBackend
from pagoda.engine_core.model_config import ModelConfig, WhisperConfig
from pagoda.kernels import cpu_ops
from pagoda.kernels.linear_int8 import Int8Weight, pack_int8, quantize_int8_per_channel

# The linears `--quantization int8` quantizes: attention projections and the MLP's.
_INT8_LINEAR = re.compile(
    r"layers\.\d+\.(self_attn|encoder_attn)\.\w+_proj\.weight$|\.fc[12]\.weight$"
)


@dataclass
class CrossSegment:
    """A run of the step's flat tokens that belong to one request."""

    start: int  # offset into the flat token batch
    length: int
    cross_kv: torch.Tensor  # [layers, 2, heads, frames, head_dim]: its encoder's keys, values


class WhisperForConditionalGeneration:
    """The encoder, the decoder over the paged cache, and the tied head."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
    ) -> None:
        assert config.whisper is not None
        self.config = config
        self.whisper: WhisperConfig = config.whisper
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.eps = self.whisper.layer_norm_eps
        self.w: dict[str, torch.Tensor] = {}
        # `--quantization int8`: the attention and MLP linears' int8 weights, by
        # linear name (kernels/linear_int8.py); the convolutions, the embeddings
        # (the head) and the norms stay in the model's dtype.
        self.int8: dict[str, Int8Weight] = {}
        # The encoder's self-attention (1500 frames each way) in Pagoda's dense
        # kernel where it runs: about twice torch's SDPA in bfloat16 on the CPU
        # (kernels/csrc/dense_attention.h, docs/benchmarks.md).
        self.dense_attention = (
            device.type == "cpu" and dtype == torch.bfloat16 and cpu_ops.has_bf16_dense_attention()
        )

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]], int8: bool = False) -> None:
        """Take (Hugging Face name, tensor) pairs; a k projection has no bias."""
        for name, tensor in pairs:
            name = name.removeprefix("model.")
            if name == "proj_out.weight":
                continue  # tied to the token embedding
            if int8 and _INT8_LINEAR.search(name):
                self.int8[name.removesuffix(".weight")] = pack_int8(
                    *quantize_int8_per_channel(tensor)
                )
                continue
            self.w[name] = tensor.to(device=self.device, dtype=self.dtype).contiguous()
        w = self.config.whisper
        assert w is not None
        missing = [
            n
            for n in (
                "encoder.conv1.weight",
                "decoder.embed_tokens.weight",
                "decoder.layer_norm.weight",
            )
            if n not in self.w
        ]
        if missing:
            raise ValueError(f"{self.config.path}: Whisper weights missing: {missing}")

    # -------------------------------------------------------------- encoder

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, n_mels, frames] → cross keys/values [B, layers, 2, heads, S, head_dim]
        (S = frames / 2: 1500 for a 30 s window)."""
        w = self.w
        x = F.gelu(
            F.conv1d(features, w["encoder.conv1.weight"], w["encoder.conv1.bias"], padding=1)
        )
        x = F.gelu(
            F.conv1d(x, w["encoder.conv2.weight"], w["encoder.conv2.bias"], stride=2, padding=1)
        )
        x = x.transpose(1, 2)  # [B, frames, hidden]
        x = x + w["encoder.embed_positions.weight"][: x.shape[1]]
        for i in range(self.whisper.encoder_layers):
            p = f"encoder.layers.{i}."
            h = self._norm(x, p + "self_attn_layer_norm")
            q = self._heads(self._linear(h, p + "self_attn.q_proj"))
            k = self._heads(self._linear(h, p + "self_attn.k_proj"))
            v = self._heads(self._linear(h, p + "self_attn.v_proj"))
            if self.dense_attention:
                attn = cpu_ops.dense_attention(q, k, v, self.scale)  # [B, h, S, d]
            else:
                attn = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
            x = x + self._linear(attn.transpose(1, 2).flatten(2), p + "self_attn.out_proj")
            x = x + self._mlp(self._norm(x, p + "final_layer_norm"), p)
        out = self._norm(x, "encoder.layer_norm")  # [B, frames, hidden]
        kv = []
        for i in range(self.config.num_layers):
            p = f"decoder.layers.{i}.encoder_attn."
            k = self._heads(self._linear(out, p + "k_proj"))
            v = self._heads(self._linear(out, p + "v_proj"))
            kv.append(torch.stack([k, v], dim=1))  # [B, 2, heads, frames, d]
        return torch.stack(kv, dim=1)

    # -------------------------------------------------------------- decoder

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: Any,  # the backend's attention metadata for this step
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        segments: list[CrossSegment],
    ) -> torch.Tensor:
        """The decoder's final hidden states, [num_tokens, hidden]."""
        w = self.w
        x = (
            w["decoder.embed_tokens.weight"][input_ids]
            + w["decoder.embed_positions.weight"][positions]
        )
        heads, d = self.num_heads, self.head_dim
        for i, (k_cache, v_cache) in enumerate(kv_caches):
            p = f"decoder.layers.{i}."
            h = self._norm(x, p + "self_attn_layer_norm")
            q = self._linear(h, p + "self_attn.q_proj").view(-1, heads, d)
            k = self._linear(h, p + "self_attn.k_proj").view(-1, heads, d)
            v = self._linear(h, p + "self_attn.v_proj").view(-1, heads, d)
            attn = self.backend.attention(q, k, v, k_cache, v_cache, meta, self.scale)
            x = x + self._linear(attn.reshape(-1, heads * d), p + "self_attn.out_proj")
            h = self._norm(x, p + "encoder_attn_layer_norm")
            q = self._linear(h, p + "encoder_attn.q_proj").view(-1, heads, d)
            cross = self._cross_attention(q, i, segments)
            x = x + self._linear(cross, p + "encoder_attn.out_proj")
            x = x + self._mlp(self._norm(x, p + "final_layer_norm"), p)
        return self._norm(x, "decoder.layer_norm")

    def _cross_attention(
        self, q: torch.Tensor, layer: int, segments: list[CrossSegment]
    ) -> torch.Tensor:
        """Each request's queries over its own encoder keys/values → [num_tokens, hidden]."""
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for seg in segments:
            qs = q[seg.start : seg.start + seg.length].transpose(0, 1)  # [h, n, d]
            k, v = seg.cross_kv[layer, 0], seg.cross_kv[layer, 1]  # [h, S, d]
            # A few queries against 1500 keys: two matmuls beat SDPA's kernel
            # (its per-call thread handoff costs more than the arithmetic).
            scores = torch.matmul(qs, k.transpose(1, 2)).float() * self.scale  # [h, n, S]
            attn = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)  # [h, n, d]
            out[seg.start : seg.start + seg.length] = attn.transpose(0, 1).flatten(1)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] → float32 [rows, vocab] (the head is the token embedding)."""
        return F.linear(hidden, self.w["decoder.embed_tokens.weight"]).float()

    # -------------------------------------------------------------- helpers

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        q = self.int8.get(name)
        if q is not None:
            y = q.matmul(x.reshape(-1, x.shape[-1]), self.w.get(name + ".bias"))
            return y.view(*x.shape[:-1], q.out_features)
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(
            x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"], self.eps
        )

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return self._linear(F.gelu(self._linear(x, prefix + "fc1")), prefix + "fc2")

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, hidden] → [B, heads, S, head_dim]."""
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
