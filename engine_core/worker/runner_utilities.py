"""The runner's control calls besides the step: sleep-mode weights and LoRA adapters.

The executor calls them between steps (sleep / wake-up) and the LoRA manager
calls them when adapters are registered, dropped or given a device slot.
ModelRunner inherits them; this mixin only reads and flips the state
ModelRunner builds.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.worker.lora import LoRAAdapter, LoRAStacks, load_adapter
from pagoda.engine_core.worker.sleep import ParkedWeights, release_freed_memory

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

    if TYPE_CHECKING:

        def _load_model(self) -> LlamaModel: ...

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
