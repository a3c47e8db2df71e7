"""The API server side never imports torch."""

from __future__ import annotations

from tests.no_torch import assert_imports_no_torch

FRONTEND_MODULES = (
    "frontend",
    "frontend.cli",
    "frontend.pagoda_cli",
    "frontend.api.app",
    "frontend.async_llm",
    "frontend.engine_client",
    "frontend.output_processor",
    "frontend.processor",
    "frontend.tokenizer",
    "engine_core.addresses",
    "engine_core.args",
    "engine_core.envs",
)


def test_frontend_imports_no_torch() -> None:
    assert_imports_no_torch(FRONTEND_MODULES)
