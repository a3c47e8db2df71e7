"""`WS /v1/realtime` end to end, driven by the `websockets` client.

Transcription runs on `pagoda serve --model Systran/faster-whisper-tiny.en`
(one server for the module, started with an API key and small limits so
that each limit can be reached quickly); the text conversation runs on the
default chat model (the suite's shared server). Speech is espeak-ng reading
known sentences, as in test_audio_api.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.frontend.conftest import Server
from tests.frontend.servers import free_port, start_pagoda, wait_pagoda_healthy
from tests.frontend.test_audio_api import MODEL, SENTENCES, model_dir, speak

pytestmark = pytest.mark.slow
websockets = pytest.importorskip("websockets")

KEY = "realtime-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_SESSIONS = 3
MAX_AUDIO_BYTES = 1_000_000  # about 31 s of PCM16
IDLE_TIMEOUT = 3.0
MAX_MESSAGES_PER_SECOND = 50
PIECE = 1600  # samples: 100 ms


@pytest.fixture(scope="module")
def whisper() -> Iterator[str]:
    """A Whisper server with an API key and small realtime limits; its base URL."""
    model_dir()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    flags = (
        "--model", MODEL, "--dtype", "float32", "--api-key", KEY,
        "--realtime-max-sessions", str(MAX_SESSIONS),
        "--realtime-max-audio-bytes", str(MAX_AUDIO_BYTES),
        "--realtime-idle-timeout", str(IDLE_TIMEOUT),
        "--realtime-max-messages-per-second", str(MAX_MESSAGES_PER_SECOND),
    )  # fmt: skip
    pagoda = start_pagoda(port, flags)
    try:
        wait_pagoda_healthy(base, pagoda)
        yield base
    finally:
        pagoda.proc.send_signal(signal.SIGTERM)
        try:
            pagoda.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pagoda.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def pcm() -> np.ndarray:
    """About 10 s of speech as PCM16 samples."""
    clip = np.concatenate([speak(sentence) for sentence in SENTENCES])
    return (np.clip(clip, -1.0, 1.0) * 32767).astype("<i2")


@pytest.fixture(scope="module")
def short_pcm() -> np.ndarray:
    return (np.clip(speak(SENTENCES[2]), -1.0, 1.0) * 32767).astype("<i2")


@pytest.fixture(scope="module")
def short_text(whisper: str, short_pcm: np.ndarray) -> str:
    """The HTTP route's text of `short_pcm`."""
    return http_text(whisper, short_pcm)


def ws_url(base: str, query: str = "") -> str:
    return base.replace("http://", "ws://") + "/v1/realtime" + query


def append(samples: np.ndarray) -> str:
    audio = base64.b64encode(samples.tobytes()).decode()
    return json.dumps({"type": "input_audio_buffer.append", "audio": audio})


def event(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields})


async def next_event(ws: Any, *kinds: str, timeout: float = 60.0) -> dict[str, Any]:
    """The next event of one of `kinds` (any event when none are given)."""
    while True:
        received = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if not kinds or received["type"] in kinds:
            return received


async def close_code(ws: Any, timeout: float = 30.0) -> int:
    """The code the server closes `ws` with (events before it are skipped)."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except websockets.ConnectionClosed as closed:
        assert closed.rcvd is not None
        return int(closed.rcvd.code)


def http_text(base: str, samples: np.ndarray) -> str:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, samples, 16_000, format="WAV", subtype="PCM_16")
    files = {"file": ("clip.wav", buffer.getvalue(), "audio/wav")}
    reply = httpx.post(base + "/v1/audio/transcriptions", files=files, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["text"])


def test_streamed_clip_gives_deltas_then_the_http_text(
    whisper: str, pcm: np.ndarray, short_text: str
) -> None:
    """vLLM's flow: 100 ms pieces in real time (as from a microphone), deltas
    while they arrive, and a final text equal to the HTTP route's for the same
    samples. (`short_text`: the engine has run a transcription before, so that
    the first decodes do not pay for its warm-up.)"""
    assert 9 * 16_000 <= len(pcm) <= 12 * 16_000

    async def run() -> tuple[list[str], dict[str, Any], list[dict[str, Any]]]:
        async with websockets.connect(ws_url(whisper), additional_headers=AUTH) as ws:
            created = await next_event(ws)
            assert created["type"] == "session.created" and created["id"]
            await ws.send(event("session.update", model=MODEL))
            assert (await next_event(ws))["type"] == "session.updated"
            await ws.send(event("input_audio_buffer.commit"))  # starts decoding
            events: list[dict[str, Any]] = []

            async def read() -> None:
                while True:
                    events.append(await next_event(ws))
                    if (
                        events[-1]["type"]
                        == "conversation.item.input_audio_transcription.completed"
                    ):
                        return

            reader = asyncio.create_task(read())
            for start in range(0, len(pcm), PIECE):
                await ws.send(append(pcm[start : start + PIECE]))
                await asyncio.sleep(0.1)
            early = [e["delta"] for e in events if e["type"] == "transcription.delta"]
            await ws.send(event("input_audio_buffer.commit", final=True))
            await asyncio.wait_for(reader, 120)
            [done] = [e for e in events if e["type"] == "transcription.done"]
            return early, done, events

    early, done, events = asyncio.run(run())
    assert early, f"no text arrived while the audio did: {events}"
    assert done["text"] == http_text(whisper, pcm)
    assert done["usage"]["seconds"] == -(-len(pcm) // 16_000)
    assert done["usage"]["completion_tokens"] > 0
    deltas = [e["delta"] for e in events if e["type"] == "transcription.delta"]
    openai_deltas = [
        e["delta"]
        for e in events
        if e["type"] == "conversation.item.input_audio_transcription.delta"
    ]
    assert openai_deltas == deltas
    # Deltas are never taken back: together they start the final text, or
    # stop where a later decode changed a word.
    joined = "".join(deltas)
    assert done["text"].startswith(joined) or len(joined) < len(done["text"])
    [committed] = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    completed = events[-1]
    assert completed["transcript"] == done["text"]
    assert completed["item_id"] == committed["item_id"]


def test_key_required_on_the_handshake(whisper: str) -> None:
    async def run() -> None:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with websockets.connect(ws_url(whisper), additional_headers=headers):
                    pass
            assert refused.value.response.status_code == 401
        # A browser's way: the key as a subprotocol; "realtime" is the one accepted.
        protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
        async with websockets.connect(ws_url(whisper), subprotocols=protocols) as ws:
            assert ws.subprotocol == "realtime"
            assert (await next_event(ws))["type"] == "session.created"
        with pytest.raises(websockets.InvalidStatus):
            bad = ["realtime", "openai-insecure-api-key.wrong"]
            async with websockets.connect(ws_url(whisper), subprotocols=bad):
                pass

    asyncio.run(run())


def test_bad_events_get_errors_and_the_session_goes_on(
    whisper: str, short_pcm: np.ndarray, short_text: str
) -> None:
    async def run() -> None:
        async with websockets.connect(ws_url(whisper), additional_headers=AUTH) as ws:
            await next_event(ws, "session.created")

            async def error_for(message: str | bytes) -> str:
                await ws.send(message)
                error = await next_event(ws, "error")
                assert isinstance(error["error"], str) and error["error"]
                return str(error["code"])

            assert await error_for("{not json") == "invalid_json"
            assert await error_for("[1, 2]") == "invalid_event"
            assert await error_for(event("no.such.event")) == "unknown_event"
            assert await error_for(b"\x00\x01") == "invalid_event"
            assert await error_for(event("input_audio_buffer.commit")) == "model_not_validated"
            assert await error_for(event("session.update", model="no-such-model")) == (
                "model_not_found"
            )
            assert await error_for(event("input_audio_buffer.append", audio="%%%")) == (
                "invalid_audio"
            )
            odd = base64.b64encode(b"\x01\x02\x03").decode()
            assert await error_for(event("input_audio_buffer.append", audio=odd)) == (
                "invalid_audio"
            )
            assert await error_for(event("response.create")) == "invalid_event"
            # Still working: a transcription of a short clip.
            await ws.send(event("session.update", model=MODEL))
            await next_event(ws, "session.updated")
            await ws.send(append(short_pcm))
            await ws.send(event("input_audio_buffer.commit", final=True))
            done = await next_event(ws, "transcription.done")
            assert done["text"] == short_text

    asyncio.run(run())


def test_openai_transcription_events(whisper: str, short_pcm: np.ndarray, short_text: str) -> None:
    """OpenAI's flow: the model on the URL, the session object, a commit without
    `final`, clear; errors in OpenAI's shape."""

    async def run() -> None:
        query = f"?model={MODEL}&intent=transcription"
        async with websockets.connect(ws_url(whisper, query), additional_headers=AUTH) as ws:
            await next_event(ws, "session.created")
            session = {
                "type": "transcription",
                "audio": {"input": {"transcription": {"model": MODEL, "language": "en"}}},
            }
            await ws.send(event("session.update", session=session))
            updated = await next_event(ws, "session.updated")
            assert updated["session"]["input_audio_transcription"]["language"] == "en"
            await ws.send(append(short_pcm[:8000]))
            await ws.send(event("input_audio_buffer.clear"))
            await next_event(ws, "input_audio_buffer.cleared")
            await ws.send(append(short_pcm))
            await ws.send(event("input_audio_buffer.commit"))
            committed = await next_event(ws, "input_audio_buffer.committed")
            completed = await next_event(
                ws, "conversation.item.input_audio_transcription.completed"
            )
            assert completed["item_id"] == committed["item_id"]
            assert completed["transcript"] == short_text
            await ws.send(json.dumps({"type": "bogus", "event_id": "evt_1"}))
            error = (await next_event(ws, "error"))["error"]
            assert error["code"] == "unknown_event" and error["event_id"] == "evt_1"
            assert error["message"]

    before = audio_seconds(whisper)
    asyncio.run(run())
    # The utterance's audio counts in /metrics (the cleared half second does not).
    assert audio_seconds(whisper) - before == pytest.approx(len(short_pcm) / 16000)


def audio_seconds(base: str) -> float:
    text = httpx.get(f"{base}/metrics", headers=AUTH, timeout=10).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pagoda:audio_seconds_total")
    ]
    return sum(values)


def test_session_limit(whisper: str) -> None:
    async def run() -> None:
        sessions = [
            await websockets.connect(ws_url(whisper), additional_headers=AUTH)
            for _ in range(MAX_SESSIONS)
        ]
        for ws in sessions:
            await next_event(ws, "session.created")
        async with websockets.connect(ws_url(whisper), additional_headers=AUTH) as extra:
            error = await next_event(extra, "error")
            assert error["code"] == "too_many_sessions"
            assert await close_code(extra) == 1008
        await sessions[0].close()
        # Its place is free once the server has seen it go.
        deadline = time.monotonic() + 10
        while True:
            async with websockets.connect(ws_url(whisper), additional_headers=AUTH) as ws:
                if (await next_event(ws))["type"] == "session.created":
                    break
            assert time.monotonic() < deadline, "a closed session's place stayed taken"
            await asyncio.sleep(0.2)
        for ws in sessions[1:]:
            await ws.close()

    asyncio.run(run())


def test_audio_buffer_limit(whisper: str) -> None:
    async def run() -> None:
        async with websockets.connect(ws_url(whisper), additional_headers=AUTH) as ws:
            await next_event(ws, "session.created")
            piece = np.zeros(100_000, dtype="<i2")  # 200 KB
            for _ in range(MAX_AUDIO_BYTES // piece.nbytes):
                await ws.send(append(piece))
            await ws.send(append(piece))
            error = await next_event(ws, "error")
            assert error["code"] == "audio_buffer_full"
            assert await close_code(ws) == 1008

    asyncio.run(run())


def test_message_rate_limit(whisper: str) -> None:
    async def run() -> None:
        async with websockets.connect(ws_url(whisper), additional_headers=AUTH) as ws:
            await next_event(ws, "session.created")
            for _ in range(4 * MAX_MESSAGES_PER_SECOND):
                await ws.send(event("session.update", model=MODEL))
            error = await next_event(ws, "error")
            assert error["code"] == "rate_limit_exceeded"
            assert await close_code(ws) == 1008

    asyncio.run(run())


def test_idle_session_is_closed(whisper: str) -> None:
    async def run() -> float:
        async with websockets.connect(ws_url(whisper), additional_headers=AUTH) as ws:
            await next_event(ws, "session.created")
            started = time.monotonic()
            error = await next_event(ws, "error", timeout=IDLE_TIMEOUT + 10)
            assert error["code"] == "idle_timeout"
            assert await close_code(ws) == 1000
            return time.monotonic() - started

    waited = asyncio.run(run())
    assert IDLE_TIMEOUT - 0.1 <= waited <= IDLE_TIMEOUT + 5


def engine_running(base: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.split()[-1])
    raise AssertionError("no vllm:num_requests_running in /metrics")


def wait_engine_idle(base: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine_running(base) > 0:
        assert time.monotonic() < deadline, "the engine still runs a gone client's requests"
        time.sleep(0.2)


# ------------------------------------------------------------------ chat


def test_text_conversation(server: Server) -> None:
    """OpenAI Realtime's text events on the default chat model: the greedy
    answer equals /v1/chat/completions' for the same conversation."""
    question = "What is the capital of France?"

    async def run() -> tuple[list[str], list[str], dict[str, Any]]:
        async with websockets.connect(ws_url(server.base_url)) as ws:
            await next_event(ws, "session.created")
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": question}],
            }
            await ws.send(event("conversation.item.create", item=item))
            created = await next_event(ws, "conversation.item.created")
            assert created["item"]["role"] == "user" and created["item"]["id"]
            options = {"temperature": 0, "max_output_tokens": 12}
            await ws.send(event("response.create", response=options))
            # One response at a time.
            await ws.send(event("response.create", response=options))
            text_deltas: list[str] = []
            output_deltas: list[str] = []
            error_seen = False
            while True:
                received = await next_event(ws)
                if received["type"] == "response.text.delta":
                    text_deltas.append(received["delta"])
                elif received["type"] == "response.output_text.delta":
                    output_deltas.append(received["delta"])
                elif received["type"] == "error":
                    assert received["error"]["code"] == "conversation_already_has_active_response"
                    error_seen = True
                elif received["type"] == "response.done":
                    assert error_seen
                    return text_deltas, output_deltas, received["response"]

    text_deltas, output_deltas, response = asyncio.run(run())
    assert len(text_deltas) > 1, "the answer came in one piece, not streamed"
    assert text_deltas == output_deltas
    assert response["status"] in ("completed", "incomplete")
    [item] = response["output"]
    assert item["content"][0]["text"] == "".join(text_deltas)
    reply = httpx.post(
        server.v1 + "/chat/completions",
        json={
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": 12,
        },
        timeout=60,
    ).json()
    assert "".join(text_deltas) == reply["choices"][0]["message"]["content"]


def test_conversation_goes_on_and_cancel(server: Server) -> None:
    async def run() -> dict[str, Any]:
        async with websockets.connect(ws_url(server.base_url)) as ws:
            await next_event(ws, "session.created")
            await ws.send(event("session.update", session={"instructions": "Answer briefly."}))
            await next_event(ws, "session.updated")
            await ws.send(event("conversation.item.create", item={"role": "user", "content": []}))
            assert (await next_event(ws, "error"))["error"]["code"] == "invalid_event"
            await ws.send(event("input_audio_buffer.commit"))
            assert (await next_event(ws, "error"))["error"]["code"] == "invalid_event"
            for text in ("Count from one to ten.", "Now count backwards."):
                content = [{"type": "input_text", "text": text}]
                item = {"type": "message", "role": "user", "content": content}
                await ws.send(event("conversation.item.create", item=item))
                await next_event(ws, "conversation.item.created")
                await ws.send(event("response.create", response={"max_output_tokens": 4}))
                done = await next_event(ws, "response.done")
                assert done["response"]["status"] in ("completed", "incomplete")
                assert done["response"]["usage"]["output_tokens"] <= 4
            # The second prompt held the first exchange: more input tokens.
            assert done["response"]["usage"]["input_tokens"] > 20
            # Greedy and told to go on at length: still running when the cancel comes.
            long = {
                "max_output_tokens": 500,
                "temperature": 0,
                "instructions": "Write a long story about a dragon.",
            }
            await ws.send(event("response.create", response=long))
            await next_event(ws, "response.output_text.delta")
            await ws.send(event("response.cancel"))
            return (await next_event(ws, "response.done"))["response"]

    cancelled = asyncio.run(run())
    assert cancelled["status"] == "cancelled"
    wait_engine_idle(server.base_url)


def test_vanished_client_frees_its_engine_request(server: Server) -> None:
    async def run() -> None:
        ws = await websockets.connect(ws_url(server.base_url))
        await next_event(ws, "session.created")
        text = "Write a long story about a dragon."
        item = {"role": "user", "content": [{"type": "input_text", "text": text}]}
        await ws.send(event("conversation.item.create", item=item))
        await ws.send(
            event("response.create", response={"max_output_tokens": 800, "temperature": 0})
        )
        await next_event(ws, "response.output_text.delta")
        assert engine_running(server.base_url) >= 1
        ws.transport.abort()  # gone without a close frame

    asyncio.run(run())
    wait_engine_idle(server.base_url)


# ------------------------------------------------------- the openai client


def test_openai_client_transcription(whisper: str, short_pcm: np.ndarray, short_text: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=whisper + "/v1", api_key=KEY, max_retries=0)
    with client.realtime.connect(model=MODEL) as connection:
        assert connection.recv().type == "session.created"
        transcription = {"model": MODEL, "language": "en"}
        session = {"type": "transcription", "audio": {"input": {"transcription": transcription}}}
        connection.session.update(session=session)  # type: ignore[arg-type]
        connection.input_audio_buffer.append(audio=base64.b64encode(short_pcm.tobytes()).decode())
        connection.input_audio_buffer.commit()
        deltas = []
        for received in connection:
            if received.type == "conversation.item.input_audio_transcription.delta":
                deltas.append(received.delta)
            if received.type == "conversation.item.input_audio_transcription.completed":
                assert received.transcript == short_text
                break
    assert "".join(deltas) == short_text


def test_openai_client_conversation(server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    with client.realtime.connect(model="HuggingFaceTB/SmolLM2-135M-Instruct") as connection:
        assert connection.recv().type == "session.created"
        # Greedy, and a question whose answer runs past the 8-token limit.
        content = [{"type": "input_text", "text": "Write a long story about a dragon."}]
        item = {"type": "message", "role": "user", "content": content}
        connection.conversation.item.create(item=item)  # type: ignore[arg-type]
        connection.response.create(
            response={"max_output_tokens": 8, "temperature": 0}  # type: ignore[typeddict-unknown-key]
        )
        text = ""
        for received in connection:
            if received.type == "response.output_text.delta":
                text += received.delta
            if received.type == "response.done":
                assert received.response.status == "incomplete", received
                assert received.response.usage is not None
                assert received.response.usage.output_tokens == 8
                [output] = received.response.output
                assert output.content[0].text == text and text  # type: ignore[union-attr]
                break
