"""Sampling flags of `pagoda bench` (and scripts/profile_step.py), named as vLLM's.

A flag left out is not sent (or set): the server's (or SamplingParams')
default applies, as with vLLM's client. Every report prints the settings
it ran with, so no figure is quoted without them.
"""

from __future__ import annotations

import argparse
from typing import Any

# flag name (dashes as underscores) -> type
SAMPLING_FLAGS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "frequency_penalty": float,
    "presence_penalty": float,
}


def add_sampling_flags(parser: argparse.ArgumentParser, temperature: float | None = None) -> None:
    group = parser.add_argument_group("sampling (left out: the server's default)")
    for name, kind in SAMPLING_FLAGS.items():
        default = temperature if name == "temperature" else None
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    group.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="seed each request: request i gets this seed + i",
    )


def sampling_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given, as request fields (seed: the base seed)."""
    settings = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    settings["seed"] = args.sampling_seed
    return {k: v for k, v in settings.items() if v is not None}


def describe_sampling(args: argparse.Namespace, defaults: str = "server defaults") -> str:
    settings = sampling_settings(args)
    if not settings:
        return defaults
    return " ".join(f"{k}={v}" for k, v in settings.items())
