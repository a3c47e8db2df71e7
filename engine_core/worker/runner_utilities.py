"""The runner's control calls besides the step: sleep-mode weights and LoRA adapters.

The executor calls them between steps (sleep / wake-up) and the LoRA manager
calls them when adapters are registered, dropped or given a device slot.
ModelRunner inherits them; this mixin only reads and flips the state
ModelRunner builds.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.worker.lora import LoRAAdapter, LoRAStacks, load_adapter
from pagoda.engine_core.worker.sleep import ParkedWeights, release_freed_memory
from pagoda.engine_core.worker.weight_transfer import (
    WeightTransfer,
    WeightUpdateError,
    check_against_model,
    check_update_info,
    checksum,
    packed_buffer_bytes,
    read_safetensors,
)

if TYPE_CHECKING:
    from pagoda.engine_core.models.llama import LlamaModel

logger = logging.getLogger(__name__)


class RunnerUtilities:
    """Sleep-mode offload / reload of the weights and the LoRA adapter registry."""

    # Built by ModelRunner.__init__.
    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    model: LlamaModel
    # Sleep mode: the parked weights (level 1), or None with model None (level 2).
    _parked: ParkedWeights | None
    # LoRA: registered adapters on the CPU, and the device slots they are copied into.
    lora_adapters: dict[str, LoRAAdapter]
    lora_stacks: LoRAStacks | None

    # Weight updates (ModelRunner.__init__ documents them).
    weight_overrides: dict[str, torch.Tensor]
    weight_shapes: dict[str, tuple[int, ...]]
    weight_transfer: WeightTransfer | None
    num_kv_blocks: int
    graphs: Any

    if TYPE_CHECKING:

        def _load_model(self) -> LlamaModel: ...

        def _capture_graphs(self, num_blocks: int) -> None: ...

    # ------------------------------------------------------- weight updates

    def init_weight_transfer(self, backend: str, init_info: dict[str, Any], rank: int) -> None:
        """Join the trainer's group as rank_offset + `rank` (blocks until it joins too)."""
        if backend == "file":
            raise WeightUpdateError(
                "the file backend needs no group: POST /update_weights with update_info.path"
            )
        self.weight_transfer = WeightTransfer(backend, init_info, rank, self.device)

    def receive_weights(self, update_info: dict[str, Any]) -> int:
        """Take the tensors the trainer broadcasts, then load them; returns how many."""
        names, dtype_names, shapes = check_update_info(update_info)
        if self.weight_transfer is None:
            raise WeightUpdateError(
                "no weight transfer group: POST /init_weight_transfer_engine first"
            )
        # Every tensor is taken off the wire before any is checked, so that a
        # refused update leaves the trainer's broadcasts matched, not hanging.
        packed = packed_buffer_bytes(update_info)
        pairs = self.weight_transfer.receive(names, dtype_names, shapes, packed)
        return self._apply_weights(pairs)

    def load_weights_from_file(self, path: str, names: list[str] | None) -> int:
        """The `file` backend: tensors from a safetensors file or directory."""
        return self._apply_weights(read_safetensors(path, names))

    def weight_checksums(self) -> dict[str, str]:
        """sha256 of every tensor the serving weights were built from, by name:
        as the trainer sent it where it was replaced, else as the checkpoint has it."""
        from pagoda.engine_core.loaders.checkpoint import weight_pairs

        sums = {}
        for name, tensor in weight_pairs(self.model_config):
            sums[name] = checksum(self.weight_overrides.get(name, tensor))
        return sums

    def _apply_weights(self, pairs: list[tuple[str, torch.Tensor]]) -> int:
        """Check every tensor against the model, then rebuild it with them in
        place; the old model serves until the new one is whole."""
        tied = self.model_config.tie_word_embeddings
        check_against_model(pairs, self.weight_shapes, tied)
        previous = self.weight_overrides
        self.weight_overrides = {**previous, **dict(pairs)}
        if self._parked is not None:  # asleep at level 1: the parked copy is stale
            self._parked.discard()
            self._parked = None
            self.model = None  # type: ignore[assignment]
        if self.model is None:
            return len(pairs)  # asleep: wake-up builds the model with them
        try:
            model = self._load_model()
        except Exception:
            self.weight_overrides = previous
            raise
        self.model = model
        if self.graphs is not None:  # captured around the old weights
            self.graphs = None
            self._capture_graphs(self.num_kv_blocks)
        release_freed_memory(self.device)
        logger.info("loaded %d updated tensors", len(pairs))
        return len(pairs)

    # ----------------------------------------------------------- sleep mode

    def offload_weights(self, keep_copy: bool, spill_dir: str | None = None) -> None:
        """Take the weights out of memory; keep an exact copy (level 1) or not (level 2)."""
        if self.model is None:
            return  # already dropped
        if self._parked is not None:
            if not keep_copy:  # level 2 after level 1: forget the copy too
                self._parked.discard()
                self._parked = None
                self.model = None  # type: ignore[assignment]
                release_freed_memory(self.device)
            return
        if keep_copy:
            self._parked = ParkedWeights(self.model, self.device, spill_dir)
            logger.info("weights parked (%.0f MiB)", self._parked.nbytes / 2**20)
        else:
            self.model = None  # type: ignore[assignment]
            release_freed_memory(self.device)

    def reload_weights(self) -> None:
        """Undo offload_weights: restore the parked copy or rebuild from the model file."""
        if self._parked is not None:
            self._parked.restore()
            self._parked = None
        elif self.model is None:
            self.model = self._load_model()

    @property
    def weights_offloaded(self) -> bool:
        return self._parked is not None or self.model is None

    # ----------------------------------------------------------------- LoRA

    def register_lora(self, name: str, path: str) -> int:
        """Read and check an adapter into host memory; returns its rank (LoRAError if bad)."""
        if self.lora_stacks is None:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora")
        stacks = self.lora_stacks
        adapter = load_adapter(path, stacks.whole_config, self.config.max_lora_rank, stacks.tp)
        self.lora_adapters[name] = adapter
        return adapter.rank

    def unregister_lora(self, name: str) -> None:
        self.lora_adapters.pop(name, None)

    def load_lora(self, slot: int, name: str) -> None:
        """Copy a registered adapter into a device slot."""
        assert self.lora_stacks is not None
        self.lora_stacks.load(slot, self.lora_adapters[name])
