"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3).

One implementation covers them all: Qwen2 adds a bias to q/k/v, Qwen3 adds
a per-head RMSNorm on q and k. Projections are fused at load (q|k|v into one
matmul, gate|up into another) because on CPU fewer, larger matmuls are
faster. Tokens arrive flat: [num_tokens] ids and positions for the whole
batch, with attention described by the backend's metadata. Everything that
differs by device (paged attention, the cache layout, the fused elementwise
kernels) is the attention backend's (engine_core/attention/), chosen once.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F

from pagoda.engine_core.attention import AttentionBackend, select_backend
from pagoda.engine_core.attention.backend import rms_norm_torch
from pagoda.engine_core.model_config import ModelConfig, ModelLoadError
from pagoda.engine_core.models.moe import MoELayer
from pagoda.engine_core.worker.parallel import PipelineStage, TensorParallel
from pagoda.kernels.linear import BlockWeight, Int4Weight, Linear, pack_int4
from pagoda.kernels.linear_int8 import Int8Weight, pack_int8, quantize_int8_per_channel

if TYPE_CHECKING:
    from pagoda.engine_core.loaders.gguf import GgufBlocks
    from pagoda.engine_core.worker.lora import LoRABatch


@dataclass
class DecoderLayer:
    """One transformer block's weights (projections fused and maybe packed)."""

    input_layernorm: torch.Tensor
    qkv_proj: Linear
    o_proj: Linear
    post_attention_layernorm: torch.Tensor
    gate_up_proj: Linear | None  # None where the experts are the MLP
    down_proj: Linear | None
    q_norm: torch.Tensor | None = None  # Qwen3
    k_norm: torch.Tensor | None = None
    moe: MoELayer | None = None  # Qwen3-MoE, Mixtral


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with llama3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling_dict
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


# The few-row kernel's plain weight copies are kept while the layers' linears
# take at most this share of physical memory (a 135M model in float32: 0.4 GB).
SMALL_ROWS_MEMORY_SHARE = 1 / 8


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


class LlamaModel:
    """Weights plus the forward pass of a Llama-family decoder."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend | None = None,
        tp: TensorParallel | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        """The model's shape and tables; its weights come from load_weights.

        With tensor parallelism, `config` is this rank's (rank_config: its
        heads, its share of the MLP) and load_weights keeps this rank's shard.
        With pipeline parallelism, `stage` names the layers this rank holds;
        the embedding lives on the first stage, the final norm and the LM
        head on the last.
        """
        self.config = config
        self.tp = tp or TensorParallel()
        self.stage = stage or PipelineStage(layers=range(config.num_layers))
        # The embedding and the head split by vocabulary when it divides evenly.
        self.vocab_parallel = self.tp.size > 1 and config.vocab_size % self.tp.size == 0
        self.vocab_rows = config.vocab_size // self.tp.size if self.vocab_parallel else None
        self.dtype = dtype
        self.device = device
        self.backend = backend or select_backend(device, dtype, config.head_dim)
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, head_dim / 2]
        self.rope_cos = freqs.cos().to(device=device, dtype=dtype)
        self.rope_sin = freqs.sin().to(device=device, dtype=dtype)

    def load_weights(
        self,
        pairs: Iterable[tuple[str, torch.Tensor]],
        int4_weights: dict[str, tuple[torch.Tensor, ...]] | None = None,
        gguf_blocks: dict[str, GgufBlocks] | None = None,
        int8: bool = False,
        int8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """Take the checkpoint's (Hugging Face name, tensor) pairs: fuse q|k|v and
        gate|up, cast, move to the device, pack for the linears' kernels.

        A GGUF model may also pass its 4-bit weights (`--quantization gguf`)
        and its quantized blocks, under the same names (loaders/gguf.py).
        int8 (`--quantization int8`): the decoder layers' linears run on int8
        weights (kernels/linear_int8.py), the checkpoint's own where it has
        them (int8_weights: name -> (q [out, in] int8, scale [out]), from a
        compressed-tensors checkpoint), else quantized here per channel.
        """
        config, dtype, device = self.config, self.dtype, self.device
        packs_linears = self.backend.packs_linears
        layers = self.stage.layers
        weights = _by_short_name(pairs, layers)
        int4_weights = _by_short_name((int4_weights or {}).items(), layers)
        gguf_blocks = _by_short_name((gguf_blocks or {}).items(), layers)
        if self.tp.size > 1:
            # A shard of the dense weights; the quantized forms stay whole-model.
            weights = {name: self._shard(name, t) for name, t in weights.items()}
            int4_weights, gguf_blocks = {}, {}
        # A checkpoint's int8 weights are whole-model: with tensor parallelism
        # each rank quantizes its shard of the dense weights instead.
        int8_given = (
            {} if self.tp.size > 1 else _by_short_name((int8_weights or {}).items(), layers)
        )

        def take(name: str) -> torch.Tensor:
            tensor = weights.pop(name, None)
            if tensor is None:
                raise ModelLoadError(f"{config.path}: weight {name} is missing")
            return tensor.to(device=device, dtype=dtype)

        stage = self.stage
        # The embedding where it is looked up, or where the LM head reuses it.
        tied_head = stage.is_last and "lm_head.weight" not in weights
        if stage.is_first or tied_head:
            self.embed_tokens = take("embed_tokens.weight")
            rows = self.vocab_rows or config.vocab_size
            if self.embed_tokens.shape != (rows, config.hidden_size):
                raise ModelLoadError(
                    f"{config.path}: embed_tokens has shape {tuple(self.embed_tokens.shape)}, "
                    f"expected {(rows, config.hidden_size)}"
                )
        if stage.is_last:
            self.norm = take("norm.weight")
        # Small batches stream every weight from memory; the few-row kernel does
        # that faster than oneDNN from a second, plain copy of the weights
        # (kernels/linear.py), kept while the layers' linears are a small share of
        # the machine's memory. The head's plain weights are kept anyway. A model
        # from a GGUF file's quantized blocks streams those blocks instead
        # (kernels/linear.BlockWeight): a quarter of the time, and no second copy.
        layer_bytes = (
            sum(
                t.numel()
                for n, t in weights.items()
                if n.startswith("layers.") and n.endswith("_proj.weight")
            )
            * torch.tensor([], dtype=dtype).element_size()
        )
        small_rows = packs_linears and layer_bytes <= _physical_memory() * SMALL_ROWS_MEMORY_SHARE
        blocks = gguf_blocks or {}

        def take_blocks(*names: str) -> BlockWeight | None:
            """The named weights' GGUF blocks fused along the output, if all have
            them in one kind: exactly the float32 weights (in half precision,
            the dense weights rounded are not quite them)."""
            found = [blocks.pop(name, None) for name in names]
            parts = [p for p in found if p is not None]
            if not packs_linears or len(parts) != len(found):
                return None
            offsets = [p[2] for p in parts]
            codes = torch.cat([p[0] for p in parts])
            scale = torch.cat([p[1] for p in parts])
            if all(o is None for o in offsets):
                offset = None  # Q8_0
            elif any(o is None for o in offsets):
                return None  # 4-bit and 8-bit parts do not fuse
            else:
                offset = torch.cat([o for o in offsets if o is not None])
            return BlockWeight(codes, scale, offset)

        # The head's weights in the plain layout, for compute_logits' float32
        # recomputation, when the Linear keeps them packed (and untied).
        self.head_plain: torch.Tensor | None = None
        if not stage.is_last:
            pass  # the last stage's
        elif "lm_head.weight" in weights:
            head = take("lm_head.weight")
            self.lm_head = Linear(head, small_rows=True, blocks=take_blocks("lm_head.weight"))
            if self.lm_head.packed:
                self.head_plain = head
        elif config.tie_word_embeddings:
            self.lm_head = Linear(
                self.embed_tokens, small_rows=True, blocks=take_blocks("embed_tokens.weight")
            )
        else:
            raise ModelLoadError(f"{config.path}: weight lm_head.weight is missing")
        int4 = int4_weights or {}

        def take_int4(*names: str) -> Int4Weight | None:
            """The named linears' 4-bit weights fused along the output, if all have them."""
            parts = [int4.pop(name, None) for name in names]
            if not packs_linears or dtype != torch.bfloat16 or any(p is None for p in parts):
                return None
            q, scale, zero = (torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[index]
            return pack_int4(q, scale, zero, dtype)

        def take_int8(weight: torch.Tensor, *names: str) -> Int8Weight | None:
            """The named linears' int8 weights fused along the output: the
            checkpoint's if it has them all, else `weight` quantized."""
            parts = [int8_given.pop(name, None) for name in names]
            if not int8:
                return None
            if all(p is not None for p in parts):
                q = torch.cat([p[0] for p in parts])  # type: ignore[index]
                scale = torch.cat([p[1].reshape(-1) for p in parts])  # type: ignore[index]
                return pack_int8(q, scale.float())
            return pack_int8(*quantize_int8_per_channel(weight))

        self.layers = [
            self._load_layer(i, take, take_int4, take_blocks, take_int8, small_rows)
            for i in stage.layers
        ]

    def _load_layer(
        self,
        i: int,
        take: Callable[[str], torch.Tensor],
        take_int4: Callable[..., Int4Weight | None],
        take_blocks: Callable[..., BlockWeight | None],
        take_int8: Callable[..., Int8Weight | None],
        small_rows: bool,
    ) -> DecoderLayer:
        cfg = self.config
        p = f"layers.{i}."
        qkv = torch.cat(
            [take(p + "q_proj.weight"), take(p + "k_proj.weight"), take(p + "v_proj.weight")]
        )
        expected_qkv = (self.q_size + 2 * self.kv_size, cfg.hidden_size)
        if tuple(qkv.shape) != expected_qkv:
            raise ModelLoadError(
                f"{cfg.path}: layer {i} q/k/v shapes {tuple(qkv.shape)} do not "
                f"match the config {expected_qkv}"
            )
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat(
                [take(p + "q_proj.bias"), take(p + "k_proj.bias"), take(p + "v_proj.bias")]
            )

        def linear(
            weight: torch.Tensor, bias: torch.Tensor | None, *names: str, glu: bool = False
        ) -> Linear:
            full = [p + n for n in names]
            int8 = take_int8(weight, *full)
            if int8 is not None:
                return Linear(weight, bias, int8=int8)
            return Linear(weight, bias, take_int4(*full), small_rows, take_blocks(*full), glu)

        moe = cfg.moe
        if moe is not None and i in moe.sparse_layers:
            experts = range(*(moe.local_experts or (0, moe.num_experts)))
            return DecoderLayer(
                input_layernorm=take(p + "input_layernorm.weight"),
                qkv_proj=linear(qkv, qkv_bias, "q_proj.weight", "k_proj.weight", "v_proj.weight"),
                o_proj=linear(take(p + "o_proj.weight"), None, "o_proj.weight"),
                post_attention_layernorm=take(p + "post_attention_layernorm.weight"),
                gate_up_proj=None,
                down_proj=None,
                q_norm=take(p + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=take(p + "k_norm.weight") if cfg.qk_norm else None,
                moe=MoELayer(
                    router=take(p + "router.weight"),
                    w13=torch.stack(
                        [
                            torch.cat(
                                [
                                    take(f"{p}experts.{e}.gate_proj.weight"),
                                    take(f"{p}experts.{e}.up_proj.weight"),
                                ]
                            )
                            for e in experts
                        ]
                    ),
                    w2=torch.stack([take(f"{p}experts.{e}.down_proj.weight") for e in experts]),
                    top_k=moe.top_k,
                    renormalize=moe.renormalize,
                    first_expert=experts.start,
                ),
            )
        return DecoderLayer(
            input_layernorm=take(p + "input_layernorm.weight"),
            qkv_proj=linear(qkv, qkv_bias, "q_proj.weight", "k_proj.weight", "v_proj.weight"),
            o_proj=linear(take(p + "o_proj.weight"), None, "o_proj.weight"),
            post_attention_layernorm=take(p + "post_attention_layernorm.weight"),
            gate_up_proj=linear(
                torch.cat([take(p + "gate_proj.weight"), take(p + "up_proj.weight")]),
                None,
                "gate_proj.weight",
                "up_proj.weight",
                glu=True,
            ),
            down_proj=linear(take(p + "down_proj.weight"), None, "down_proj.weight"),
            q_norm=take(p + "q_norm.weight") if cfg.qk_norm else None,
            k_norm=take(p + "k_norm.weight") if cfg.qk_norm else None,
        )

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: Any,  # the backend's attention metadata for this step
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoRABatch | None = None,
        last_rows: torch.Tensor | None = None,
        carry: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm → [num_tokens, hidden].

        A pipeline stage other than the last returns instead what the next
        stage continues from, [2, num_tokens, hidden]: its last layer's MLP
        output and the residual stream before they are added (as the next
        layer would take them in one stage); a stage other than the first
        takes that as `carry` in place of the embedded tokens.

        With `lora`, each projection adds the LoRA delta of its token's adapter.
        With `last_rows` (flat token indices; backends that support it), only
        those tokens' hidden states are returned, [len(last_rows), hidden]: the
        last layer still writes every token's keys and values, but its output
        projection and MLP run on those rows alone (a prompt's other tokens
        feed no logits).
        """
        assert last_rows is None or lora is None, "LoRA slots are per token"
        backend = self.backend
        cfg = self.config
        eps = cfg.rms_norm_eps
        if carry is None:
            hidden = self._embed(input_ids)  # [num_tokens, hidden]
            x, residual = backend.first_norm(hidden, self.layers[0].input_layernorm, eps)
        else:
            x, residual = backend.add_rms_norm(
                carry[0], carry[1], self.layers[0].input_layernorm, eps
            )
        tp = self.tp
        last = len(self.layers) - 1
        first_layer = self.stage.layers.start  # LoRA stacks count the model's layers
        for n, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            i = first_layer + n
            qkv = _project(layer.qkv_proj, x, lora, i, "qkv_proj")  # [num_tokens, q + 2kv]
            attn = None
            if layer.q_norm is None:
                attn = backend.qkv_attention(
                    qkv,
                    cfg.num_heads,
                    positions,
                    self.rope_cos,
                    self.rope_sin,
                    k_cache,
                    v_cache,
                    meta,
                    self.scale,
                )
            if attn is None:
                q, k, v = self._split_qkv(layer, qkv)
                q, k = backend.rotary(q, k, positions, self.rope_cos, self.rope_sin)
                attn = backend.attention(q, k, v, k_cache, v_cache, meta, self.scale)
            if n == last and last_rows is not None:
                if last_rows.numel() == 0:  # a prompt chunk that samples nothing
                    empty = residual.new_empty((0, residual.shape[-1]))
                    if layer.moe is not None and layer.moe.ep is not None:
                        layer.moe(empty)  # the engines' exchange needs every rank in it
                    return empty
                attn, residual = attn[last_rows], residual[last_rows]
            x, residual = backend.add_rms_norm(
                tp.all_reduce(_project(layer.o_proj, attn.flatten(1), lora, i, "o_proj")),
                residual,
                layer.post_attention_layernorm,
                eps,
            )
            if layer.moe is not None:
                mlp = tp.all_reduce(layer.moe(x))
            else:
                assert layer.gate_up_proj is not None and layer.down_proj is not None
                # silu(gate) * up straight from the projection where its kernel
                # does both (LoRA adds its delta to gate|up first).
                act = None if lora is not None else layer.gate_up_proj.silu_and_mul(x)
                if act is None:
                    act = backend.silu_and_mul(
                        _project(layer.gate_up_proj, x, lora, i, "gate_up_proj")
                    )
                mlp = tp.all_reduce(_project(layer.down_proj, act, lora, i, "down_proj"))
            if n == last and not self.stage.is_last:
                return torch.stack([mlp, residual])
            next_norm = self.norm if n == last else self.layers[n + 1].input_layernorm
            x, residual = backend.add_rms_norm(mlp, residual, next_norm, eps)
        return x

    def _split_qkv(
        self, layer: DecoderLayer, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, d], k and v [T, kv_heads, d]: views of the fused projection."""
        cfg = self.config
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if cfg.qk_norm_whole and layer.q_norm is not None and layer.k_norm is not None:
            # OLMoE: one RMSNorm over all of q's (and k's) heads.
            q = rms_norm_torch(q.contiguous(), layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm_torch(k.contiguous(), layer.k_norm, cfg.rms_norm_eps)
            return (
                q.view(-1, cfg.num_heads, cfg.head_dim),
                k.view(-1, cfg.num_kv_heads, cfg.head_dim),
                v.reshape(-1, cfg.num_kv_heads, cfg.head_dim),
            )
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = rms_norm_torch(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm_torch(k, layer.k_norm, cfg.rms_norm_eps)
        return q, k, v

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num, hidden] → float32 logits [num, vocab].

        In half precision the head's output is rounded to that dtype: steps of
        0.125 for bfloat16 logits of 16-32, enough to tie or swap the leading
        tokens. The logits within one such step of each row's maximum are
        recomputed in float32 from the same weights, so greedy picks the token
        the half-precision model ranks first. A bfloat16 head on the pairs
        kernel gives every logit that way at once: its float32 sums, unrounded.
        """
        sums = self.lm_head.float32_sums(hidden)
        if sums is not None:
            logits = sums
        else:
            logits = self.lm_head(hidden).float()
            if hidden.dtype in _MANTISSA_BITS:
                self._refine_leading(hidden, logits)
        if self.vocab_parallel:  # each rank's share of the vocabulary, side by side
            logits = self.tp.all_gather_last(logits)
        return logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; split by vocabulary, each rank looks up its
        own ids (zeros for the others') and the all-reduce adds them up."""
        if not self.vocab_parallel:
            return F.embedding(input_ids, self.embed_tokens)
        assert self.vocab_rows is not None
        local = input_ids - self.tp.rank * self.vocab_rows
        outside = (local < 0) | (local >= self.vocab_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        hidden.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(hidden)

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole-model weight (names as _short_name gives them)."""
        tp, head_dim = self.tp, self.config.head_dim
        kind = name.split(".")[-2]
        moe = self.config.moe
        if moe is not None and moe.local_experts is not None and ".experts." in name:
            return tensor  # expert parallelism: a rank's experts are whole
        if kind in ("q_proj", "gate_proj", "up_proj"):
            return tensor[tp.split(tensor.shape[0])]
        if kind in ("k_proj", "v_proj"):
            heads = tp.kv_heads(tensor.shape[0] // head_dim)
            return tensor[heads.start * head_dim : heads.stop * head_dim]
        if kind in ("o_proj", "down_proj"):
            return tensor[:, tp.split(tensor.shape[1])]
        if kind in ("embed_tokens", "lm_head") and self.vocab_parallel:
            return tensor[tp.split(tensor.shape[0])]
        return tensor  # norms: every rank holds them whole

    def _refine_leading(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        if self.head_plain is not None:
            weight = self.head_plain
        elif self.lm_head.packed:
            weight = self.embed_tokens  # tied
        else:
            weight = self.lm_head.weight
        bias = self.lm_head.bias
        if self.backend.refine_leading_logits(
            logits, hidden, weight, bias, _MANTISSA_BITS[hidden.dtype], _MAX_REFINED_PER_ROW
        ):
            return
        top = logits.amax(-1, keepdim=True)
        exponent = torch.floor(torch.log2(top.abs().clamp_min(2.0**-60)))
        step = torch.exp2(exponent - _MANTISSA_BITS[hidden.dtype])
        near = logits >= top - step
        # A flat row (e.g. an untrained model's) has nothing to order: skip it.
        near &= near.sum(-1, keepdim=True) <= _MAX_REFINED_PER_ROW
        rows, cols = torch.nonzero(near, as_tuple=True)
        exact = (hidden[rows].float() * weight[cols].float()).sum(-1)
        if bias is not None:
            exact += bias[cols].float()
        logits[rows, cols] = exact


# Explicit mantissa bits of the half-precision dtypes (their rounding step).
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
# A row with more near-maximal logits than this is left as it is.
_MAX_REFINED_PER_ROW = 64


def _project(
    linear: Linear, x: torch.Tensor, lora: LoRABatch | None, layer: int, name: str
) -> torch.Tensor:
    """The base projection, plus each token's LoRA delta when adapters are in the batch."""
    out = linear(x)
    if lora is not None:
        out = lora.apply(layer, name, x, out)
    return out


_T = TypeVar("_T")
_HF_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)?\.?(\w+)\.(weight|bias)$")
# Mixture-of-experts names: Qwen3-MoE's mlp.gate / mlp.experts.E.{gate,up,down}_proj,
# Mixtral's block_sparse_moe.gate / block_sparse_moe.experts.E.{w1,w3,w2}.
_HF_MOE = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:gate|experts\.(\d+)\.(\w+))\.weight$"
)
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _short_name(name: str) -> str | None:
    """This module's name of a checkpoint tensor (`layers.3.q_proj.weight`), or
    None for what the model does not read (e.g. rotary inv_freq buffers)."""
    if name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        return "embed_tokens.weight"
    if name in ("model.norm.weight", "norm.weight"):
        return "norm.weight"
    if name == "lm_head.weight":
        return name
    moe = _HF_MOE.match(name)
    if moe is not None:
        layer, expert, kind = moe.groups()
        if expert is None:
            return f"layers.{layer}.router.weight"
        return f"layers.{layer}.experts.{expert}.{_MIXTRAL_EXPERT.get(kind, kind)}.weight"
    m = _HF_LAYER.match(name)
    if m is None:
        return None
    return f"layers.{m.group(1)}.{m.group(2)}.{m.group(3)}"


def _by_short_name(pairs: Iterable[tuple[str, _T]], layers: range) -> dict[str, _T]:
    """The pairs under this module's names, of the given layers (and the rest)."""
    out: dict[str, _T] = {}
    for name, value in pairs:
        short = _short_name(name)
        if short is None:
            continue
        if short.startswith("layers.") and int(short.split(".")[1]) not in layers:
            continue  # another pipeline stage's
        out[short] = value
    return out
