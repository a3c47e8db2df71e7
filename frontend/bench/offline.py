"""What `pagoda bench throughput` and `pagoda bench latency` share: the in-process LLM.

Both take the engine flags of `pagoda serve` and vLLM's sampling flags
(`sampling.py`); torch is imported only when the LLM is built, so that
`pagoda` itself starts without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import TYPE_CHECKING, Any

from pagoda.frontend.bench.sampling import sampling_settings

if TYPE_CHECKING:
    from pagoda.frontend.llm import LLM
    from pagoda.protocol.sampling_params import SamplingParams


def make_llm(ns: argparse.Namespace) -> LLM:
    """The offline LLM with the engine flags given on the command line."""
    from pagoda.engine_core.args import engine_config_from_args
    from pagoda.frontend.llm import LLM

    config = engine_config_from_args(ns)
    engine_args = {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model"
    }
    return LLM(config.model, **engine_args)


def sampling_params(ns: argparse.Namespace, max_tokens: int) -> SamplingParams:
    """The sampling flags given (others: SamplingParams' defaults), exactly max_tokens out."""
    from pagoda.protocol.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=ns.ignore_eos, **sampling_settings(ns))


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    """mean, median and p99 of `seconds`, in milliseconds."""
    ms = sorted(s * 1000 for s in seconds) or [0.0]
    return {
        "mean": statistics.fmean(ms),
        "median": statistics.median(ms),
        "p99": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))],
    }


def write_json(path: str | None, report: dict[str, Any]) -> None:
    if path:
        import json

        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {path}")
