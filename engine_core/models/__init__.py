"""Model architectures: one module each, listed here by Hugging Face architecture name.

A model class is built as `cls(model_config, dtype, device)` and then takes
its weights from `load_weights(pairs)` ((Hugging Face name, tensor) pairs
from engine_core/loaders/). Decoders also provide `forward(input_ids,
positions, attention metadata, kv_caches, lora, last_rows)` and
`compute_logits(hidden)`; encoders `embed(input_ids, seq_lens, pooling)`.
Adding an architecture: its module here, one line below, and its config
fields in model_config.py. Imports no torch (model_config reads the names).
"""

from __future__ import annotations

import importlib
from typing import Any

# architecture → "module:class"
DECODERS = {
    "LlamaForCausalLM": "llama:LlamaModel",
    "MistralForCausalLM": "llama:LlamaModel",
    "Qwen2ForCausalLM": "llama:LlamaModel",
    "Qwen3ForCausalLM": "llama:LlamaModel",
    # Mixtures of experts: the same decoder with models/moe.py's MLP.
    "Qwen3MoeForCausalLM": "llama:LlamaModel",
    "MixtralForCausalLM": "llama:LlamaModel",
    "OlmoeForCausalLM": "llama:LlamaModel",
}
ENCODERS = {
    "BertModel": "bert:BertModel",
}
# Encoder-decoders: run by worker/whisper_runner.py (`encode(features)`, then
# `forward(..., segments)` with each request's cross-attention keys/values).
ENCODER_DECODERS = {
    "WhisperForConditionalGeneration": "whisper:WhisperForConditionalGeneration",
}


def model_class(architecture: str) -> Any:
    """The class that implements a supported architecture."""
    module, _, name = {**DECODERS, **ENCODERS, **ENCODER_DECODERS}[architecture].partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
