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


def dashboard_queries(node: object) -> list[str]:
    """Every PromQL string of a Grafana dashboard: panel targets (rows' panels too)
    and the template variables' queries."""
    if isinstance(node, list):
        return [q for item in node for q in dashboard_queries(item)]
    if not isinstance(node, dict):
        return []
    found = [v for k, v in node.items() if k in ("expr", "query") and isinstance(v, str)]
    return found + [q for v in node.values() for q in dashboard_queries(v)]


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: a name before a selector or a range,
    and any name with a colon (functions are followed by a parenthesis instead)."""
    before_selector = re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=[{\[])", expr)
    with_colon = re.findall(r"\b[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+", expr)
    return set(before_selector) | set(with_colon)


def test_grafana_dashboard_uses_exported_metrics(server: Server) -> None:
    """Every metric the dashboard in docs/grafana queries is a series /metrics
    serves, under the model_name label the dashboard filters on."""
    dashboard = json.loads((REPO / "docs" / "grafana" / "pagoda-dashboard.json").read_text())
    queries = [q for q in dashboard_queries(dashboard) if q != "prometheus"]
    used = {name for q in queries for name in promql_metric_names(q)}
    # Labelled series appear once observed: one request first.
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(server.v1 + "/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    samples = re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?", text, re.M)
    served = {name for name, _ in samples}
    labelled = {name for name, labels in samples if f'model_name="{MODEL_NAME}"' in labels}
    assert len(used) >= 12 and not used - served, used - served
    assert not used - labelled, used - labelled
