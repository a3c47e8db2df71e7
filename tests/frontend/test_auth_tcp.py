"""API keys, a tcp engine address, and /health when the engine goes away."""

from __future__ import annotations

import os
import signal
import time

import anthropic
import httpx
import openai
import pytest

from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME
from tests.frontend.servers import (
    Processes,
    api_argv,
    engine_argv,
    engine_tcp_ports,
    private_server,
    wait_healthy,
)

pytestmark = pytest.mark.slow


def test_tcp_engine_with_api_key_and_health_turning_503() -> None:
    procs = Processes()
    engine_port, http_port = engine_tcp_ports()
    address = f"tcp://127.0.0.1:{engine_port}"
    engine = procs.start(engine_argv(address, *ENGINE_FLAGS), "engine-tcp")
    procs.start(
        api_argv(address, http_port, "--api-key", "sesame", "--metrics-require-auth"), "api-tcp"
    )
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_healthy(base, procs)
        # /health needs no key; /v1 routes do.
        r = httpx.post(base + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(base + "/metrics").status_code == 401
        keyed = httpx.get(base + "/metrics", headers={"Authorization": "Bearer sesame"})
        assert keyed.status_code == 200 and "vllm:" in keyed.text
        assert httpx.get(base + "/version").status_code == 200
        # Anthropic's client sends the key as x-api-key; a wrong one is 401 in its shape.
        msg = anthropic.Anthropic(base_url=base, api_key="sesame", max_retries=0).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert msg.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as denied:
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        assert denied.value.body["type"] == "error"  # type: ignore[index]
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0)
        out = good.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
        # The engine dies: health turns 503 within a couple of seconds.
        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = httpx.post(
            base + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
            headers={"Authorization": "Bearer sesame"},
            timeout=30,
        )
        assert r.status_code >= 500 and "error" in r.json()
    finally:
        procs.stop()


def test_echo_with_logprobs(tmp_path: object) -> None:
    with private_server(tmp_path, ENGINE_FLAGS, name="echo") as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        prompt = [1, 504, 3575, 282]
        out = c.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=3, logprobs=2, echo=True, temperature=0
        )
        lp = out.choices[0].logprobs
        assert lp is not None
        assert len(lp.tokens) == len(prompt) + 3
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
        assert out.choices[0].text.startswith("The capital of")
