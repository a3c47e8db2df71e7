"""PoolingParams: how one pooling request is answered, with vLLM's field names.

A request that carries PoolingParams finishes after its prompt is computed,
with one pooled vector (little-endian float32 bytes in its output delta)
instead of sampled tokens.
"""

from __future__ import annotations

import msgspec

from pagoda.protocol.sampling_params import SamplingParamsError

POOLING_TASKS = ("embed",)


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Per-request pooling options.

    `normalize` None keeps the model's own setting (sentence-transformers'
    Normalize module for encoders, on for decoders served with
    `--runner pooling`). `dimensions` asks for a shortened (Matryoshka)
    vector; no model Pagoda serves supports it, so any value is refused.
    """

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None

    def validate(self) -> None:
        if self.task not in POOLING_TASKS:
            raise SamplingParamsError(
                "task", f"pooling task must be one of {list(POOLING_TASKS)}, got {self.task!r}"
            )
        if self.dimensions is not None:
            raise SamplingParamsError(
                "dimensions",
                "this model does not support matryoshka representation; dimensions cannot be set",
            )
