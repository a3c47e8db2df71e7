"""64 concurrent seeded requests with long-ish prompts: all succeed, and each seed
gives the same text when its request runs again alone.

Re-running all 64 alone takes minutes on a shared 2-core CPU; the suite
re-runs every 4th (16), PAGODA_ALL_SEEDS=1 re-runs all 64.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx

from tests.frontend.conftest import Server

_RERUN = range(64) if os.environ.get("PAGODA_ALL_SEEDS") == "1" else range(0, 64, 4)
_WORDS = "river stone lantern maple copper harbor quiet meadow orbit velvet".split()


def _prompt(i: int) -> str:
    # ~250-400 tokens, different for every request.
    return " ".join(_WORDS[(i * 7 + k * k) % len(_WORDS)] for k in range(200 + 3 * i))


async def _complete(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
    r = await client.post(
        "/v1/completions",
        json={"prompt": _prompt(i), "max_tokens": 12, "temperature": 1.0, "seed": 1000 + i},
    )
    assert r.status_code == 200, r.text[:300]
    return dict(r.json()["choices"][0])


def test_64_concurrent_seeds_reproduce_alone(server: Server) -> None:
    async def run() -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
        limits = httpx.Limits(max_connections=64)
        base = server.base_url
        async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
            together = await asyncio.gather(*(_complete(client, i) for i in range(64)))
            alone = {i: await _complete(client, i) for i in _RERUN}
        return list(together), alone

    together, alone = asyncio.run(run())
    assert len({c["text"] for c in together}) > 32  # the seeds really differ
    mismatched = [i for i in _RERUN if together[i]["text"] != alone[i]["text"]]
    assert not mismatched, [(i, together[i]["text"], alone[i]["text"]) for i in mismatched[:3]]
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
