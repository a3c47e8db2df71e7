"""Tokens in, tokens out (/inference/v1/generate, abort, render) on the real processes.

The shared `server` answers the same greedy tokens and logprobs as
/v1/completions on the same token ids; its render routes' output runs on
/inference/v1/generate as it is. A --tokens-only server with an API key,
whose API server cannot import transformers at all, serves the token routes
and refuses the text routes.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagoda.frontend.cli import add_frontend_args, frontend_args_to_argv
from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME, Server
from tests.frontend.fuzzing import fuzz_all
from tests.frontend.servers import Processes, api_argv, engine_argv, free_port, wait_healthy

pytestmark = pytest.mark.slow

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
KEY = "tokens-key"
CHAT = [{"role": "user", "content": "Name three colors."}]


def post(base: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60, **kwargs)


def prompt_ids(server: Server, text: str = "The capital of France is") -> list[int]:
    return list(post(server.base_url, "/tokenize", {"prompt": text}).json()["tokens"])


def token_text(server: Server, token_id: int) -> str:
    return str(post(server.base_url, "/detokenize", {"tokens": [token_id]}).json()["prompt"])


def events(response: httpx.Response) -> list[Any]:
    """The JSON events of an SSE stream, up to its [DONE]."""
    out = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return out
        out.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without [DONE]")


def test_greedy_tokens_and_logprobs_match_completions(server: Server) -> None:
    ids = prompt_ids(server)
    params = {"temperature": 0, "max_tokens": 12, "logprobs": 3, "ignore_eos": True}
    r = post(
        server.base_url,
        GENERATE,
        {"model": MODEL_NAME, "token_ids": ids, "sampling_params": params},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"].startswith("generate-tokens-")
    assert body["kv_transfer_params"] is None and body["prompt_logprobs"] is None
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 12
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 12,
        "total_tokens": len(ids) + 12,
    }

    completion = post(
        server.v1,
        "/completions",
        {
            "model": MODEL_NAME,
            "prompt": ids,
            "temperature": 0,
            "max_tokens": 12,
            "logprobs": 3,
            "ignore_eos": True,
        },
    ).json()["choices"][0]
    expected = completion["logprobs"]
    # The same tokens, one by one (each token's own text), and the same text.
    assert [token_text(server, t) for t in choice["token_ids"]] == expected["tokens"]
    assert "".join(expected["tokens"]) == completion["text"]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert [c["logprob"] for c in content] == pytest.approx(expected["token_logprobs"], abs=1e-5)
    for entry, top in zip(content, expected["top_logprobs"], strict=True):
        assert len(entry["top_logprobs"]) == 3 and entry["bytes"] is None
        mine = sorted(t["logprob"] for t in entry["top_logprobs"])
        theirs = sorted(top.values())[-3:]
        assert mine == pytest.approx(theirs, abs=1e-5)
        # Ranked: the greedy token is the first of the top ones.
        assert entry["top_logprobs"][0]["token"] == entry["token"]


def test_stream_deltas_add_up_to_the_whole(server: Server) -> None:
    ids = prompt_ids(server, "Once upon a time")
    params = {"temperature": 0, "max_tokens": 10, "logprobs": 1, "ignore_eos": True}
    whole = post(server.base_url, GENERATE, {"token_ids": ids, "sampling_params": params}).json()
    body = {
        "token_ids": ids,
        "sampling_params": params,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "request_id": "stream-1",
    }
    with httpx.stream("POST", server.base_url + GENERATE, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = events(r)
    *token_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    assert all(c["request_id"] == "generate-tokens-stream-1" for c in chunks)
    streamed = [t for c in token_chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"]
    logprobs = [e for c in token_chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert logprobs == whole["choices"][0]["logprobs"]["content"]
    reasons = [c["choices"][0]["finish_reason"] for c in token_chunks]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    # continuous usage: every chunk counts the tokens so far
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == [
        sum(len(c["choices"][0]["token_ids"]) for c in token_chunks[: i + 1])
        for i in range(len(token_chunks))
    ]


def test_missing_max_tokens_is_the_rest_of_the_context(server: Server) -> None:
    ids = (prompt_ids(server, "one two three four five six seven eight") * 200)[:1020]
    r = post(
        server.base_url,
        GENERATE,
        {"token_ids": ids, "sampling_params": {"temperature": 0, "ignore_eos": True}},
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"


def test_samples_seeds_ids_and_vllm_fields(server: Server) -> None:
    ids = prompt_ids(server)
    body = {
        "token_ids": ids,
        "sampling_params": {
            "n": 2,
            "seed": 7,
            "temperature": 1.0,
            "top_k": -1,
            "max_tokens": 6,
            "stop_token_ids": [2],
            "output_kind": 1,
            "extra_args": {"x": 1},
            "bad_words": [],
        },
        "priority": 1,
        "cache_salt": "salt",
        "kv_transfer_params": {"do_remote_decode": False},
        "request_id": "body-id",
    }
    first = post(server.base_url, GENERATE, body)
    assert first.status_code == 200, first.text
    again = post(server.base_url, GENERATE, body, headers={"X-Request-Id": "header-id"}).json()
    assert first.json()["request_id"] == "generate-tokens-body-id"
    assert again["request_id"] == "generate-tokens-header-id"  # the header wins, as in vLLM
    assert [c["index"] for c in again["choices"]] == [0, 1]
    assert [c["token_ids"] for c in again["choices"]] == [
        c["token_ids"] for c in first.json()["choices"]
    ]
    assert again["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in again["choices"])


def test_prompt_logprobs_and_structured_output(server: Server) -> None:
    ids = prompt_ids(server)
    r = post(
        server.base_url,
        GENERATE,
        {"token_ids": ids, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}},
    ).json()
    prompt_lps = r["prompt_logprobs"]
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    assert str(ids[1]) in prompt_lps[1]
    choice = {"choice": ["yes", "no"]}
    r = post(
        server.base_url,
        GENERATE,
        {"token_ids": ids, "sampling_params": {"max_tokens": 5, "structured_outputs": choice}},
    )
    assert r.status_code == 200, r.text
    text = "".join(token_text(server, t) for t in r.json()["choices"][0]["token_ids"])
    assert text.replace("<|im_end|>", "") in ("yes", "no")


def test_chat_render_round_trip(server: Server) -> None:
    chat = {"model": MODEL_NAME, "messages": CHAT, "temperature": 0, "max_tokens": 10}
    rendered = post(server.v1, "/chat/completions/render", chat)
    assert rendered.status_code == 200, rendered.text
    req = rendered.json()
    assert req["request_id"].startswith("chatcmpl-") and req["model"] == MODEL_NAME
    assert req["prompt"].endswith("<|im_start|>assistant\n") and req["stream"] is False
    assert (
        req["token_ids"] == post(server.base_url, "/tokenize", {"messages": CHAT}).json()["tokens"]
    )
    assert req["sampling_params"]["max_tokens"] == 10 and req["sampling_params"]["temperature"] == 0
    generated = post(server.base_url, GENERATE, req)
    assert generated.status_code == 200, generated.text
    out = generated.json()
    assert out["request_id"] == "generate-tokens-" + req["request_id"]
    reply = post(server.v1, "/chat/completions", chat).json()
    (choice,) = out["choices"]
    assert len(choice["token_ids"]) == reply["usage"]["completion_tokens"]
    tokens = choice["token_ids"][:-1] if choice["finish_reason"] == "stop" else choice["token_ids"]
    text = post(server.base_url, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text == reply["choices"][0]["message"]["content"]

    # Without max_tokens a chat render resolves it to the rest of the context.
    bare = post(server.v1, "/chat/completions/render", {"messages": CHAT}).json()
    assert bare["sampling_params"]["max_tokens"] == 1024 - len(bare["token_ids"])


def test_completion_render_lists_generate_requests(server: Server) -> None:
    r = post(server.v1, "/completions/render", {"prompt": ["a b", "c d e"], "temperature": 0})
    assert r.status_code == 200, r.text
    reqs = r.json()
    assert [q["prompt"] for q in reqs] == ["a b", "c d e"]
    assert all(q["request_id"].startswith("cmpl-") for q in reqs)
    assert all(q["sampling_params"]["max_tokens"] == 16 for q in reqs)
    completion = post(server.v1, "/completions", {"prompt": "c d e", "temperature": 0}).json()
    generated = post(server.base_url, GENERATE, reqs[1]).json()["choices"][0]
    assert len(generated["token_ids"]) == completion["usage"]["completion_tokens"]


def test_abort_ends_a_running_request(server: Server) -> None:
    body = {
        "token_ids": prompt_ids(server),
        "sampling_params": {"max_tokens": 900, "ignore_eos": True},
        "stream": True,
        "request_id": "abort-me",
    }
    with httpx.stream("POST", server.base_url + GENERATE, json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["token_ids"]
        aborted = post(server.base_url, ABORT, {"request_ids": ["generate-tokens-abort-me", "x"]})
        assert aborted.status_code == 200 and aborted.content == b""
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert rest[-1]["choices"][0]["finish_reason"] == "abort"
    assert sum(len(c["choices"][0]["token_ids"]) for c in rest) < 899


BAD_BODIES: list[tuple[str, Any]] = [
    ("no token_ids", {"sampling_params": {}}),
    ("no sampling_params", {"token_ids": [1, 2]}),
    ("empty token_ids", {"token_ids": [], "sampling_params": {}}),
    ("negative id", {"token_ids": [-1], "sampling_params": {}}),
    ("id past the vocabulary", {"token_ids": [10**9], "sampling_params": {}}),
    ("id past 64 bits", {"token_ids": [2**70], "sampling_params": {}}),
    ("string ids", {"token_ids": ["a", "b"], "sampling_params": {}}),
    ("bool ids", {"token_ids": [True], "sampling_params": {}}),
    ("ids as a string", {"token_ids": "1 2 3", "sampling_params": {}}),
    ("float ids", {"token_ids": [1.5], "sampling_params": {}}),
    ("prompt too long", {"token_ids": [5] * 2000, "sampling_params": {}}),
    ("no room left", {"token_ids": [5] * 1000, "sampling_params": {"max_tokens": 100}}),
    ("huge list", {"token_ids": [5] * 1_100_000, "sampling_params": {}}),
    ("misspelt field", {"token_ids": [1], "sampling_params": {"max_token": 5}}),
    ("unknown field", {"token_ids": [1], "sampling_params": {"beam_width": 2}}),
    ("unsupported vLLM field", {"token_ids": [1], "sampling_params": {"allowed_token_ids": [1]}}),
    ("unknown top-level field", {"token_ids": [1], "sampling_params": {}, "max_tokens": 3}),
    ("sampling_params a list", {"token_ids": [1], "sampling_params": [1]}),
    ("temperature a string", {"token_ids": [1], "sampling_params": {"temperature": "hot"}}),
    ("temperature out of range", {"token_ids": [1], "sampling_params": {"temperature": -1}}),
    ("top_p zero", {"token_ids": [1], "sampling_params": {"top_p": 0}}),
    ("logprobs huge", {"token_ids": [1], "sampling_params": {"logprobs": 10**6}}),
    ("logprobs -1", {"token_ids": [1], "sampling_params": {"logprobs": -1}}),
    ("n huge", {"token_ids": [1], "sampling_params": {"n": 10**6}}),
    ("max_tokens huge", {"token_ids": [1], "sampling_params": {"max_tokens": 10**30}}),
    ("max_tokens zero", {"token_ids": [1], "sampling_params": {"max_tokens": 0}}),
    ("min_tokens huge", {"token_ids": [1], "sampling_params": {"min_tokens": 2**70}}),
    ("min over max", {"token_ids": [1], "sampling_params": {"min_tokens": 9, "max_tokens": 2}}),
    ("seed huge", {"token_ids": [1], "sampling_params": {"seed": 10**30}}),
    ("stop token past vocab", {"token_ids": [1], "sampling_params": {"stop_token_ids": [10**9]}}),
    ("many stops", {"token_ids": [1], "sampling_params": {"stop": ["s"] * 100_000}}),
    ("logit bias key", {"token_ids": [1], "sampling_params": {"logit_bias": {"x": 1}}}),
    ("bad grammar", {"token_ids": [1], "sampling_params": {"structured_outputs": {}}}),
    ("priority huge", {"token_ids": [1], "sampling_params": {}, "priority": 2**70}),
    ("stream_options alone", {"token_ids": [1], "sampling_params": {}, "stream_options": {}}),
    ("features", {"token_ids": [1], "sampling_params": {}, "features": {"mm_hashes": {}}}),
    ("empty cache_salt", {"token_ids": [1], "sampling_params": {}, "cache_salt": ""}),
    ("long request id", {"token_ids": [1], "sampling_params": {}, "request_id": "r" * 5000}),
    ("a list body", [1, 2, 3]),
]


@pytest.mark.parametrize(("why", "body"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_hostile_generate_bodies_are_4xx(server: Server, why: str, body: Any) -> None:
    r = post(server.base_url, GENERATE, body)
    assert 400 <= r.status_code < 500, (why, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["message"] and len(error["message"]) < 1000, why


def test_unknown_model_bad_json_and_bad_aborts(server: Server) -> None:
    missing = post(
        server.base_url, GENERATE, {"model": "nope", "token_ids": [1], "sampling_params": {}}
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    for path in (GENERATE, ABORT):
        r = httpx.post(server.base_url + path, content=b"{not json", timeout=30,
                       headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["message"]
    for body in ({}, {"request_ids": "x"}, {"request_ids": [1]}, {"request_ids": ["x"] * 5000}):
        r = post(server.base_url, ABORT, body)
        assert r.status_code == 400 and r.json()["error"]["message"], body


def test_min_tokens_past_the_context_is_a_400(server: Server) -> None:
    """With no max_tokens (the rest of the context) an impossible min_tokens is
    the client's error, not a number too big for the engine socket."""
    chat = {"messages": CHAT, "min_tokens": 2**70}
    for path, body in [
        ("/chat/completions", chat),
        ("/completions", {"prompt": "hi", "max_tokens": None, "min_tokens": 2**70}),
        ("/chat/completions/render", chat),
    ]:
        r = post(server.v1, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_fuzz_the_token_routes(server: Server) -> None:
    routes = [GENERATE, ABORT, "/v1/chat/completions/render", "/v1/completions/render"]
    results = fuzz_all(server.base_url, 20, routes=routes)
    assert sorted(r.route.split()[1] for r in results) == sorted(routes)
    problems = [f"{r.route}: {p}" for r in results for p in r.problems]
    assert not problems, "\n".join(problems[:10])


# ------------------------------------------------------------- --tokens-only


@pytest.fixture(scope="module")
def tokens_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A --tokens-only API server with an API key, in which transformers cannot be
    imported: it starts only if it never loads a tokenizer."""
    shadow: Path = tmp_path_factory.mktemp("no-transformers")
    (shadow / "transformers").mkdir()
    (shadow / "transformers" / "__init__.py").write_text(
        'raise ImportError("a --tokens-only server must not load a tokenizer")\n'
    )
    procs = Processes()
    address = f"ipc://{tmp_path_factory.mktemp('tokens-only')}/engine"
    port = free_port()
    procs.start(engine_argv(address, *ENGINE_FLAGS), "engine-tokens-only")
    api = api_argv(address, port, "--tokens-only", "--api-key", KEY, "--enable-rl-api")
    procs.start(["env", f"PYTHONPATH={shadow}", *api], "api-tokens-only")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs)
        yield base
    finally:
        procs.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_tokens_only_generates_the_same_tokens(server: Server, tokens_only: str) -> None:
    ids = prompt_ids(server)
    body = {"token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 2}}
    mine = post(tokens_only, GENERATE, body, headers=AUTH)
    assert mine.status_code == 200, mine.text
    shared = post(server.base_url, GENERATE, body).json()
    assert mine.json()["choices"] == shared["choices"]
    stream = post(tokens_only, GENERATE, {**body, "stream": True}, headers=AUTH)
    assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
    # stop strings need a tokenizer; stop token ids do not
    stop = post(
        tokens_only, GENERATE, {"token_ids": ids, "sampling_params": {"stop": ["x"]}}, headers=AUTH
    )
    assert stop.status_code == 400 and "tokenizer" in stop.json()["error"]["message"]
    by_id = {
        "token_ids": ids,
        "sampling_params": {
            "stop_token_ids": [shared["choices"][0]["token_ids"][1]],
            "temperature": 0,
        },
    }
    stopped = post(tokens_only, GENERATE, by_id, headers=AUTH).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and len(stopped["token_ids"]) == 2


def test_tokens_only_refuses_the_text_routes(tokens_only: str) -> None:
    chat = {"model": MODEL_NAME, "messages": CHAT}
    for path, body in [
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions/render", chat),
        ("/tokenize", {"prompt": "hi"}),
    ]:
        r = post(tokens_only, path, body, headers=AUTH)
        assert r.status_code == 404, (path, r.text)
        assert "--tokens-only" in r.json()["error"]["message"]
    models = httpx.get(tokens_only + "/v1/models", headers=AUTH, timeout=30).json()
    assert models["data"][0]["id"] == MODEL_NAME
    # A trainer's other routes need no tokenizer either.
    paused = httpx.get(tokens_only + "/is_paused", headers=AUTH, timeout=30)
    assert paused.json() == {"is_paused": False}


def test_tokens_only_routes_need_the_key(tokens_only: str) -> None:
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    for path, payload in [(GENERATE, body), (ABORT, {"request_ids": ["x"]})]:
        r = post(tokens_only, path, payload)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        wrong = post(tokens_only, path, payload, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    assert post(tokens_only, ABORT, {"request_ids": ["x"]}, headers=AUTH).status_code == 200
    assert httpx.get(tokens_only + "/health", timeout=30).status_code == 200
    assert httpx.get(tokens_only + "/version", timeout=30).status_code == 200


def test_pagoda_serve_passes_tokens_only_on() -> None:
    """`pagoda serve --tokens-only` hands the flag to each API server it starts."""
    serve = argparse.ArgumentParser()
    add_frontend_args(serve)
    api = argparse.ArgumentParser()
    add_frontend_args(api)
    assert api.parse_args(frontend_args_to_argv(serve.parse_args(["--tokens-only"]))).tokens_only
    assert not api.parse_args(frontend_args_to_argv(serve.parse_args([]))).tokens_only


def test_logprob_token_ids_come_back_beside_the_top_ones(server: Server) -> None:
    """vLLM's logprob_token_ids: those tokens' raw logprobs at every position,
    the values the scoring route reads."""
    ids = prompt_ids(server)
    wanted = [11, 2000, 4567]
    body = {
        "token_ids": ids,
        "sampling_params": {
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": 1,
            "logprob_token_ids": wanted,
        },
    }
    r = post(server.base_url, GENERATE, body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for position in content:
        tokens = [t["token"] for t in position["top_logprobs"]]
        assert all(f"token_id:{t}" in tokens for t in wanted), tokens
        assert all(t["logprob"] <= 0 for t in position["top_logprobs"])
    # The first position's values are the scoring route's for the same prompt.
    scored = post(
        server.base_url,
        "/generative_scoring",
        {
            "model": MODEL_NAME,
            "query": ids[:-1],
            "items": [ids[-1:]],
            "label_token_ids": wanted,
            "apply_softmax": False,
        },
    ).json()
    first = {t["token"]: t["logprob"] for t in content[0]["top_logprobs"]}
    assert abs(math.exp(first[f"token_id:{wanted[0]}"]) - scored["data"][0]["score"]) < 1e-6
    bad = post(
        server.base_url,
        GENERATE,
        {"token_ids": ids, "sampling_params": {"max_tokens": 1, "logprob_token_ids": [10**9]}},
    )
    assert bad.status_code == 400 and "logprob_token_ids" in bad.text
