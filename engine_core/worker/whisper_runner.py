"""WhisperRunner: a ModelRunner for Whisper's encoder-decoder.

The decoder runs as any decoder does (the plan's diffs, the flat batch, the
paged KV cache, sampling: all ModelRunner's). What it adds is the audio: when
a request is admitted (first, or again after preemption) the encoder runs
once on its log-mel window, batched with the other requests admitted in the
same step, and the decoder's cross-attention keys and values of that output
are kept, per request, until the request finishes or is preempted. Requests
with the same window (the API server's one-token no-speech request beside a
window's transcription) share one encoder pass and one copy of that state.
Each step
the runner tells the model which flat tokens belong to which request, so each
attends to its own audio. Eager only (no CUDA graphs), no LoRA, one rank.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.plan import NewRequestData, SchedulePlan
from pagoda.engine_core.model_config import ModelConfig, ModelLoadError
from pagoda.engine_core.models.whisper import CrossSegment, WhisperForConditionalGeneration
from pagoda.engine_core.worker.model_runner import ModelRunner, _Inputs

# Encoder passes batch at most this many requests (bounds the activations).
MAX_ENCODER_BATCH = 8


class WhisperRunner(ModelRunner):
    """ModelRunner's decoder steps plus each request's encoder pass and cross-attention state."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        if config.enable_lora:
            raise ValueError("LoRA adapters are not supported on Whisper models")
        assert model_config.whisper is not None
        self.cross_kv: dict[str, torch.Tensor] = {}  # request id → [layers, 2, heads, S, d]
        self._to_encode: dict[str, bytes] = {}
        # Windows encoded for requests still here: features → (state, users).
        self._encoded: dict[bytes, tuple[torch.Tensor, set[str]]] = {}
        self._features_of: dict[str, bytes] = {}
        self.whisper: WhisperForConditionalGeneration  # set by _load_model
        super().__init__(config, model_config)

    def _load_model(self) -> Any:
        model = WhisperForConditionalGeneration(
            self.model_config, self.dtype, self.device, self.backend
        )
        int8, stored = self._int8_weights()
        if stored:
            raise ModelLoadError("int8 checkpoints of Whisper are not supported: give its weights")
        model.load_weights(self._weight_pairs(), int8)
        self.whisper = model  # self.model too, typed as ModelRunner's decoders
        return model

    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        """As ModelRunner's, but a budget-sized cache stops at what `max_num_seqs`
        requests of the decoder's full length can use (Whisper's is 448 tokens),
        leaving the rest of the budget's memory to their cross-attention state."""
        if num_blocks is None:
            budget = self.config.kv_cache_memory_bytes
            if budget is None:
                budget = self._default_kv_budget()
            per_seq = -(-self.model_config.max_position_embeddings // self.block_size)
            num_blocks = max(
                min(budget // self.kv_bytes_per_block(), self.config.max_num_seqs * per_seq), 1
            )
        return super().allocate_kv_cache(num_blocks)

    def _capture_graphs(self, num_blocks: int) -> None:
        return  # the cross-attention segments change every step: decode eagerly

    def release_kv_cache(self) -> None:
        self.cross_kv.clear()
        self._to_encode.clear()
        self._encoded.clear()
        self._features_of.clear()
        super().release_kv_cache()

    # --------------------------------------------------------- request state

    def _add_request(self, new: NewRequestData) -> None:
        super()._add_request(new)
        if new.encoder_features is None:
            raise ValueError(f"request {new.request_id}: a Whisper request needs encoder_features")
        self._to_encode[new.request_id] = new.encoder_features

    def _forget(self, request_id: str) -> None:
        super()._forget(request_id)
        self.cross_kv.pop(request_id, None)
        self._to_encode.pop(request_id, None)
        features = self._features_of.pop(request_id, None)
        if features is not None:
            _, users = self._encoded[features]
            users.discard(request_id)
            if not users:
                del self._encoded[features]

    def _apply_plan(self, plan: SchedulePlan) -> None:
        super()._apply_plan(plan)
        if self._to_encode:
            self._encode_pending()

    def _encode_pending(self) -> None:
        """Run the encoder on the newly admitted requests' features, a batch at a time."""
        whisper = self.model_config.whisper
        assert whisper is not None
        shape = (whisper.num_mel_bins, whisper.num_input_frames)
        # One pass per distinct window not encoded yet (bytes hash and compare).
        windows = list(dict.fromkeys(f for f in self._to_encode.values() if f not in self._encoded))
        for i in range(0, len(windows), MAX_ENCODER_BATCH):
            batch = windows[i : i + MAX_ENCODER_BATCH]
            features = torch.stack(
                [torch.frombuffer(bytearray(f), dtype=torch.float32).view(shape) for f in batch]
            ).to(device=self.device, dtype=self.dtype)  # [B, n_mels, frames]
            cross = self.whisper.encode(features)  # [B, layers, 2, heads, S, d]
            for window, kv in zip(batch, cross, strict=True):
                # Its own copy: a view would hold the whole batch's memory
                # until the last request of the batch finished.
                self._encoded[window] = (kv.clone(), set())
        for request_id, window in self._to_encode.items():
            kv, users = self._encoded[window]
            users.add(request_id)
            self._features_of[request_id] = window
            self.cross_kv[request_id] = kv
        self._to_encode.clear()

    # ------------------------------------------------------------------ step

    def _forward(self, inputs: _Inputs) -> torch.Tensor:
        """The decoder over ModelRunner's flat batch, each request's tokens
        attending to its own audio."""
        device = self.device
        segments = [CrossSegment(start, n, self.cross_kv[r]) for r, start, n in inputs.rows]
        return self.whisper.forward(
            torch.tensor(inputs.input_ids, dtype=torch.long, device=device),
            torch.tensor(inputs.positions, dtype=torch.long, device=device),
            self.backend.build_metadata(inputs.attention),
            self.kv_caches,
            segments,
        )
