"""Schemathesis against the served /openapi.json: every route, a few examples each.

scripts/fuzz.py runs the big version (500+ examples per route).
"""

from __future__ import annotations

import httpx

from tests.frontend.conftest import Server
from tests.frontend.fuzzing import fuzz_all

EXAMPLES_PER_ROUTE = 2


def test_fuzz_every_route(server: Server) -> None:
    results = fuzz_all(server.base_url, EXAMPLES_PER_ROUTE)
    assert len(results) >= 25  # every public route was reached
    problems = [f"{r.route}: {p}" for r in results for p in r.problems]
    assert not problems, "\n".join(problems[:10])
    assert sum(r.server_errors for r in results) == 0
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
