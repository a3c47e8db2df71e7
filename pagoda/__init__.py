"""Pagoda: an LLM inference server and its Python SDK.

    from pagoda import LLM, SamplingParams

The four packages live in the repository's top-level folders and are
imported under this namespace (the entries here are links to them):
pagoda.protocol (wire format), pagoda.engine_core, pagoda.frontend,
pagoda.kernels. Importing `pagoda` itself imports nothing else; the names
below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagoda.frontend.llm",
    "AsyncLLM": "pagoda.frontend.async_llm",
    "SamplingParams": "pagoda.protocol.sampling_params",
    "PoolingParams": "pagoda.protocol.pooling_params",
    "LoRARequest": "pagoda.protocol.messages",
    "RequestOutput": "pagoda.frontend.outputs",
    "CompletionOutput": "pagoda.frontend.outputs",
    "Logprob": "pagoda.frontend.outputs",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "PoolingParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "__version__",
]

if TYPE_CHECKING:
    from pagoda.frontend.async_llm import AsyncLLM
    from pagoda.frontend.llm import LLM
    from pagoda.frontend.outputs import CompletionOutput, Logprob, RequestOutput
    from pagoda.protocol.messages import LoRARequest
    from pagoda.protocol.pooling_params import PoolingParams
    from pagoda.protocol.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
