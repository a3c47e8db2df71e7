"""GET /metrics: vLLM's metric names, exact after a known workload."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.frontend.conftest import MODEL_NAME, Server
from tests.frontend.servers import (
    REPO,
    private_server,
)

from .conftest import ENGINE_FLAGS

pytestmark = pytest.mark.slow


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
                found = True
    assert found, f"{name} {labels} not in /metrics"
    return total


def test_metrics_exact_after_known_workload(tmp_path: object) -> None:
    with private_server(tmp_path, ENGINE_FLAGS, name="metrics") as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        for i in range(10):
            c.completions.create(
                model=MODEL_NAME,
                prompt=f"Number {i}",
                max_tokens=10,
                extra_body={"ignore_eos": True},
            )
        text = httpx.get(base + "/metrics").text
        assert metric(text, "vllm:time_to_first_token_seconds_count") == 10
        assert metric(text, "vllm:inter_token_latency_seconds_count") == 90
        assert metric(text, "vllm:request_generation_tokens_sum") == 100
        assert metric(text, "vllm:generation_tokens_total") == 100
        assert metric(text, "vllm:request_success_total", finished_reason="length") == 10
        assert metric(text, "vllm:e2e_request_latency_seconds_count") == 10
        for phase in ("queue", "prefill", "decode", "inference"):
            assert metric(text, f"vllm:request_{phase}_time_seconds_count") == 10
        e2e = metric(text, "vllm:e2e_request_latency_seconds_sum")
        assert 0 < metric(text, "vllm:request_inference_time_seconds_sum") <= e2e
        # Long requests cancelled by the client: running, waiting and KV usage go back to 0.
        for i in range(4):
            try:
                c.with_options(timeout=0.5).completions.create(
                    model=MODEL_NAME,
                    prompt=f"Long {i}",
                    max_tokens=900,
                    extra_body={"ignore_eos": True},
                )
            except openai.APITimeoutError:
                pass
        deadline = time.monotonic() + 15
        while True:
            text = httpx.get(base + "/metrics").text
            values = [
                metric(text, f"vllm:{n}")
                for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
            ]
            if values == [0, 0, 0]:
                break
            assert time.monotonic() < deadline, values
            time.sleep(0.3)
        assert re.search(r"^vllm:prefix_cache_queries_total", text, re.M)
        assert "vllm:cache_config_info" in text


def test_grafana_dashboard_uses_exported_metrics(server: Server) -> None:
    """Every metric the dashboard in docs/grafana queries is served by /metrics."""
    dashboard = json.loads((REPO / "docs" / "grafana" / "pagoda-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"vllm:[a-z_]+", e)}
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    served = set(re.findall(r"^# TYPE (vllm:[a-z_]+)", text, re.M))
    suffixes = ("_bucket", "_total", "_count", "_sum")
    missing = {
        m
        for m in used
        if m not in served and not any(m.endswith(s) and m[: -len(s)] in served for s in suffixes)
    }
    assert len(used) >= 12 and not missing, missing
