"""Disaggregated prefill and decode end to end: a prefill instance and a
decode instance (engine-core + api-server each, KV over tcp with CURVE keys)
behind `pagoda proxy`, driven by the official openai client; greedy answers
equal a single instance's, the decode engine computes only the last prompt
token, and a dead decode engine is a clear error with the producer's
blocks freed after the connector's timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME
from tests.frontend.servers import (
    Processes,
    api_argv,
    engine_argv,
    free_port,
    ipc_address,
    wait_healthy,
)

HOLD_TIMEOUT_S = 4


def connector(role: str, keys: Path) -> tuple[str, ...]:
    config = {
        "kv_connector": "PeerConnector",
        "kv_role": role,
        "kv_ip": "127.0.0.1",
        "kv_connector_extra_config": {"curve_keys": str(keys), "timeout_s": HOLD_TIMEOUT_S},
    }
    return ("--kv-transfer-config", json.dumps(config))


@dataclass
class Instance:
    base: str
    engine: object  # its engine-core process


def start_instance(procs: Processes, role: str, keys: Path, name: str) -> Instance:
    address = ipc_address()
    port = free_port()
    engine = procs.start(engine_argv(address, *ENGINE_FLAGS, *connector(role, keys)), name)
    procs.start(api_argv(address, port), f"api-{name}")
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, procs)
    return Instance(base, engine)


def start_proxy(procs: Processes, prefill: list[str], decode: list[str]) -> str:
    port = free_port()
    argv = [sys.executable, "-m", "pagoda.frontend.pagoda_cli", "proxy", "--port", str(port)]
    procs.start([*argv, "--prefill", *prefill, "--decode", *decode], "proxy")
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, procs)
    return base


@dataclass
class Disagg:
    prefill: Instance
    decode: Instance
    proxy: str
    procs: Processes
    keys: Path


@pytest.fixture(scope="module")
def disagg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Disagg]:
    from pagoda.protocol.curve import generate_keys

    keys = generate_keys(tmp_path_factory.mktemp("curve") / "keys")
    procs = Processes()
    try:
        prefill = start_instance(procs, "kv_producer", keys, "prefill")
        decode = start_instance(procs, "kv_consumer", keys, "decode")
        # The first prefill URL has nothing behind it: the proxy skips it.
        dead = f"http://127.0.0.1:{free_port()}"
        proxy = start_proxy(procs, [dead, prefill.base], [decode.base])
        yield Disagg(prefill, decode, proxy, procs, keys)
    finally:
        procs.stop()


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
    assert found, f"{name} not in /metrics of {base}"
    return sum(float(v) for v in found)


def eventually(check: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.25)


PROMPT = "List three facts about the moon."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_answers_equal_a_single_instance_and_the_decoder_computes_one_prompt_token(
    disagg: Disagg,
) -> None:
    direct = openai.OpenAI(base_url=disagg.prefill.base + "/v1", api_key="x")
    proxied = openai.OpenAI(base_url=disagg.proxy + "/v1", api_key="x")
    model = direct.models.list().data[0].id
    args = {"model": model, "temperature": 0, "max_tokens": 24}
    ref_text = direct.completions.create(prompt=PROMPT, **args).choices[0].text
    ref_chat = direct.chat.completions.create(messages=MESSAGES, **args)
    ref_chat_text = ref_chat.choices[0].message.content
    assert ref_chat.model_extra is not None and ref_chat.model_extra["kv_transfer_params"] is None

    computed = metric(disagg.decode.base, "pagoda:prompt_tokens_computed_total")
    transfers = metric(disagg.decode.base, "pagoda:kv_transfers_total")

    completion = proxied.completions.create(prompt=PROMPT, **args)
    assert completion.choices[0].text == ref_text
    kv = (completion.model_extra or {})["kv_transfer_params"]
    assert kv["kv_transfer"] == "transferred" and kv["transferred_tokens"] > 0, kv
    chat = proxied.chat.completions.create(messages=MESSAGES, **args)
    assert chat.choices[0].message.content == ref_chat_text
    assert (chat.model_extra or {})["kv_transfer_params"]["kv_transfer"] == "transferred"

    streamed = "".join(
        c.choices[0].text
        for c in proxied.completions.create(prompt=PROMPT, stream=True, **args)
        if c.choices
    )
    assert streamed == ref_text
    chunks = list(proxied.chat.completions.create(messages=MESSAGES, stream=True, **args))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_chat_text
    last = chunks[-1].model_extra or {}
    assert last["kv_transfer_params"]["kv_transfer"] == "transferred"

    # Four requests: the decode engine computed one prompt token of each.
    assert metric(disagg.decode.base, "pagoda:prompt_tokens_computed_total") - computed == 4
    assert metric(disagg.decode.base, "pagoda:kv_transfers_total") - transfers == 4
    assert metric(disagg.decode.base, "pagoda:kv_transfer_bytes_total") > 0
    assert metric(disagg.proxy, "pagoda_proxy:kv_total") >= 4
    # The producer freed what the decoder pulled (its stats come with its heartbeat).
    eventually(lambda: metric(disagg.prefill.base, "vllm:kv_cache_usage_perc") == 0.0)
    assert metric(disagg.prefill.base, "pagoda:kv_served_total") >= 4


def test_the_proxy_reports_its_instances_and_refuses_bad_bodies(disagg: Disagg) -> None:
    health = httpx.get(f"{disagg.proxy}/healthcheck", timeout=10)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "prefill_instances": 1, "decode_instances": 1}
    r = httpx.post(f"{disagg.proxy}/v1/completions", content=b"{", timeout=10)
    assert r.status_code == 400 and "error" in r.json()
    # The prefill instance's own refusal comes back as it is.
    r = httpx.post(
        f"{disagg.proxy}/v1/completions",
        json={"prompt": "hi", "max_tokens": 4, "temperature": -1},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert metric(disagg.proxy, "pagoda_proxy:instance_up") == 2  # the dead prefill is down


def test_the_token_route_carries_kv_transfer_params(disagg: Disagg) -> None:
    """/inference/v1/generate: prefill on the producer, pull on the consumer,
    the same tokens as computing it there."""
    ids = list(range(1000, 1040))
    params = {"temperature": 0, "max_tokens": 8}
    reference = httpx.post(
        f"{disagg.prefill.base}/inference/v1/generate",
        json={"token_ids": ids, "sampling_params": params},
        timeout=60,
    ).json()["choices"][0]["token_ids"]
    prefill = httpx.post(
        f"{disagg.prefill.base}/inference/v1/generate",
        json={
            "token_ids": ids,
            "sampling_params": {**params, "max_tokens": 1},
            "kv_transfer_params": {"do_remote_decode": True},
        },
        timeout=60,
    ).json()
    assert prefill["kv_transfer_params"]["do_remote_prefill"] is True
    decoded = httpx.post(
        f"{disagg.decode.base}/inference/v1/generate",
        json={
            "token_ids": ids,
            "sampling_params": params,
            "kv_transfer_params": prefill["kv_transfer_params"],
        },
        timeout=60,
    ).json()
    assert decoded["choices"][0]["token_ids"] == reference
    assert decoded["kv_transfer_params"]["kv_transfer"] == "transferred"
    assert decoded["kv_transfer_params"]["transferred_tokens"] == len(ids) - 1


def test_a_client_that_goes_away_aborts_its_request(disagg: Disagg) -> None:
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{disagg.proxy}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        eventually(lambda: metric(disagg.decode.base, "vllm:num_requests_running") == 1)
    # The connection closed: the proxy drops its call, the decode instance aborts.
    eventually(lambda: metric(disagg.decode.base, "vllm:num_requests_running") == 0)
    eventually(lambda: metric(disagg.decode.base, "vllm:kv_cache_usage_perc") == 0.0)


def test_a_dead_decode_engine_is_a_clear_error_and_the_held_blocks_are_freed(
    disagg: Disagg,
) -> None:
    # Mid-stream: the client's stream ends with an error event, not a hang.
    with httpx.stream(
        "POST",
        f"{disagg.proxy}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        os.kill(disagg.decode.engine.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        rest = "\n".join(lines)
    assert '"error"' in rest, rest[-500:]
    # The next request is refused at once, saying why.
    client = openai.OpenAI(base_url=disagg.proxy + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL_NAME, prompt="One more time", max_tokens=8)
    assert refused.value.status_code in (500, 502, 503)
    # A prefill whose decoder never comes: its blocks are freed after the timeout.
    held = httpx.post(
        f"{disagg.prefill.base}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=30,
    ).json()
    assert held["kv_transfer_params"]["do_remote_prefill"] is True
    expired = metric(disagg.prefill.base, "pagoda:kv_expired_total")
    deadline = time.monotonic() + HOLD_TIMEOUT_S + 10
    while metric(disagg.prefill.base, "pagoda:kv_expired_total") <= expired:
        assert time.monotonic() < deadline, "the held blocks were never freed"
        time.sleep(0.5)
    eventually(lambda: metric(disagg.prefill.base, "vllm:kv_cache_usage_perc") == 0.0)
