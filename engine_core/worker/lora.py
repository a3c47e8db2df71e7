"""PEFT LoRA adapters for the Llama family: loading, validation, device slots.

An adapter directory holds adapter_config.json and adapter_model.safetensors
as `peft` saves them. `load_adapter` reads and checks it once (rank, target
modules, every tensor's shape against the base model) into CPU tensors with
the scaling folded into B, so that putting it in a slot later cannot fail.

`LoRAStacks` holds `max_loras` slots (plus slot 0, zeros, for "no adapter")
per layer and per fused projection of the model: q|k|v and gate|up are one
matmul in the base model, so their adapters are stacked the same way: the
A matrices of q, k and v side by side along the rank axis and the B
matrices block-diagonal, one shrink and one expand per fused projection.
kernels/lora.py runs them for a batch whose tokens each name a slot (on
CUDA, kernels/triton_ops/lora.py).

Under tensor parallelism each rank keeps the part of an adapter that goes
with its shard of the base weights (vLLM's layout): for the column-parallel
q, k, v, gate and up, all of A and its rows of B (for k and v the rows of
its KV heads, replicated like the base weights when there are fewer KV
heads than ranks); for the row-parallel o and down, its columns of A (its
slice of the input) and all of B, so that its delta is a partial sum that
the all-reduce after o and down adds up with the base projection's.
Adapters on the embedding or the LM head are refused, at one rank or many.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda.engine_core.model_config import ModelConfig, load_model_config
from pagoda.engine_core.worker.parallel import TensorParallel
from pagoda.kernels.lora import LoRAGroups, add_lora

if TYPE_CHECKING:
    from pagoda.kernels.triton_ops.lora import LoRAIndex

# Fused projection of the model -> the PEFT module names it is made of, in order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
SUPPORTED_MODULES = frozenset(m for group in FUSED_MODULES.values() for m in group)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRALoadError(ValueError):
    """An adapter that cannot be served; `kind` is "not_found" or "invalid"."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class LoRAAdapter:
    """One adapter's weights on the CPU: (layer, module) -> (A [r, in], scaled B [out, r]).

    Under tensor parallelism the weights are one rank's part (`shard`: its
    rank and the group's size), in the shapes of that rank's projections.
    """

    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    shard: tuple[int, int] = (0, 1)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of the base projection
    (of a rank's shard of it, given the rank's config)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def _read_config(path: str) -> dict[str, object]:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path) or not os.path.isfile(config_file):
        raise LoRALoadError(f"no LoRA adapter at {path!r} (adapter_config.json)", "not_found")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRALoadError(f"{config_file}: unreadable adapter config ({e})") from None
    if not isinstance(config, dict):
        raise LoRALoadError(f"{config_file}: the adapter config is not an object")
    return config


def _check_config(path: str, config: dict[str, object], max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a supported adapter config; LoRALoadError otherwise."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRALoadError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRALoadError(f"{path}: adapter rank r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRALoadError(f"{path}: LoRA rank {rank} is greater than max_lora_rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRALoadError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise LoRALoadError(f"{path}: adapters with {key} are not supported")
    if config.get("use_dora"):
        raise LoRALoadError(f"{path}: DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise LoRALoadError(f"{path}: adapters with trained biases are not supported")
    if config.get("fan_in_fan_out"):
        raise LoRALoadError(f"{path}: fan_in_fan_out adapters are not supported")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def whole_model_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The whole model's config, given a rank's (parallel.rank_config).

    Read again from the model's files: a rank that holds one KV head cannot
    tell a model with one per rank (split) from one with fewer (replicated).
    """
    if tp.size == 1:
        return config
    whole = load_model_config(config.path)
    return dataclasses.replace(
        config,
        num_heads=whole.num_heads,
        num_kv_heads=whole.num_kv_heads,
        intermediate_size=whole.intermediate_size,
    )


def shard_lora(
    module: str, a: torch.Tensor, b: torch.Tensor, tp: TensorParallel, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one module's whole A [r, in] and B [out, r], split
    as LlamaModel._shard splits the base weight."""
    if tp.size == 1:
        return a, b
    if module in ("q_proj", "gate_proj", "up_proj"):  # column-parallel: B's rows
        return a, b[tp.split(b.shape[0])]
    if module in ("k_proj", "v_proj"):  # the rank's KV heads' rows
        heads = tp.kv_heads(b.shape[0] // head_dim)
        return a, b[heads.start * head_dim : heads.stop * head_dim]
    # o_proj, down_proj, row-parallel: A's columns, a partial sum per rank
    return a[:, tp.split(a.shape[1])].contiguous(), b


def load_adapter(
    path: str, model_config: ModelConfig, max_rank: int, tp: TensorParallel | None = None
) -> LoRAAdapter:
    """Read and validate a PEFT adapter directory for this base model (its
    whole config); with `tp`, keep the rank's part (shard_lora)."""
    tp = tp or TensorParallel()
    path = os.path.abspath(path)
    rank, scaling = _check_config(path, _read_config(path), max_rank)
    pairs = _read_pairs(path, model_config.num_layers)
    shapes = module_shapes(model_config)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (a, b) in pairs.items():
        in_features, out_features = shapes[module]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRALoadError(
                f"{path}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"this model needs {(rank, in_features)} and {(out_features, rank)}"
            )
        a, b = shard_lora(module, a.float(), b.float(), tp, model_config.head_dim)
        weights[(layer, module)] = (a, b * scaling)
    if not weights:
        raise LoRALoadError(f"{path}: the adapter has no LoRA weights")
    return LoRAAdapter(path, rank, scaling, weights, (tp.rank, tp.size))


def _read_pairs(
    path: str, num_layers: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B) as the adapter file holds them, names checked."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        raise LoRALoadError(f"no adapter_model.safetensors in {path!r}", "not_found")
    try:
        tensors = load_file(weights_file)
    except (OSError, SafetensorError) as e:
        raise LoRALoadError(f"{weights_file}: unreadable ({e})") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in SUPPORTED_MODULES:
            raise LoRALoadError(
                f"{path}: unsupported adapter weight {key!r} (LoRA on "
                f"{', '.join(sorted(SUPPORTED_MODULES))} only)"
            )
        layer = int(match.group(1))
        if layer >= num_layers:
            raise LoRALoadError(f"{path}: {key!r} names layer {layer}; the model has fewer")
        halves.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    pairs = {}
    for (layer, module), half in halves.items():
        if set(half) != {"A", "B"}:
            raise LoRALoadError(f"{path}: layer {layer} {module} lacks lora_A or lora_B")
        pairs[(layer, module)] = (half["A"], half["B"])
    return pairs


class LoRAStacks:
    """Device-resident adapter slots: per layer and fused projection, A and B stacks."""

    def __init__(
        self,
        model_config: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
    ) -> None:
        """`model_config` is this rank's under tensor parallelism (`tp`): the
        stacks hold the rank's parts of the adapters (load_adapter's shard)."""
        self.tp = tp or TensorParallel()
        # What adapters are checked against before they are cut to the rank's part.
        self.whole_config = whole_model_config(model_config, self.tp)
        self.max_rank = max_rank
        self.num_slots = max_loras + 1  # slot 0: no adapter, zeros
        shapes = module_shapes(model_config)
        # (layer, fused name) -> (A [slots, k * R, in], B [slots, sum(out), k * R])
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(model_config.num_layers):
            for fused, modules in FUSED_MODULES.items():
                in_features = shapes[modules[0]][0]
                out_features = sum(shapes[m][1] for m in modules)
                width = len(modules) * max_rank
                a = torch.zeros(self.num_slots, width, in_features, dtype=dtype, device=device)
                b = torch.zeros(self.num_slots, out_features, width, dtype=dtype, device=device)
                self.stacks[(layer, fused)] = (a, b)
        self._shapes = shapes

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into a slot (1..max_loras), replacing what was there."""
        assert 0 < slot < self.num_slots, f"bad LoRA slot {slot}"
        assert adapter.shard == (self.tp.rank, self.tp.size), "an adapter cut for another rank"
        r = adapter.rank
        for (layer, fused), (a_stack, b_stack) in self.stacks.items():
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            out_offset = 0
            for j, module in enumerate(FUSED_MODULES[fused]):
                out_features = self._shapes[module][1]
                pair = adapter.weights.get((layer, module))
                if pair is not None:
                    a, b = pair
                    col = j * self.max_rank
                    a_stack[slot, col : col + r].copy_(a)
                    b_stack[slot, out_offset : out_offset + out_features, col : col + r].copy_(b)
                out_offset += out_features

    def apply(
        self,
        layer: int,
        fused: str,
        x: torch.Tensor,  # [num_tokens, in]
        out: torch.Tensor,  # [num_tokens, out], the base projection's result
        groups: LoRAGroups,
    ) -> torch.Tensor:
        a_stack, b_stack = self.stacks[(layer, fused)]
        return add_lora(out, x, a_stack, b_stack, groups)


@dataclass
class LoRABatch:
    """What the forward pass needs to add each token's adapter, built once per step.

    The CPU path gives `groups` (the torch op's); the CUDA path gives `index`
    (the Triton op's tokens sorted by slot) and no groups.
    """

    stacks: LoRAStacks
    groups: LoRAGroups
    index: LoRAIndex | None = None

    def apply(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.index is not None:
            from pagoda.kernels.triton_ops.lora import add_lora as triton_add_lora

            a_stack, b_stack = self.stacks.stacks[(layer, fused)]
            return triton_add_lora(out, x, a_stack, b_stack, self.index)
        return self.stacks.apply(layer, fused, x, out, self.groups)
