"""Pagoda's frontend: API servers and the Python SDK (LLM, AsyncLLM).

Nothing here imports torch; the offline LLM reaches the engine (and torch)
only when it is constructed.
"""

from typing import TYPE_CHECKING, Any

from pagoda.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.protocol.messages import LoRARequest
from pagoda.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.frontend.async_llm import AsyncLLM
    from pagoda.frontend.llm import LLM

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import frontend` stays cheap for the API server.
    if name == "LLM":
        from pagoda.frontend.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from pagoda.frontend.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
