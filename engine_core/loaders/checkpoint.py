"""Which loader reads a checkpoint: the one entry point the workers call."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagoda.engine_core.model_config import ModelConfig


def weight_pairs(config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as (Hugging Face name, tensor), whatever its format."""
    if config.is_gguf:
        from pagoda.engine_core.loaders.gguf import gguf_weights

        return gguf_weights(config)
    if config.is_ctranslate2:
        from pagoda.engine_core.loaders.ctranslate2 import ctranslate2_weights

        return ctranslate2_weights(config.path)
    from pagoda.engine_core.loaders.compressed_tensors import (
        dequantized_weights,
        quantization_config,
    )
    from pagoda.engine_core.loaders.safetensors import safetensors_weights

    if quantization_config(config.path) is not None:
        return dequantized_weights(safetensors_weights(config.path))
    return safetensors_weights(config.path)
