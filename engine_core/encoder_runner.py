"""EncoderRunner: runs pooling plans on a BERT-style encoder, with no KV cache.

An encoder attends in both directions, so every request is computed whole
in the step that schedules it and nothing outlives the step: the scheduler's
blocks are bookkeeping only (enough for one step's tokens), with no memory
behind them.
"""

from __future__ import annotations

import os

import torch

from engine_core.config import EngineConfig
from engine_core.model_config import ModelConfig, default_pooler
from engine_core.model_runner import resolve_device
from engine_core.models.bert import BertModel, load_encoder_weights
from engine_core.plan import SchedulePlan, StepResult
from engine_core.pooler import finish

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EncoderRunner:
    """Weights and the batched forward pass of an encoder; pooled vectors out."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        # Encoders are small; float32 keeps embeddings within 1e-6 of the reference.
        self.dtype = torch.float32 if config.dtype == "auto" else _DTYPES[config.dtype]
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        weights = load_encoder_weights(model_config.path)
        self.model = BertModel(model_config, weights, self.dtype, self.device)
        self.pooler = default_pooler(model_config)

    def allocate_kv_cache(self) -> int:
        """No cache: as many (empty) blocks as one full step can use."""
        bs = self.config.block_size
        # Each request wastes at most one partial block.
        return -(-self.config.max_num_batched_tokens // bs) + self.config.max_num_seqs

    @torch.inference_mode()
    def execute(self, plan: SchedulePlan) -> StepResult:
        assert not plan.cached_requests, "encoder requests never outlive their step"
        result = StepResult()
        if plan.is_empty:
            return result
        ids: list[int] = []
        seq_lens: list[int] = []
        normalize: list[bool] = []
        for new in plan.new_requests:
            assert plan.num_scheduled_tokens[new.request_id] == len(new.token_ids)
            ids.extend(new.token_ids)
            seq_lens.append(len(new.token_ids))
            params = new.pooling_params
            flag = params.normalize if params is not None else None
            normalize.append(self.pooler.normalize if flag is None else flag)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [num_tokens]
        pooled = self.model.embed(input_ids, seq_lens, self.pooler.pooling_type)  # [batch, hidden]
        for new, vector in zip(plan.new_requests, finish(pooled, normalize), strict=True):
            result.pooled[new.request_id] = vector
        return result
