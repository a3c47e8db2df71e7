"""--speculative-config end to end: an engine core and an API server of their
own, greedy chat output equal to the shared server's (no speculation), and
vLLM's speculative-decoding counters in /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx

from pagoda.frontend.dp_client import DPClient
from pagoda.protocol.messages import SchedulerStats
from tests.frontend.conftest import ENGINE_FLAGS, Server
from tests.frontend.servers import private_server

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
TEXT = (
    "The old lighthouse stood at the end of the rocky point for more than a hundred years. "
    "Every night its keeper climbed the spiral stairs and polished the great lens."
)


def chat(base: str) -> str:
    body = {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}],
        "temperature": 0,
        "max_tokens": 48,
    }
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def counter(metrics: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", metrics, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_speculative_server_matches_plain_greedy(server: Server, tmp_path: Path) -> None:
    flags = (*ENGINE_FLAGS, "--speculative-config", json.dumps(SPEC))
    with private_server(tmp_path, flags, name="spec") as base:
        text = chat(base)
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert text == chat(server.base_url)
    assert TEXT[:40] in text  # the model does repeat it: lookup has something to find
    accepted = counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    drafted = counter(metrics, "vllm:spec_decode_num_draft_tokens_total")
    assert 0 < accepted <= drafted
    assert counter(metrics, "vllm:spec_decode_num_drafts_total") > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in metrics


def test_data_parallel_stats_add_the_counters_by_position() -> None:
    """Engines' accepted-per-position lists add up position by position (an
    engine without speculation sends none)."""
    client = DPClient.__new__(DPClient)
    client.clients = [  # type: ignore[assignment]
        SimpleNamespace(
            stats=SchedulerStats(
                spec_decode_num_accepted_tokens=5, spec_decode_num_accepted_tokens_per_pos=[3, 2]
            )
        ),
        SimpleNamespace(stats=SchedulerStats()),
        SimpleNamespace(
            stats=SchedulerStats(
                spec_decode_num_accepted_tokens=4, spec_decode_num_accepted_tokens_per_pos=[2, 1, 1]
            )
        ),
    ]
    total = client.stats
    assert total.spec_decode_num_accepted_tokens == 9
    assert total.spec_decode_num_accepted_tokens_per_pos == [5, 3, 1]
