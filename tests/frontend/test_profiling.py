"""/start_profile and /stop_profile (both spellings) and the SDK's profile controls."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pagoda import LLM, SamplingParams
from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME, Server
from tests.frontend.servers import private_server

pytestmark = pytest.mark.slow


def test_profiling_off_without_profiler_dir(server: Server) -> None:
    r = httpx.post(server.base_url + "/start_profile")
    assert r.status_code == 400 and "--profiler-dir" in r.json()["error"]["message"]
    assert httpx.post(server.base_url + "/reset-prefix-cache").status_code == 200


def test_profile_over_http_writes_a_trace(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    flags = (*ENGINE_FLAGS, "--profiler-dir", str(traces))
    with private_server(tmp_path, flags, name="profile") as base:
        assert httpx.post(base + "/start-profile").status_code == 200
        assert httpx.post(base + "/start_profile").status_code == 400  # already running
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3}
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
        r = httpx.post(base + "/stop_profile", timeout=120)
        assert r.status_code == 200
        trace = Path(r.json()["trace"])
        assert trace.parent == traces and trace.is_file()
        events = json.loads(trace.read_text())["traceEvents"]
        assert any("linear" in str(e.get("name", "")) for e in events)
        assert httpx.post(base + "/stop-profile").status_code == 400  # none running


def test_llm_profile_controls(tmp_path: Path) -> None:
    llm = LLM(
        dtype="float32",
        kv_cache_memory_bytes=32 << 20,
        max_model_len=256,
        profiler_dir=str(tmp_path),
    )
    llm.start_profile()
    llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    path = Path(llm.stop_profile())
    assert path.is_file() and path.parent == tmp_path
