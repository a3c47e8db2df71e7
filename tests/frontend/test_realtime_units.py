"""The realtime session's parts that need no server: stable text, the message
rate, PCM16, the subprotocol key, and an utterance's windows (on a fake
transcriber) cut exactly where the HTTP route cuts the same audio."""

from __future__ import annotations

import asyncio
import base64
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from starlette.requests import HTTPConnection

from pagoda.frontend.api.realtime_transcription import Transcriber, Utterance
from pagoda.frontend.api.security import request_token
from pagoda.frontend.api.serving_realtime import choose_subprotocol
from pagoda.frontend.audio import SAMPLE_RATE, split_audio
from pagoda.frontend.realtime import (
    AudioFormatError,
    MessageRate,
    new_stable_text,
    pcm16_samples,
    session_model,
    stable_text,
)


def test_stable_text_is_what_two_hypotheses_share_up_to_a_whole_word() -> None:
    assert stable_text("", "The quick") == ""
    assert stable_text("The quick brown", "The quick brownfox jumps") == "The quick"
    assert stable_text("The quick bro", "The quick brown fox") == "The quick"
    assert stable_text("a b c", "a b c") == "a b"  # the last word may still grow
    assert stable_text("Hello world", "Goodbye world") == ""


def test_sent_text_is_never_taken_back() -> None:
    assert new_stable_text("", "The quick") == "The quick"
    assert new_stable_text("The quick", "The quick brown fox") == " brown fox"
    assert new_stable_text("The quick", "The quick") == ""
    assert new_stable_text("The quack", "The quick brown") == ""


def test_message_rate() -> None:
    rate = MessageRate(10)
    assert all(rate.allow() for _ in range(10))
    assert not rate.allow()
    time.sleep(0.25)
    assert rate.allow() and rate.allow()


def test_pcm16() -> None:
    pcm = np.array([0, 16384, -32768, 32767], dtype="<i2")
    samples = pcm16_samples(base64.b64encode(pcm.tobytes()).decode())
    assert samples.dtype == np.float32
    assert samples.tolist() == [0.0, 0.5, -1.0, 32767 / 32768]
    for bad in ("", "%%%", base64.b64encode(b"\x01").decode(), None, 5):
        with pytest.raises(AudioFormatError):
            pcm16_samples(bad)


def websocket_scope(headers: dict[str, str]) -> dict[str, Any]:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return {"type": "websocket", "path": "/v1/realtime", "headers": raw, "query_string": b""}


def test_key_in_the_subprotocol() -> None:
    offered = "realtime, openai-insecure-api-key.sesame, openai-beta.realtime-v1"
    scope = websocket_scope({"Sec-WebSocket-Protocol": offered})
    assert request_token(HTTPConnection(scope)) == b"sesame"
    bearer = websocket_scope({"Sec-WebSocket-Protocol": offered, "Authorization": "Bearer b"})
    assert request_token(HTTPConnection(bearer)) == b"b"
    http = {**scope, "type": "http", "method": "GET"}
    assert request_token(HTTPConnection(http)) == b""  # only a WebSocket's
    assert choose_subprotocol(["openai-insecure-api-key.k", "realtime"]) == "realtime"
    assert choose_subprotocol(["openai-insecure-api-key.k", "other"]) == "other"
    assert choose_subprotocol(["openai-insecure-api-key.k"]) == "openai-insecure-api-key.k"
    assert choose_subprotocol([]) is None


def test_session_model_in_every_shape() -> None:
    assert session_model({"model": "m"}) == "m"
    assert session_model({"session": {"model": "m"}}) == "m"
    beta = {"session": {"input_audio_transcription": {"model": "m"}}}
    assert session_model(beta) == "m"
    ga = {"session": {"audio": {"input": {"transcription": {"model": "m"}}}}}
    assert session_model(ga) == "m"
    assert session_model({"session": {"instructions": "x"}}) is None


class FakeTranscriber:
    """Names each window by its length, so that the cuts can be read off the text."""

    def __init__(self) -> None:
        self.windows: list[int] = []
        self.engine = SimpleNamespace(metrics=None)  # AudioServer's, without /metrics

    async def transcribe_window(
        self, samples: np.ndarray, language: str, request_id: str, no_speech_rule: bool = True
    ) -> tuple[str, int, int]:
        await asyncio.sleep(0)
        if no_speech_rule:  # a final text
            self.windows.append(len(samples))
        return f" w{len(samples)} end", 3, 2


def test_utterance_windows_are_the_http_routes_windows() -> None:
    rng = np.random.default_rng(0)
    audio = rng.uniform(-0.5, 0.5, 75 * SAMPLE_RATE).astype(np.float32)
    audio[29 * SAMPLE_RATE + 4800 : 29 * SAMPLE_RATE + 6400] = 0.0  # a quiet point to cut at
    fake = FakeTranscriber()
    events: list[tuple[str, dict[str, Any]]] = []

    async def send(kind: str, fields: dict[str, Any]) -> None:
        events.append((kind, fields))

    async def run() -> None:
        utterance = Utterance(fake, "en", "item", "rt", send)  # type: ignore[arg-type]
        task = asyncio.create_task(utterance.run())
        for start in range(0, len(audio), 8000):
            utterance.append(audio[start : start + 8000])
            await asyncio.sleep(0)
        utterance.finish()
        await task

    asyncio.run(run())
    expected = [len(chunk) for chunk in split_audio(audio)]
    assert fake.windows == expected
    assert expected[0] == 29 * SAMPLE_RATE + 4800
    kind, done = events[-1]
    assert kind == "done"
    assert done["text"] == "".join(f" w{n} end" for n in expected).strip()
    assert done["usage"]["seconds"] == 75
    assert done["usage"]["prompt_tokens"] == 3 * len(expected)
    deltas = "".join(fields["delta"] for kind, fields in events if kind == "delta")
    assert deltas == done["text"]


def test_transcriber_commits() -> None:
    """Utterances end in order, each with one done; a final commit right after
    OpenAI's commit ends nothing more; vLLM's first commit only starts."""
    events: list[tuple[str, dict[str, Any]]] = []

    async def send(kind: str, fields: dict[str, Any]) -> None:
        events.append((kind, fields))

    async def run() -> None:
        tasks: list[asyncio.Task[None]] = []

        def spawn(work: Any) -> asyncio.Task[None]:
            tasks.append(asyncio.create_task(work))
            return tasks[-1]

        transcriber = Transcriber(FakeTranscriber(), "s", send, spawn, 10**6)  # type: ignore[arg-type]
        pcm = base64.b64encode(np.zeros(1600, dtype="<i2").tobytes()).decode()
        await transcriber.commit(False)  # vLLM's start
        transcriber.append(pcm, decode=True)
        await transcriber.commit(None)  # OpenAI's commit: the end
        await transcriber.commit(True)  # vLLM's final right after: nothing more
        transcriber.append(pcm, decode=True)
        transcriber.append(pcm, decode=True)
        await transcriber.commit(True)
        await asyncio.gather(*tasks)

    asyncio.run(run())
    kinds = [kind for kind, _ in events]
    assert kinds.count("input_audio_buffer.committed") == 2
    dones = [fields for kind, fields in events if kind == "transcription.done"]
    assert [done["text"] for done in dones] == ["w1600 end", "w3200 end"]
    assert kinds.count("conversation.item.input_audio_transcription.completed") == 2
