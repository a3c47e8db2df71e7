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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagoda.engine_core.attention.cpu_backend import AttentionMetadata, PrefillSeq
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.plan import NewRequestData, SchedulePlan, StepResult
from pagoda.engine_core.loaders.checkpoint import weight_pairs
from pagoda.engine_core.loaders.gguf import load_gguf_blocks, load_int4_weights
from pagoda.engine_core.model_config import ModelConfig, default_pooler
from pagoda.engine_core.models import model_class
from pagoda.engine_core.models.llama import LlamaModel
from pagoda.engine_core.worker.lora import LoRAAdapter, LoRABatch, LoRAStacks
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
from pagoda.kernels.cpu_ops import (
    SUPPORTED_HEAD_DIMS,
    cpu_has_native,
    has_bf16_attention,
    load_cpu_ops,
)
from pagoda.kernels.linear import int4_available, pairs_available
from pagoda.kernels.lora import lora_groups
from pagoda.protocol.pooling_params import PoolingParams
from pagoda.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine_core.attention.triton_backend import TritonAttentionMetadata
    from pagoda.engine_core.worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 4 << 30
# Prompts of up to this many positions are attended by the compiled kernel
# rather than per-sequence SDPA (where that kernel has no AVX512-BF16 form).
# float32 on 2 AVX2 cores, per layer: 64 prompts of 32 tokens 2.2-3.7 ms vs
# 7.1-7.7 (SDPA); 32 of 128 13-14 vs 17-22; 16 of 256 25-28 vs 27-29; 8 of
# 512 48-64 vs 41-50.
COMPILED_PROMPT_MAX_LEN = 256


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

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # Unseeded requests are keyed from torch's global generator (--seed).
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
            reuse_freed_memory()
        self.model = self._load_model()
        self.block_size = config.block_size
        # CUDA runs the Triton kernels (the model picks them by the same test).
        self.use_triton = self.device.type == "cuda"
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
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
                model_config, config.max_loras, config.max_lora_rank, self.dtype, self.device
            )
        # Built (once per machine, then cached) before serving, not on the first step.
        self.compiled_decode = (
            self.device.type == "cpu"
            and model_config.head_dim in SUPPORTED_HEAD_DIMS
            and load_cpu_ops() is not None
        )
        # Prompt tokens through the same kernel, one query row per token, for
        # the sequences it attends faster than per-sequence SDPA: all of them
        # in its AVX512-BF16 form; otherwise those of at most
        # COMPILED_PROMPT_MAX_LEN positions (a short prompt's SDPA call is
        # mostly fixed cost; past that, SDPA's blocked matmuls win).
        # None: no limit.
        self.compiled_prompt_max_len: int | None = 0
        if self.compiled_decode:
            fast = self.dtype == torch.bfloat16 and has_bf16_attention()
            self.compiled_prompt_max_len = None if fast else COMPILED_PROMPT_MAX_LEN

    def _load_model(self) -> LlamaModel:
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
            self.model_config, self.dtype, self.device
        )
        model.load_weights(weight_pairs(self.model_config), int4, blocks)
        return model

    # ------------------------------------------------------------- KV cache

    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def _cache(self, num_blocks: int) -> torch.Tensor:
        """One layer's key (or value) cache, [num_blocks, block_size, kv_heads,
        head_dim]. Where the compiled CPU kernels read it, it is stored heads
        first (the transposed view of [num_blocks, kv_heads, block_size,
        head_dim]), so that a decode work item, one query row and kv head,
        reads each block's keys and values for its head as one run instead of
        a slice of every position's row: a batch-64 decode step's attention
        takes 7-9% less time in bfloat16, and up to 13% less in float32 once
        blocks are scattered (`python scripts/bench_cpu_kernels.py
        --attention`). The torch and Triton paths keep the plain layout, which
        their gathers and kernels read without a copy."""
        mc = self.model_config
        if self.compiled_decode:
            shape = (num_blocks, mc.num_kv_heads, self.block_size, mc.head_dim)
            return torch.empty(shape, dtype=self.dtype, device=self.device).transpose(1, 2)
        shape = (num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        """Size the cache from the memory budget (or as given); returns the number of blocks."""
        if num_blocks is None:
            budget = self.config.kv_cache_memory_bytes
            if budget is None:
                budget = self._default_kv_budget()
            num_blocks = max(budget // self.kv_bytes_per_block(), 1)
        self.num_kv_blocks = int(num_blocks)
        mc = self.model_config
        self.kv_caches = [
            (self._cache(num_blocks), self._cache(num_blocks)) for _ in range(mc.num_layers)
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
        if self.use_triton and not self.config.enforce_eager and self.lora_stacks is None:
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
        try:
            graphs.capture()
        except Exception as e:  # noqa: BLE001 - any capture failure means: decode eagerly
            logger.warning("CUDA graph capture failed (%s); decoding eagerly", e)
            return
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
        if plan.is_empty:
            return StepResult()

        # Decode rows (one query token) first, so they batch as one block.
        order = sorted(plan.num_scheduled_tokens, key=lambda r: plan.num_scheduled_tokens[r] != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        prefill_rows: list[tuple[int, int, list[int]]] = []  # (query_len, context_len, blocks)
        sample_ids: list[str] = []
        logit_rows: list[int] = []  # flat index of each sampling row's last token
        prompt_lp_rows: list[tuple[str, int, int, int]] = []  # (id, flat start, pos, n)
        pool_rows: list[tuple[str, int, int]] = []  # (id, flat start, n): whole prompts
        token_slots: list[int] = []  # each flat token's LoRA slot
        bs = self.block_size
        max_len = self.compiled_prompt_max_len
        for request_id in order:
            state = self.requests[request_id]
            n = plan.num_scheduled_tokens[request_id]
            start = state.num_computed_tokens
            end = start + n
            flat_start = len(input_ids)
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            token_slots.extend([state.lora_slot] * n)
            blocks = state.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                decode_tables.append(blocks)
                decode_lens.append(end)
            else:
                num_blocks = -(-end // bs)
                prefill_rows.append((n, end, blocks[:num_blocks]))
                prefills.append(
                    PrefillSeq(
                        flat_start,
                        n,
                        end,
                        torch.tensor(blocks[:num_blocks], dtype=torch.long),
                        compiled=max_len is None or end <= max_len,
                    )
                )
            if state.params.prompt_logprobs is not None and start < state.num_prompt_tokens - 1:
                last = min(end, state.num_prompt_tokens - 1)
                prompt_lp_rows.append((request_id, flat_start, start, last - start))
            if state.pooling is not None:
                assert start == 0 and end == len(state.token_ids), "pooling is never chunked"
                pool_rows.append((request_id, flat_start, n))
            elif end == len(state.token_ids):
                sample_ids.append(request_id)
                logit_rows.append(len(input_ids) - 1)

        device = self.device
        hidden = None
        lora = None
        last_rows: torch.Tensor | None = None  # see below: the sampled rows alone
        if self.lora_stacks is not None and any(token_slots):
            if self.use_triton:
                from pagoda.kernels.triton_ops.lora import lora_index

                lora = LoRABatch(self.lora_stacks, [], lora_index(token_slots, device))
            else:
                lora = LoRABatch(self.lora_stacks, lora_groups(token_slots, device))
        if self.graphs is not None and not prefill_rows:
            hidden = self.graphs.run(input_ids, positions, slots, decode_tables, decode_lens)
        if hidden is None:
            meta: AttentionMetadata | TritonAttentionMetadata
            if self.use_triton:
                from pagoda.engine_core.attention.triton_backend import build_metadata

                meta = build_metadata(slots, decode_tables, decode_lens, prefill_rows, device)
            else:
                meta = self._torch_metadata(slots, decode_tables, decode_lens, prefills)
            # Only the sampled tokens' hidden states are needed when no prompt
            # logprobs or pooling read the others (and no LoRA indexes tokens).
            if (
                not self.use_triton
                and lora is None
                and not pool_rows
                and not prompt_lp_rows
                and len(logit_rows) < len(input_ids)
            ):
                last_rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
            hidden = self.model.forward(
                torch.tensor(input_ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device),
                meta,
                self.kv_caches,
                lora,
                last_rows,
            )
        result = StepResult()
        if pool_rows:
            self._pool(hidden, pool_rows, result)
        for request_id, flat_start, pos, n in prompt_lp_rows:
            state = self.requests[request_id]
            logits = self.model.compute_logits(hidden[flat_start : flat_start + n]).cpu()
            next_ids = state.token_ids[pos + 1 : pos + 1 + n]
            result.prompt_logprobs[request_id] = (
                pos,
                prompt_logprobs(logits, next_ids, state.params.prompt_logprobs or 0),
            )
        if sample_ids:
            # With last_rows, hidden holds the sampled rows alone, in order.
            sampled = hidden if last_rows is not None else hidden[logit_rows]
            logits = self.model.compute_logits(sampled).cpu()  # [num_sample, vocab]
            states = [self.requests[r] for r in sample_ids]
            if plan.grammar_bitmask is not None:
                apply_grammar_bitmask(logits, sample_ids, plan.grammar_bitmask)
            rows = [self._sampling_row(s) for s in states]
            token_ids, logprobs = sample(logits, rows, self.history)
            for request_id, token_id, lp in zip(sample_ids, token_ids, logprobs, strict=True):
                state = self.requests[request_id]
                state.token_ids.append(token_id)
                state.output_token_ids.append(token_id)
                if state.history_slot >= 0:
                    self.history.append(state.history_slot, token_id)
                result.sampled_token_ids[request_id] = token_id
                if lp is not None:
                    result.logprobs[request_id] = lp
        return result

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

    def _torch_metadata(
        self,
        slots: list[int],
        decode_tables: list[list[int]],
        decode_lens: list[int],
        prefills: list[PrefillSeq],
    ) -> AttentionMetadata:
        device = self.device
        table = _padded_table(decode_tables)
        prefill_tables = prefill_table_rows = prefill_lens = query_index = None
        compiled = [p for p in prefills if p.compiled]
        if compiled:
            assert prefills[0].query_start == len(decode_tables)
            prefill_tables = _padded_table([p.block_ids for p in compiled])
            prefill_table_rows = torch.repeat_interleave(
                torch.arange(len(compiled)), torch.tensor([p.query_len for p in compiled])
            )
            prefill_lens = torch.cat(
                [torch.arange(p.context_len - p.query_len + 1, p.context_len + 1) for p in compiled]
            )
            if len(compiled) < len(prefills):
                query_index = torch.cat(
                    [torch.arange(p.query_start, p.query_start + p.query_len) for p in compiled]
                ).to(device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decode_tokens=len(decode_tables),
            decode_block_tables=table.to(device),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long, device=device),
            decode_max_len=max(decode_lens, default=0),
            prefills=prefills,
            compiled_decode=self.compiled_decode,
            prefill_tables=prefill_tables,
            prefill_table_rows=prefill_table_rows,
            prefill_lens=prefill_lens,
            prefill_query_index=query_index,
        )

    def _sampling_row(self, state: CachedRequestState) -> SamplingRow:
        return SamplingRow(
            params=state.params,
            output_token_ids=state.output_token_ids,
            eos_token_ids=self.eos_token_ids,
            history_slot=state.history_slot,
        )

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and state.history_slot >= 0:
            self.history.release(state.history_slot)


def _padded_table(rows: Sequence[list[int] | torch.Tensor]) -> torch.Tensor:
    """Block-id rows of different lengths as one int64 table, zero-padded."""
    width = max((len(r) for r in rows), default=0)
    lists = [r for r in rows if isinstance(r, list)]
    if len(lists) == len(rows):
        # One conversion of the padded lists: a sixth of the time of filling
        # the table row by row (64 rows: ~75 vs ~460 us a step).
        padded = [r + [0] * (width - len(r)) for r in lists]
        return torch.tensor(padded, dtype=torch.long).view(len(rows), width)
    table = torch.zeros((len(rows), width), dtype=torch.long)
    for i, blocks in enumerate(rows):
        table[i, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.long)
    return table
