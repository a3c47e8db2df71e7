"""End to end: the official openai client against real engine-core + api-server."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.frontend.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]


def client(server: Server, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, **kw)  # type: ignore[arg-type]


def aclient(server: Server, **kw: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, **kw)  # type: ignore[arg-type]


def engine_stats(server: Server) -> dict:
    return httpx.get(server.base_url + "/stats", timeout=10).json()


def test_models_health_version(server: Server) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert "version" in httpx.get(server.base_url + "/version").json()
    assert httpx.get(server.base_url + "/openapi.json").status_code == 200


def test_chat_stream_equals_non_stream(server: Server) -> None:
    c = client(server)
    full = c.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=40)
    text = full.choices[0].message.content
    assert text
    chunks = list(
        c.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=40, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text
    finishes = [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]


def test_completion_stream_equals_non_stream(server: Server) -> None:
    c = client(server)
    full = c.completions.create(
        model=MODEL_NAME, prompt="The history of Rome", temperature=0, max_tokens=30
    )
    stream = c.completions.create(
        model=MODEL_NAME, prompt="The history of Rome", temperature=0, max_tokens=30, stream=True
    )
    assert "".join(ch.choices[0].text for ch in stream) == full.choices[0].text


def test_n_with_seed_gives_distinct_indexed_choices(server: Server) -> None:
    c = client(server)
    kwargs = dict(model=MODEL_NAME, messages=CHAT, temperature=1.0, max_tokens=24, n=3, seed=1234)
    first = c.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert sorted(ch.index for ch in first.choices) == [0, 1, 2]
    texts = [ch.message.content for ch in first.choices]
    assert len(set(texts)) == 3
    again = c.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [ch.message.content for ch in again.choices] == texts  # seeded: reproducible


def test_stop_string_spanning_tokens_never_leaks(server: Server) -> None:
    c = client(server)
    base = c.completions.create(
        model=MODEL_NAME, prompt="The history of Rome", temperature=0, max_tokens=30, logprobs=0
    )
    tokens = base.choices[0].logprobs.tokens  # type: ignore[union-attr]
    text = base.choices[0].text
    # A stop string made of the end of one token and the start of the next.
    k = next(
        i for i in range(3, len(tokens) - 1) if len(tokens[i]) >= 2 and len(tokens[i + 1]) >= 2
    )
    stop = tokens[k][-2:] + tokens[k + 1][:2]
    expected = text[: text.index(stop)]
    stream = c.completions.create(
        model=MODEL_NAME,
        prompt="The history of Rome",
        temperature=0,
        max_tokens=30,
        stop=[stop],
        stream=True,
    )
    pieces = [ch.choices[0].text for ch in stream]
    assert "".join(pieces) == expected
    assert all(stop[:2] not in p or expected.count(stop[:2]) for p in pieces)
    full = c.completions.create(
        model=MODEL_NAME, prompt="The history of Rome", temperature=0, max_tokens=30, stop=[stop]
    )
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "stop"


def test_logprob_shapes(server: Server) -> None:
    c = client(server)
    comp = c.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=5,
        logprobs=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    lp = comp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    assert all(len(t) >= 3 for t in lp.top_logprobs)  # top 3 (+ the chosen one if outside)
    assert lp.text_offset[0] == 0
    chat = c.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2, temperature=0
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob <= 0.0
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_exact_usage(server: Server) -> None:
    c = client(server)
    prompt = [1, 504, 3575, 282, 4649, 314]
    comp = c.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert comp.usage is not None
    assert (comp.usage.prompt_tokens, comp.usage.completion_tokens, comp.usage.total_tokens) == (
        6,
        7,
        13,
    )
    stream = c.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].usage.prompt_tokens == 6
    assert all(ch.usage is None for ch in chunks[:-1])


def test_100_concurrent_streams_finish(server: Server) -> None:
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str | None, int]:
        stream = await c.completions.create(
            model=MODEL_NAME,
            prompt=f"Story number {i}:",
            max_tokens=8,
            stream=True,
            temperature=0.7,
            seed=i,
            extra_body={"ignore_eos": True},
        )
        finish = None
        n = 0
        async for ch in stream:
            n += len(ch.choices[0].text) > 0
            finish = ch.choices[0].finish_reason or finish
        return finish, n

    async def run() -> list[tuple[str | None, int]]:
        c = aclient(server, timeout=120)
        return await asyncio.gather(*(one(c, i) for i in range(100)))

    results = asyncio.run(run())
    assert [f for f, _ in results] == ["length"] * 100


def test_client_timeouts_free_everything(server: Server) -> None:
    async def consume(c: openai.AsyncOpenAI, i: int, stream: bool) -> None:
        extra = {"ignore_eos": True}
        prompt = f"Count to {i}"
        if stream:
            s = await c.completions.create(
                model=MODEL_NAME, prompt=prompt, stream=True, max_tokens=900, extra_body=extra
            )
            async for _ in s:
                pass
        else:
            await c.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=900, extra_body=extra
            )

    async def one(c: openai.AsyncOpenAI, i: int, stream: bool) -> None:
        # The client gives up after 1.5 s, whatever the server is doing.
        try:
            await asyncio.wait_for(consume(c, i, stream), timeout=1.5)
        except (TimeoutError, openai.APITimeoutError, openai.APIConnectionError):
            return
        raise AssertionError("request should have timed out")

    async def run() -> None:
        c = aclient(server, timeout=30)
        await asyncio.gather(*(one(c, i, i % 2 == 0) for i in range(50)))
        await c.close()

    asyncio.run(run())
    deadline = time.monotonic() + 20
    while True:
        stats = engine_stats(server)
        if (
            stats["num_running"] == 0
            and stats["num_waiting"] == 0
            and stats["num_used_blocks"] == 0
        ):
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
        (
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 5000},
            400,
            "max_tokens",
        ),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        (
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": "hi", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": 12}, 400, None),
        (
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": "hi", "max_tokens": "ten"},
            400,
            "max_tokens",
        ),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": [99999999]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": ""}, 400, "prompt"),
        (
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": "hi", "temperature": -1},
            400,
            "temperature",
        ),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL_NAME, "messages": CHAT, "top_logprobs": 30, "logprobs": True},
            400,
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "n": 0}, 400, "n"),
    ],
)
def test_bad_input_is_a_4xx_in_openai_shape(
    server: Server, path: str, body: dict, status: int, param: str | None
) -> None:
    r = httpx.post(server.base_url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param


def test_context_overflow_message(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(server).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=5000)
    assert "maximum context length is 1024 tokens" in str(info.value)


def test_malformed_json_is_400(server: Server) -> None:
    r = httpx.post(
        server.v1 + "/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
