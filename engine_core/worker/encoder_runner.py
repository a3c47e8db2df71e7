"""EncoderRunner: runs pooling plans on a BERT-style encoder, with no KV cache.

An encoder attends in both directions, so every request is computed whole
in the step that schedules it and nothing outlives the step: the scheduler's
blocks are bookkeeping only (enough for one step's tokens), with no memory
behind them. A step's sequences are padded into groups of similar length,
so that short prompts batched with a long one do not pay for its padding.
"""

from __future__ import annotations

import os

import torch

from pagoda.engine_core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from pagoda.engine_core.core.plan import SchedulePlan, StepResult
from pagoda.engine_core.loaders.checkpoint import weight_pairs
from pagoda.engine_core.model_config import ModelConfig, default_pooler
from pagoda.engine_core.models import model_class
from pagoda.engine_core.models.bert import BertModel
from pagoda.engine_core.worker.model_runner import resolve_device, resolve_dtype
from pagoda.engine_core.worker.pooler import finish


class EncoderRunner:
    """Weights and the batched forward pass of an encoder; pooled vectors out."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        # Encoders are small; float32 keeps embeddings within 1e-6 of the reference.
        self.dtype = (
            torch.float32 if config.dtype == "auto" else resolve_dtype(config.dtype, self.device)
        )
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        self.model: BertModel = model_class(model_config.architecture)(
            model_config, self.dtype, self.device
        )
        self.model.load_weights(weight_pairs(model_config))
        self.pooler = default_pooler(model_config)

    def allocate_kv_cache(self) -> int:
        """No cache: as many (empty) blocks as one full step can use."""
        bs = self.config.block_size
        budget = self.config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        # Each request wastes at most one partial block.
        return -(-budget // bs) + self.config.max_num_seqs

    @torch.inference_mode()
    def execute(self, plan: SchedulePlan) -> StepResult:
        assert not plan.cached_requests, "encoder requests never outlive their step"
        result = StepResult()
        if plan.is_empty:
            return result
        for group in padding_groups([len(new.token_ids) for new in plan.new_requests]):
            news = [plan.new_requests[i] for i in group]
            ids: list[int] = []
            normalize: list[bool] = []
            for new in news:
                assert plan.num_scheduled_tokens[new.request_id] == len(new.token_ids)
                ids.extend(new.token_ids)
                params = new.pooling_params
                flag = params.normalize if params is not None else None
                normalize.append(self.pooler.normalize if flag is None else flag)
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [num_tokens]
            seq_lens = [len(new.token_ids) for new in news]
            pooled = self.model.embed(input_ids, seq_lens, self.pooler.pooling_type)  # [b, hidden]
            for new, vector in zip(news, finish(pooled, normalize), strict=True):
                result.pooled[new.request_id] = vector
        return result


def padding_groups(lens: list[int], max_waste: float = 0.25) -> list[list[int]]:
    """Indices grouped by length so that padding adds at most `max_waste` per group."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    groups: list[list[int]] = []
    group: list[int] = []
    num_real = 0
    for i in order:
        # Sorted ascending: lens[i] is the group's padded length if i joins.
        if group and (len(group) + 1) * lens[i] > (1 + max_waste) * (num_real + lens[i]):
            groups.append(group)
            group, num_real = [], 0
        group.append(i)
        num_real += lens[i]
    if group:
        groups.append(group)
    return groups
