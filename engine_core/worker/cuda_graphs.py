"""CUDA graphs of the decode-only forward pass (CUDA path only).

A decode step of b sequences is padded to the smallest captured size n >= b
and replayed: static buffers hold the token ids, positions, slots, block
tables and context lengths. Padding rows write nowhere (slot -1, which
reshape_and_cache skips) and attend to one token of block 0; their outputs
are dropped. The block-table width is fixed at capture (max_model_len), so
the decode kernel's split-K partition count is fixed too. Steps with a
prompt chunk, or wider than the largest size, run eagerly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pagoda.engine_core.attention.triton_backend import TritonAttentionMetadata

if TYPE_CHECKING:
    from pagoda.engine_core.models.llama import LlamaModel

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    """One captured graph per padded decode batch size, sharing one memory pool."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_batch]
        self.max_blocks = max_blocks_per_seq
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, n: int) -> TritonAttentionMetadata:
        empty = self.seq_lens[:0]
        return TritonAttentionMetadata(
            slot_mapping=self.slots[:n],
            num_decode_tokens=n,
            decode_block_tables=self.tables[:n],
            decode_seq_lens=self.seq_lens[:n],
            num_prefill_tokens=0,
            prefill_block_tables=self.tables[:0],
            prefill_cu_seqlens=empty,
            prefill_seq_lens=empty,
            max_prefill_query_len=0,
        )

    def _forward(self, n: int) -> torch.Tensor:
        return self.model.forward(
            self.input_ids[:n], self.positions[:n], self._meta(n), self.kv_caches
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller ones reuse its pool."""
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            self._forward(n)  # compiles the kernels for this size outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self._forward(n)
            self.graphs[n] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        seq_lens: list[int],
    ) -> torch.Tensor | None:
        """Hidden states [b, hidden] of a decode-only step, or None when no graph fits."""
        b = len(input_ids)
        n = next((s for s in self.sizes if s >= b), None)
        if n is None or any(len(t) > self.max_blocks for t in tables):
            return None
        table = torch.zeros(n, self.max_blocks, dtype=torch.int32)
        for i, row in enumerate(tables):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        pad = n - b
        self.input_ids[:n].copy_(torch.tensor(input_ids + [0] * pad), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slots[:n].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        self.tables[:n].copy_(table, non_blocking=True)
        self.seq_lens[:n].copy_(
            torch.tensor(seq_lens + [1] * pad, dtype=torch.int32), non_blocking=True
        )
        self.graphs[n].replay()
        return self.outputs[n][:b]
