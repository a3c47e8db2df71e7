"""The API server side never imports torch."""

from __future__ import annotations

from tests.no_torch import assert_imports_no_torch

FRONTEND_MODULES = (
    "pagoda",
    "pagoda.frontend",
    "pagoda.frontend.cli",
    "pagoda.frontend.pagoda_cli",
    "pagoda.frontend.bench.cli",
    "pagoda.frontend.api.app",
    "pagoda.frontend.async_llm",
    "pagoda.frontend.engine_client",
    "pagoda.frontend.output_processor",
    "pagoda.frontend.processor",
    "pagoda.frontend.tokenizer",
    "pagoda.protocol.addresses",
    "pagoda.engine_core.args",
    "pagoda.protocol.envs",
)


def test_frontend_imports_no_torch() -> None:
    assert_imports_no_torch(FRONTEND_MODULES)
