"""ModelRunner: owns the weights and the paged KV cache, runs one plan.

It keeps a small state per request it has seen (token ids, block table,
and for penalized requests a row of the token history), applies the plan's
diffs to it, flattens the batch into tensors (token ids, positions, slot
mapping, block tables), runs the model and samples. It never sees scheduler
objects.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagoda.engine_core.attention import PrefillChunk, StepBatch, select_backend
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.plan import NewRequestData, SchedulePlan, StepResult
from pagoda.engine_core.loaders.checkpoint import weight_pairs
from pagoda.engine_core.loaders.compressed_tensors import load_int8_weights
from pagoda.engine_core.loaders.compressed_tensors import (
    quantization_config as compressed_int8_config,
)
from pagoda.engine_core.loaders.gguf import load_gguf_blocks, load_int4_weights
from pagoda.engine_core.model_config import ModelConfig, ModelLoadError, default_pooler
from pagoda.engine_core.models import model_class
from pagoda.engine_core.models.llama import LlamaModel
from pagoda.engine_core.worker.lora import LoRAAdapter, LoRABatch, LoRAStacks
from pagoda.engine_core.worker.parallel import PipelineStage, TensorParallel
from pagoda.engine_core.worker.pooler import finish, pool_flat
from pagoda.engine_core.worker.runner_utilities import RunnerUtilities
from pagoda.engine_core.worker.sampler import (
    SamplingRow,
    apply_grammar_bitmask,
    prompt_logprobs,
    sample,
)
from pagoda.engine_core.worker.sleep import ParkedWeights, release_freed_memory, reuse_freed_memory
from pagoda.engine_core.worker.token_history import TokenHistory
from pagoda.engine_core.worker.weight_transfer import WeightTransfer
from pagoda.kernels.cpu_ops import cpu_has_native, load_cpu_ops
from pagoda.kernels.linear import int4_available, pairs_available
from pagoda.kernels.linear_int8 import int8_available
from pagoda.kernels.lora import lora_groups
from pagoda.protocol.pooling_params import PoolingParams
from pagoda.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine_core.worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 4 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or cpu_has_native(torch.bfloat16):
        return torch.bfloat16
    return torch.float32


@dataclass
class CachedRequestState:
    """The runner's view of one request."""

    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    history_slot: int = -1  # its TokenHistory row (penalized requests)
    pooling: PoolingParams | None = None  # set for a pooling request (--runner pooling)
    lora_slot: int = 0  # the adapter slot its tokens use (0: none)


class ModelRunner(RunnerUtilities):
    """Weights, KV cache and the forward pass for one device; control calls in RunnerUtilities."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tp: TensorParallel | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        """`model_config` is this rank's (parallel.rank_config) under tensor
        parallelism; `stage` its pipeline stage (default: the whole model).

        A stage other than the last computes no logits: its step ends by
        sending its hidden states on. Under pipeline parallelism no rank
        appends the tokens it samples: every rank takes each request's new
        tokens from the next plan (CachedRequestData.new_token_ids).
        """
        self.config = config
        self.model_config = model_config
        self.tp = tp or TensorParallel()
        self.stage = stage or PipelineStage(layers=range(model_config.num_layers))
        # Weights sent by a trainer (whole tensors, checkpoint names), and every
        # checkpoint tensor's shape: the model is rebuilt from the checkpoint
        # with these in place (worker/weight_transfer.py).
        self.weight_overrides: dict[str, torch.Tensor] = {}
        self.weight_shapes: dict[str, tuple[int, ...]] = {}
        self.weight_transfer: WeightTransfer | None = None
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # Unseeded requests are keyed from torch's global generator (--seed).
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
            reuse_freed_memory()
        # Paged attention and the ops around it, chosen once for this device.
        self.backend = select_backend(self.device, self.dtype, model_config.head_dim)
        self.model = self._load_model()
        self.block_size = config.block_size
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The host KV tier's blocks, per layer (key, value): [slots, ...] in pinned
        # host memory on CUDA, plain memory on the CPU (core/kv_offload.py).
        self.host_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None  # CUDA only, after the cache exists
        self.requests: dict[str, CachedRequestState] = {}
        self.history = TokenHistory()  # token ids of the penalized requests
        self.num_kv_blocks = 0
        # Sleep mode: the parked weights (level 1), or None with model None (level 2).
        self._parked: ParkedWeights | None = None
        self.eos_token_ids = model_config.eos_token_ids
        self.pooler = default_pooler(model_config)
        # LoRA: registered adapters on the CPU, and the device slots they are copied into.
        self.lora_adapters: dict[str, LoRAAdapter] = {}
        self.lora_stacks: LoRAStacks | None = None
        if config.enable_lora:
            self.lora_stacks = LoRAStacks(
                model_config,
                config.max_loras,
                config.max_lora_rank,
                self.dtype,
                self.device,
                self.tp,
            )

    def _load_model(self) -> LlamaModel:
        """The model from its checkpoint, with the weights a trainer sent in its place."""
        overrides = self.weight_overrides
        int4 = None
        if self.config.quantization == "gguf" and self.device.type == "cpu" and int4_available():
            int4 = load_int4_weights(self.model_config)
        # A model from a GGUF file's quantized blocks: the few-row kernels
        # stream the blocks themselves (kernels/linear.BlockWeight); in half
        # precision --quantization gguf's 4-bit path takes small steps instead,
        # and bfloat16 on the pairs kernel needs no blocks at all.
        blocks = None
        if (
            self.model_config.is_gguf
            and self.device.type == "cpu"
            and (int4 is None or self.dtype == torch.float32)
            and not (self.dtype == torch.bfloat16 and pairs_available())
            and load_cpu_ops() is not None
        ):
            blocks = load_gguf_blocks(self.model_config)
        model: LlamaModel = model_class(self.model_config.architecture)(
            self.model_config, self.dtype, self.device, self.backend, self.tp, self.stage
        )
        if overrides:
            # The file's quantized forms of replaced tensors are stale.
            int4 = {k: v for k, v in (int4 or {}).items() if k not in overrides} or None
            blocks = {k: v for k, v in (blocks or {}).items() if k not in overrides} or None
        int8, int8_weights = self._int8_weights()
        model.load_weights(self._weight_pairs(), int4, blocks, int8, int8_weights)
        return model

    def _int8_weights(self) -> tuple[bool, dict[str, tuple[torch.Tensor, torch.Tensor]] | None]:
        """Whether the linears run in int8 (`--quantization int8`), and a
        compressed-tensors checkpoint's own int8 weights where it has them."""
        if self.config.quantization != "int8":
            return False, None
        if self.device.type != "cpu" or not int8_available():
            raise ModelLoadError("--quantization int8 needs a CPU with AVX512-VNNI")
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise ModelLoadError("--quantization int8 runs with --dtype bfloat16 or float32")
        path = self.model_config.path
        if self.model_config.is_gguf or compressed_int8_config(path) is None:
            return True, None
        stored = load_int8_weights(path)
        return True, {k: v for k, v in stored.items() if k not in self.weight_overrides}

    def _weight_pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) pairs, replaced ones as sent; the
        first time, every tensor's shape is noted (what an update must match)."""
        overrides = self.weight_overrides
        note = not self.weight_shapes
        for name, tensor in weight_pairs(self.model_config):
            if note:
                self.weight_shapes[name] = tuple(tensor.shape)
            yield name, overrides.get(name, tensor)

    # ------------------------------------------------------------- KV cache

    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        layers = len(self.stage.layers)
        return 2 * layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def _cache(self, num_blocks: int) -> torch.Tensor:
        """One layer's key (or value) cache, in the backend's layout."""
        mc = self.model_config
        return self.backend.kv_cache(num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)

    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        """Size the cache from the memory budget (or as given); returns the number of blocks."""
        if num_blocks is None:
            budget = self.config.kv_cache_memory_bytes
            if budget is None:
                budget = self._default_kv_budget()
            num_blocks = max(budget // self.kv_bytes_per_block(), 1)
        self.num_kv_blocks = int(num_blocks)
        self.kv_caches = [
            (self._cache(num_blocks), self._cache(num_blocks)) for _ in self.stage.layers
        ]
        if self.device.type == "cpu":
            # Touch every page now. Left untouched, the OS hands the cache out page
            # by page as blocks are first written, so the engine's RSS creeps up to
            # the full budget over hours of serving (a soak saw 0.9 → 5.5 GiB) and a
            # machine short of memory OOM-kills it mid-serving instead of at start.
            # About a second per few GiB; attention never reads a slot before it is
            # written, so the zeros themselves do not matter.
            for k, v in self.kv_caches:
                k.zero_()
                v.zero_()
        # The captured decode graphs know nothing of adapters: LoRA decodes eagerly.
        if (
            self.backend.cuda_graphs
            and not self.config.enforce_eager
            and self.lora_stacks is None
            and self.stage.size == 1  # the sends between stages run eagerly
        ):
            self._capture_graphs(int(num_blocks))
        return int(num_blocks)

    def _capture_graphs(self, num_blocks: int) -> None:
        from pagoda.engine_core.worker.cuda_graphs import DecodeGraphs

        mc = self.model_config
        limit = min(mc.max_position_embeddings, num_blocks * self.block_size)
        if self.config.max_model_len is not None:
            limit = min(limit, self.config.max_model_len)
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.config.max_num_seqs,
            -(-limit // self.block_size),
            self.device,
        )
        captured = True
        try:
            graphs.capture()  # with tensor parallelism, NCCL's all-reduces inside
        except Exception as e:  # noqa: BLE001 - any capture failure means: decode eagerly
            logger.warning("CUDA graph capture failed (%s); decoding eagerly", e)
            captured = False
        if self.tp.size > 1:
            # The ranks must all replay or all run eagerly (their collectives pair up).
            import torch.distributed as dist

            flag = torch.tensor([int(captured)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.tp.group)
            captured = bool(flag.item())
        if captured:
            self.graphs = graphs

    def _default_kv_budget(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.8)
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            available = DEFAULT_CPU_KV_BYTES * 4
        return int(min(DEFAULT_CPU_KV_BYTES, available * 0.25))

    def release_kv_cache(self) -> None:
        self.graphs = None
        self.kv_caches = []
        self.requests.clear()
        self.history.clear()
        release_freed_memory(self.device)

    # -------------------------------------------------------------- execute

    def _add_request(self, new: NewRequestData) -> None:
        p = new.sampling_params
        self._forget(new.request_id)
        history_slot = -1
        if p.needs_penalties:
            history_slot = self.history.add(new.token_ids, new.num_prompt_tokens)
        output_token_ids = list(new.token_ids[new.num_prompt_tokens :])
        self.requests[new.request_id] = CachedRequestState(
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            params=p,
            output_token_ids=output_token_ids,
            history_slot=history_slot,
            pooling=new.pooling_params,
            lora_slot=new.lora_slot,
        )

    @torch.inference_mode()
    def execute(self, plan: SchedulePlan) -> StepResult:
        """One step: apply the plan, build the inputs, forward, sample, report."""
        self._apply_plan(plan)
        if plan.is_empty:
            return StepResult()
        batch = self._build_inputs(plan)
        hidden = self._forward(batch)
        if not self.stage.is_last:
            return StepResult()  # the last stage samples
        result = StepResult()
        if batch.pool_rows:
            self._pool(hidden, batch.pool_rows, result)
        self._prompt_logprobs(hidden, batch, result)
        if batch.sample_ids:
            self._sample(hidden, batch, plan, result)
        return result

    def allocate_host_kv(self, num_slots: int) -> None:
        pin = self.device.type == "cuda"
        self.host_kv = [
            (
                torch.zeros((num_slots, *k.shape[1:]), dtype=k.dtype, pin_memory=pin),
                torch.zeros((num_slots, *v.shape[1:]), dtype=v.dtype, pin_memory=pin),
            )
            for k, v in self.kv_caches
        ]

    def _copy_host_kv(self, plan: SchedulePlan) -> None:
        """The host tier's copies: saves out first, then loads back in."""
        device = self.device
        saves = torch.tensor(plan.kv_saves, dtype=torch.long).reshape(-1, 2)
        loads = torch.tensor(plan.kv_loads, dtype=torch.long).reshape(-1, 2)
        save_blocks, save_slots = saves[:, 0].to(device), saves[:, 1]
        load_slots, load_blocks = loads[:, 0], loads[:, 1].to(device)
        for (k, v), (hk, hv) in zip(self.kv_caches, self.host_kv, strict=True):
            if len(saves):
                hk[save_slots] = k[save_blocks].to(hk.device)
                hv[save_slots] = v[save_blocks].to(hv.device)
            if len(loads):
                k[load_blocks] = hk[load_slots].to(device, non_blocking=True)
                v[load_blocks] = hv[load_slots].to(device, non_blocking=True)

    def _apply_plan(self, plan: SchedulePlan) -> None:
        """Bring the per-request state up to date with the plan's diffs."""
        if plan.kv_saves or plan.kv_loads:
            self._copy_host_kv(plan)
        for slot, name in plan.lora_loads:
            self.load_lora(slot, name)
        for request_id in plan.finished_request_ids:
            self._forget(request_id)
        for new in plan.new_requests:
            self._add_request(new)
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            for token_id in cached.new_token_ids:  # pipeline parallelism's sampled tokens
                state.token_ids.append(token_id)
                state.output_token_ids.append(token_id)
                if state.history_slot >= 0:
                    self.history.append(state.history_slot, token_id)

    def _build_inputs(self, plan: SchedulePlan) -> _Inputs:
        """The flat batch: decode rows (one query token) first, so they batch as one block."""
        order = sorted(plan.num_scheduled_tokens, key=lambda r: plan.num_scheduled_tokens[r] != 1)
        inputs = _Inputs(StepBatch([], [], [], []))
        attn = inputs.attention
        bs = self.block_size
        spec = plan.spec_token_ids
        for request_id in order:
            state = self.requests[request_id]
            n = plan.num_scheduled_tokens[request_id]
            start = state.num_computed_tokens
            end = start + n
            flat_start = len(inputs.input_ids)
            inputs.rows.append((request_id, flat_start, n))
            inputs.input_ids.extend(state.token_ids[start:end])
            # Speculative decoding: the last sampled token, then the drafts to verify.
            draft = spec.get(request_id, ())
            inputs.input_ids.extend(draft)
            inputs.positions.extend(range(start, end))
            inputs.token_slots.extend([state.lora_slot] * n)
            blocks = state.block_ids
            attn.slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                attn.decode_tables.append(blocks)
                attn.decode_lens.append(end)
            else:
                attn.prefills.append(PrefillChunk(flat_start, n, end, blocks[: -(-end // bs)]))
            if state.params.prompt_logprobs is not None and start < state.num_prompt_tokens - 1:
                last = min(end, state.num_prompt_tokens - 1)
                inputs.prompt_lp_rows.append((request_id, flat_start, start, last - start))
            if state.pooling is not None:
                assert start == 0 and end == len(state.token_ids), "pooling is never chunked"
                inputs.pool_rows.append((request_id, flat_start, n))
            elif end == len(state.token_ids) + len(draft):
                # A verified request samples at its last token and each draft.
                flat_end = len(inputs.input_ids)
                inputs.sample_ids.append(request_id)
                inputs.logit_rows.extend(range(flat_end - 1 - len(draft), flat_end))
        return inputs

    def _forward(self, inputs: _Inputs) -> torch.Tensor:
        """The model's hidden states: every flat token's, or the sampled rows' alone
        (inputs.last_rows set) where nothing reads the others."""
        device = self.device
        attn = inputs.attention
        lora = None
        if self.lora_stacks is not None and any(inputs.token_slots):
            if self.backend.name == "triton":
                from pagoda.kernels.triton_ops.lora import lora_index

                lora = LoRABatch(self.lora_stacks, [], lora_index(inputs.token_slots, device))
            else:
                lora = LoRABatch(self.lora_stacks, lora_groups(inputs.token_slots, device))
        if self.graphs is not None and not attn.prefills:
            hidden = self.graphs.run(
                inputs.input_ids, inputs.positions, attn.slots, attn.decode_tables, attn.decode_lens
            )
            if hidden is not None:
                return hidden
        # Only the sampled tokens' hidden states are needed when no prompt
        # logprobs or pooling read the others (and no LoRA indexes tokens).
        stage = self.stage
        if (
            self.backend.supports_last_rows
            and stage.is_last
            and lora is None
            and not inputs.pool_rows
            and not inputs.prompt_lp_rows
            and len(inputs.logit_rows) < len(inputs.input_ids)
        ):
            inputs.last_rows = torch.tensor(inputs.logit_rows, dtype=torch.long, device=device)
        carry = None
        if not stage.is_first:
            shape = (2, len(inputs.input_ids), self.model_config.hidden_size)
            carry = stage.recv(shape, self.dtype, device)
        hidden = self.model.forward(
            torch.tensor(inputs.input_ids, dtype=torch.long, device=device),
            torch.tensor(inputs.positions, dtype=torch.long, device=device),
            self.backend.build_metadata(attn),
            self.kv_caches,
            lora,
            inputs.last_rows,
            carry,
        )
        if not stage.is_last:
            stage.send(hidden)
        return hidden

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: _Inputs, result: StepResult) -> None:
        for request_id, flat_start, pos, n in inputs.prompt_lp_rows:
            state = self.requests[request_id]
            logits = self.model.compute_logits(hidden[flat_start : flat_start + n]).cpu()
            next_ids = state.token_ids[pos + 1 : pos + 1 + n]
            result.prompt_logprobs[request_id] = (
                pos,
                prompt_logprobs(logits, next_ids, state.params.prompt_logprobs or 0),
            )

    def _sample(
        self, hidden: torch.Tensor, inputs: _Inputs, plan: SchedulePlan, result: StepResult
    ) -> None:
        """Logits of the rows that end their request's tokens, masked, sampled, recorded.

        A request with drafts has a row at its last token and at each draft,
        each sampled as if the drafts before it had been sampled (min_tokens,
        a seed's counter). Its drafts are kept while they equal the token
        sampled at their position; the token sampled at the first mismatch (or
        after the last draft) ends its tokens. With a one-hot draft
        distribution this is exactly rejection sampling: draft t is kept with
        probability p(t), and a rejection leaves a token drawn from p without
        t, renormalised; greedy rows keep the drafts that equal the argmax.
        """
        sample_ids = inputs.sample_ids
        # With last_rows, hidden holds the sampled rows alone, in order.
        sampled = hidden if inputs.last_rows is not None else hidden[inputs.logit_rows]
        logits = self.model.compute_logits(sampled).cpu()  # [num_logit_rows, vocab]
        states = [self.requests[r] for r in sample_ids]
        drafts = [plan.spec_token_ids.get(r, []) for r in sample_ids]
        if plan.grammar_bitmask is not None:
            row_ids = [r for r, d in zip(sample_ids, drafts, strict=True) for _ in d + [0]]
            apply_grammar_bitmask(logits, row_ids, plan.grammar_bitmask)
        rows = [
            self._sampling_row(s, d[:j])
            for s, d in zip(states, drafts, strict=True)
            for j in range(len(d) + 1)
        ]
        token_ids, logprobs = sample(logits, rows, self.history)
        keeps_tokens = self.stage.size == 1  # else they come back in the next plan
        next_row = 0
        for request_id, state, draft in zip(sample_ids, states, drafts, strict=True):
            row, next_row = next_row, next_row + len(draft) + 1
            num_kept = 0
            while num_kept < len(draft) and token_ids[row + num_kept] == draft[num_kept]:
                num_kept += 1
            new_token_ids = token_ids[row : row + num_kept + 1]
            lp = logprobs[row]
            if keeps_tokens:
                for token_id in new_token_ids:
                    state.token_ids.append(token_id)
                    state.output_token_ids.append(token_id)
                    if state.history_slot >= 0:
                        self.history.append(state.history_slot, token_id)
            result.sampled_token_ids[request_id] = new_token_ids[0]
            if lp is not None:
                result.logprobs[request_id] = lp
            if draft:
                result.accepted_token_ids[request_id] = new_token_ids
                # Row j's logprobs are those of the token sampled there: the kept one.
                if lp is not None:
                    kept = logprobs[row : row + num_kept + 1]
                    result.accepted_logprobs[request_id] = [x for x in kept if x is not None]

    def _pool(
        self, hidden: torch.Tensor, rows: list[tuple[str, int, int]], result: StepResult
    ) -> None:
        """The pooled vectors of whole prompts computed in this step."""
        pooled = pool_flat(
            hidden, [r[1] for r in rows], [r[2] for r in rows], self.pooler.pooling_type
        )  # [num_rows, hidden]
        normalize = []
        for request_id, _, _ in rows:
            params = self.requests[request_id].pooling
            flag = params.normalize if params is not None else None
            normalize.append(self.pooler.normalize if flag is None else flag)
        for (request_id, _, _), vector in zip(rows, finish(pooled, normalize), strict=True):
            result.pooled[request_id] = vector

    def _sampling_row(self, state: CachedRequestState, drafts: list[int]) -> SamplingRow:
        """The request's row, at the position after `drafts` (accepted, if it is kept)."""
        return SamplingRow(
            params=state.params,
            output_token_ids=state.output_token_ids + drafts if drafts else state.output_token_ids,
            eos_token_ids=self.eos_token_ids,
            history_slot=state.history_slot,
        )

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and state.history_slot >= 0:
            self.history.release(state.history_slot)


@dataclass
class _Inputs:
    """One step's flat batch, as _build_inputs lays it out."""

    attention: StepBatch
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    rows: list[tuple[str, int, int]] = field(default_factory=list)  # (id, flat start, n)
    token_slots: list[int] = field(default_factory=list)  # each flat token's LoRA slot
    sample_ids: list[str] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # flat index of each sampled row
    prompt_lp_rows: list[tuple[str, int, int, int]] = field(default_factory=list)
    # (id, flat start, pos, n)
    pool_rows: list[tuple[str, int, int]] = field(default_factory=list)  # (id, start, n)
    last_rows: torch.Tensor | None = None  # set when only the sampled rows are computed
