"""`pagoda bench`: serve against a real `pagoda serve`, throughput and latency offline."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagoda.frontend.pagoda_cli import main
from tests.frontend.conftest import ENGINE_FLAGS
from tests.frontend.servers import free_port, start_pagoda, wait_pagoda_healthy

pytestmark = pytest.mark.slow

REPORT_FIELDS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    *(
        f"{stat}_{name}_ms"
        for name in ("ttft", "tpot", "itl")
        for stat in ("mean", "median", "p99")
    ),
)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pagoda = start_pagoda(port, ENGINE_FLAGS)
    try:
        wait_pagoda_healthy(base, pagoda)
        yield base
    finally:
        pagoda.proc.send_signal(signal.SIGTERM)
        try:
            pagoda.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pagoda.proc.pid, signal.SIGKILL)


def bench(*args: str) -> str:
    """`pagoda bench ...` as a user runs it; its stdout."""
    argv = [sys.executable, "-m", "pagoda.frontend.pagoda_cli", "bench", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_bench_serve_reports_and_plots(base_url: str, tmp_path: Path) -> None:
    """Random prompts at two concurrencies: every request completes with exactly
    its tokens (ignore_eos), the figures are plausible, --plot writes a PNG."""
    out = bench(
        "serve",
        "--base-url", base_url,
        "--num-prompts", "4",
        "--random-input-len", "16",
        "--random-output-len", "8",
        "--max-concurrency", "1,3",
        "--temperature", "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(tmp_path),
        "--result-filename", "run.json",
        "--plot", str(tmp_path / "plot.png"),
    )  # fmt: skip
    assert "TTFT" in out and "output throughput" in out
    for concurrency in (1, 3):
        report = json.loads((tmp_path / f"run-concurrency{concurrency}.json").read_text())
        assert all(field in report for field in REPORT_FIELDS), report
        assert report["max_concurrency"] == concurrency
        assert (report["completed"], report["failed"], report["errors"]) == (4, 0, [])
        assert report["total_output_tokens"] == 4 * 8
        assert report["total_input_tokens"] == 4 * 16
        assert report["output_throughput"] > 0 and report["request_throughput"] > 0
        assert 0 < report["median_ttft_ms"] <= report["p99_ttft_ms"] < 60_000
        assert 0 < report["mean_itl_ms"] and report["mean_e2el_ms"] > report["mean_ttft_ms"]
        assert report["sampling"] == "temperature=0.0"
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_chat_on_a_sharegpt_file(base_url: str, tmp_path: Path) -> None:
    """ShareGPT prompts through the chat route: each request asks for its reply's length."""
    replies = ["The capital of France is Paris.", "Red, green and blue, in that order."]
    conversations = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for q, a in zip(
            ["What is the capital of France?", "Name three colours."], replies, strict=True
        )
    ] + [{"conversations": [{"from": "human", "value": "no reply"}]}]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    bench(
        "serve",
        "--base-url", base_url,
        "--backend", "openai-chat",
        "--dataset-path", str(dataset),
        "--num-prompts", "4",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(tmp_path),
        "--result-filename", "chat.json",
    )  # fmt: skip
    report = json.loads((tmp_path / "chat.json").read_text())
    reply_tokens = [
        httpx.post(base_url + "/tokenize", json={"prompt": r, "add_special_tokens": False}).json()[
            "count"
        ]
        for r in replies
    ]
    assert (report["completed"], report["dataset_name"]) == (4, "sharegpt")
    # Four prompts from two usable conversations: each one twice.
    assert report["total_output_tokens"] == 2 * sum(reply_tokens)


def tiny_model_with_tokenizer(tiny_models: dict[str, Path], directory: Path) -> Path:
    """The tiny llama with the default model's tokenizer beside it (the offline LLM needs one)."""
    from pagoda.engine_core.model_config import default_model_path
    from pagoda.engine_core.tokenizer_files import tokenizer_dir_for

    shutil.copytree(tiny_models["llama"], directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir_for(default_model_path())) / name, directory)
    return directory


def test_bench_latency_and_throughput_on_a_tiny_model(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model_with_tokenizer(tiny_models, tmp_path / "tiny")
    engine = ["--model", str(model), "--dtype", "float32"]
    engine += ["--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "256"]
    latency_json = tmp_path / "latency.json"
    argv = ["bench", "latency", *engine, "--batch-size", "4", "--input-len", "16"]
    argv += ["--output-len", "6", "--num-iters", "2", "--output-json", str(latency_json)]
    assert main([*argv, "--disable-tqdm"]) == 0
    out = capsys.readouterr().out
    assert "decode step" in out and "prefill" in out
    latency = json.loads(latency_json.read_text())
    assert len(latency["latencies"]) == 2
    # Six tokens each: the first from the prefill, five decode steps per iteration.
    assert latency["num_decode_steps"] == 2 * 5
    assert 0 < latency["decode_step_ms"]["median"] < latency["latency_ms"]["median"]

    throughput_json = tmp_path / "throughput.json"
    argv = ["bench", "throughput", *engine, "--num-prompts", "8", "--input-len", "16"]
    argv += ["--output-len", "5", "--output-json", str(throughput_json), "--disable-tqdm"]
    assert main(argv) == 0
    assert "output tokens/s" in capsys.readouterr().out
    throughput = json.loads(throughput_json.read_text())
    assert throughput["num_requests"] == 8
    assert throughput["total_output_tokens"] == 8 * 5
    assert throughput["total_input_tokens"] == 8 * 16
    assert throughput["output_tokens_per_second"] > 0
