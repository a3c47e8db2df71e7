"""Speech to text: OpenAI's audio routes on a Whisper model.

    POST /v1/audio/transcriptions     multipart: file, model, language, prompt,
    POST /v1/audio/translations       response_format, temperature, stream, ...

A request's life:

1. The multipart form is read and checked (`audio_form.py`): `file` must
   be an uploaded file (a text field is a 400), at most
   --max-audio-file-bytes (413).
2. The file is decoded to 16 kHz mono, cut into windows of at most 30 s at
   quiet points, and each window's log-mel features computed
   (frontend/audio.py), off the event loop.
3. Each window is one engine request: its features as `encoder_features`, the
   decoder prompt from `WhisperTokens`. Unless streamed, each window also
   gets a one-token request that reads Whisper's probability of no speech;
   a window likely silent whose text the model doubts gives no text
   (Whisper's rule). The windows run in parallel and their texts are
   joined in order.
4. The answer in the asked format: json, text (text/plain), verbose_json,
   srt or vtt, or an SSE stream of `transcription.chunk` (`translation.chunk`)
   objects. Usage is in seconds of audio.

The decoder runs with <|notimestamps|>, so the segments of verbose_json, srt
and vtt are the 30 s windows themselves (their start and end in the audio),
not Whisper's finer timestamped segments.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from pagoda.frontend.api.audio_form import AUDIO_FORM_OPENAPI, AudioRequest, read_audio_form
from pagoda.frontend.api.common import (
    check_model,
    merge_streams,
    new_id,
    now,
    sse,
    sse_with_errors,
    unavailable,
    unless_disconnected,
    usage,
)
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.subtitles import Segment, to_srt, to_vtt
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.audio import (
    SAMPLE_RATE,
    AudioError,
    Samples,
    decode_audio,
    features_bytes,
    log_mel_features,
    split_audio,
)
from pagoda.frontend.outputs import RequestOutput
from pagoda.frontend.whisper_tokens import LANGUAGES, WhisperTokenError, WhisperTokens
from pagoda.protocol.sampling_params import SamplingParams

AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
# Whisper's defaults for dropping a window's text as no speech.
NO_SPEECH_THRESHOLD = 0.6
LOGPROB_THRESHOLD = -1.0


@dataclass(frozen=True)
class Window:
    """One window of the audio: where it lies, and its encoder features."""

    start: float
    end: float
    features: bytes


def windows_of(data: bytes, n_mels: int) -> tuple[float, list[Window]]:
    """The audio's duration in seconds and its windows (CPU work: run off the loop)."""
    samples = decode_audio(data)
    windows = []
    start = 0
    for chunk in split_audio(samples):
        features = features_bytes(log_mel_features(chunk, n_mels))
        end = start + len(chunk)
        windows.append(Window(start / SAMPLE_RATE, end / SAMPLE_RATE, features))
        start = end
    return len(samples) / SAMPLE_RATE, windows


def usage_seconds(duration: float) -> dict[str, Any]:
    """OpenAI's usage of an audio request: whole seconds, rounded up (as vLLM)."""
    return {"type": "duration", "seconds": math.ceil(duration)}


class AudioServer:
    """Runs transcription and translation requests on one AsyncLLM."""

    def __init__(self, engine: AsyncLLM, served: list[str], max_file_bytes: int) -> None:
        self.engine = engine
        self.served = served
        self.max_file_bytes = max_file_bytes
        self.whisper = WhisperTokens.from_tokenizer(engine.tokenizer, engine.ready.vocab_size)
        # The engine's Ready names no mel count; Whisper large-v3 has the only
        # 128-mel encoder, and a vocabulary of 51,866.
        self.n_mels = 128 if engine.ready.vocab_size >= 51_866 else 80

    async def handle(self, task: str, raw: Request) -> Response:
        req = await read_audio_form(raw, self.max_file_bytes)
        started = time.monotonic()
        model = check_model(self.engine, self.served, req.model)
        try:
            self.whisper.check_task(task)
            language = self.whisper.check_language(req.language)
        except WhisperTokenError as e:
            raise APIError(400, str(e), e.param) from None
        try:
            duration, windows = await asyncio.to_thread(windows_of, req.data, self.n_mels)
        except AudioError as e:
            raise APIError(400, str(e), "file") from None
        prompt_ids = self.whisper.decoder_prompt(
            task, language, self.whisper.encode_prompt(self.engine.tokenizer, req.prompt)
        )
        params = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            repetition_penalty=req.repetition_penalty,
            max_tokens=req.max_completion_tokens,
            stop_token_ids=[self.whisper.end_of_text],
            logit_bias=self.whisper.suppress_bias() or None,
            logprobs=0,  # the sampled tokens' logprobs, for avg_logprob
        )
        kind = "transcription" if task == "transcribe" else "translation"
        request_id = new_id(kind)
        streams = [
            self.engine.generate_tokens(
                None,
                prompt_ids,
                params,
                f"{request_id}-{i}",
                "delta" if req.stream else "final",
                encoder_features=window.features,
            )
            for i, window in enumerate(windows)
        ]
        if req.stream:
            events = self._stream(request_id, kind, model, streams, len(prompt_ids), duration, req)
            observed = self._observed(events, duration, started)
            return StreamingResponse(sse_with_errors(observed), media_type="text/event-stream")
        no_speech = self._no_speech_streams(request_id, prompt_ids, windows)
        outputs = await unless_disconnected(raw, _collect([*streams, *no_speech]))
        self._observe(duration, started)
        texts, no_speech_outputs = outputs[: len(windows)], outputs[len(windows) :]
        probs: list[float | None] = [self._no_speech_prob(out) for out in no_speech_outputs]
        probs = probs or [None] * len(windows)
        return self._response(task, language, req, duration, windows, texts, probs)

    async def transcribe_window(
        self, samples: Samples, language: str, request_id: str, no_speech_rule: bool = True
    ) -> tuple[str, int, int]:
        """One window (at most 30 s) transcribed as this route does at its defaults
        (greedy, no prompt, the no-speech rule unless `no_speech_rule` is False): its
        text, prompt and sampled tokens. The realtime sessions' decodes
        (realtime_transcription.py)."""
        mel = await asyncio.to_thread(log_mel_features, samples, self.n_mels)
        features = features_bytes(mel)
        window = Window(0.0, len(samples) / SAMPLE_RATE, features)
        prompt_ids = self.whisper.decoder_prompt("transcribe", language, [])
        params = SamplingParams(
            temperature=0.0,
            max_tokens=None,  # the rest of the decoder's context, as the route
            stop_token_ids=[self.whisper.end_of_text],
            logit_bias=self.whisper.suppress_bias() or None,
            logprobs=0,
        )
        text_stream = self.engine.generate_tokens(
            None, prompt_ids, params, request_id, "final", encoder_features=features
        )
        no_speech = (
            self._no_speech_streams(request_id, prompt_ids, [window]) if no_speech_rule else []
        )
        [out, *no_speech_outputs] = await _collect([text_stream, *no_speech])
        prob = self._no_speech_prob(no_speech_outputs[0]) if no_speech_outputs else None
        text = "" if _silent(out, prob) else out.outputs[0].text
        return text, len(prompt_ids), len(out.outputs[0].token_ids)

    def _no_speech_streams(
        self, request_id: str, prompt_ids: list[int], windows: list[Window]
    ) -> list[AsyncIterator[RequestOutput]]:
        """One request per window reading the probability of <|nocaptions|> after
        <|startoftranscript|>: one greedy token, that probability requested."""
        if self.whisper.no_speech is None:
            return []
        params = SamplingParams(
            temperature=0.0, max_tokens=1, logprob_token_ids=[self.whisper.no_speech]
        )
        prompt = self.whisper.no_speech_prompt(prompt_ids)
        return [
            self.engine.generate_tokens(
                None, prompt, params, f"{request_id}-nospeech-{i}", "final",
                encoder_features=window.features,
            )
            for i, window in enumerate(windows)
        ]  # fmt: skip

    def _no_speech_prob(self, out: RequestOutput) -> float:
        assert self.whisper.no_speech is not None  # no such requests without it
        position = (out.outputs[0].logprobs or [{}])[0]
        return math.exp(position[self.whisper.no_speech].logprob)

    def _observe(self, duration: float, started: float) -> None:
        if self.engine.metrics is not None:
            self.engine.metrics.observe_audio(duration, time.monotonic() - started)

    async def _observed(
        self, events: AsyncIterator[str], duration: float, started: float
    ) -> AsyncIterator[str]:
        """`events`, and the request counted in the metrics once they all went out."""
        async for event in events:
            yield event
        self._observe(duration, started)

    def _response(
        self,
        task: str,
        language: str,
        req: AudioRequest,
        duration: float,
        windows: list[Window],
        outputs: list[RequestOutput],
        no_speech_probs: list[float | None],
    ) -> Response:
        silent = [_silent(out, p) for out, p in zip(outputs, no_speech_probs, strict=True)]
        segments = [
            Segment(w.start, w.end, "" if quiet else out.outputs[0].text)
            for w, out, quiet in zip(windows, outputs, silent, strict=True)
        ]
        text = "".join(s.text for s in segments).strip()
        if req.response_format == "text":
            return PlainTextResponse(text + "\n")
        if req.response_format == "srt":
            return PlainTextResponse(to_srt(segments))
        if req.response_format == "vtt":
            return PlainTextResponse(to_vtt(segments), media_type="text/vtt")
        body: dict[str, Any] = {"text": text}
        if req.response_format == "verbose_json":
            body = {
                "task": task,
                "language": LANGUAGES.get(language, language),
                "duration": round(duration, 3),
                "text": text,
                "segments": [
                    self._segment_json(i, s, out, req.temperature, p, quiet)
                    for i, (s, out, p, quiet) in enumerate(
                        zip(segments, outputs, no_speech_probs, silent, strict=True)
                    )
                ],
            }
        body["usage"] = usage_seconds(duration)
        return JSONResponse(body)

    def _segment_json(
        self,
        index: int,
        segment: Segment,
        out: RequestOutput,
        temperature: float,
        no_speech_prob: float | None,
        silent: bool,
    ) -> dict[str, Any]:
        """One window as a verbose_json segment; `tokens` are its text tokens (no
        <|endoftext|>; none when the no-speech rule dropped its text)."""
        sample = out.outputs[0]
        tokens = [] if silent else [t for t in sample.token_ids if t != self.whisper.end_of_text]
        return {
            "id": index,
            "seek": round(segment.start * SAMPLE_RATE / 160),  # in feature frames, as Whisper
            "start": round(segment.start, 3),
            "end": round(segment.end, 3),
            "text": segment.text,
            "tokens": tokens,
            "temperature": temperature,
            "avg_logprob": _avg_logprob(out),
            "compression_ratio": _compression_ratio(segment.text.encode("utf-8")),
            "no_speech_prob": no_speech_prob,
        }

    async def _stream(
        self,
        request_id: str,
        kind: str,
        model: str,
        streams: list[AsyncIterator[RequestOutput]],
        num_prompt: int,
        duration: float,
        req: AudioRequest,
    ) -> AsyncIterator[str]:
        """Text deltas in the audio's order: a later window's text waits for
        the windows before it to finish."""

        def token_usage() -> dict[str, int]:
            num_prompts = num_prompt * len(streams)  # every window has the prompt
            return usage(num_prompts, num_completion)

        created = now()
        base = {"id": request_id, "object": f"{kind}.chunk", "created": created, "model": model}
        pending: list[list[tuple[str, str | None]]] = [[] for _ in streams]
        done = [False] * len(streams)
        current = 0
        num_completion = 0
        async for i, out in merge_streams(streams):
            sample = out.outputs[0]
            num_completion += len(sample.token_ids)
            last = i == len(streams) - 1
            pending[i].append((sample.text, sample.finish_reason if last else None))
            done[i] = sample.finish_reason is not None
            while current < len(streams):
                for text, finish in pending[current]:
                    if text or finish is not None:
                        choice = {"delta": {"content": text}, "finish_reason": finish}
                        chunk = {**base, "choices": [{**choice, "stop_reason": None}]}
                        if req.stream_continuous_usage_stats:
                            chunk["usage"] = token_usage()  # tokens so far
                        yield sse(chunk)
                pending[current] = []
                if not done[current]:
                    break
                current += 1
        if current < len(streams):
            raise unavailable("the transcription was aborted")
        if req.stream_include_usage:
            final = {**usage_seconds(duration), **token_usage()}
            yield sse({**base, "choices": [], "usage": final})


def _avg_logprob(out: RequestOutput) -> float | None:
    """The sampled tokens' mean logprob, <|endoftext|> counted (as Whisper's)."""
    sample = out.outputs[0]
    if sample.cumulative_logprob is None or not sample.token_ids:
        return None
    return sample.cumulative_logprob / len(sample.token_ids)


def _silent(out: RequestOutput, no_speech_prob: float | None) -> bool:
    """Whisper's no-speech rule: a window that likely holds no speech and whose
    text the model doubts gives no text."""
    avg_logprob = _avg_logprob(out)
    return (
        no_speech_prob is not None
        and no_speech_prob > NO_SPEECH_THRESHOLD
        and avg_logprob is not None
        and avg_logprob < LOGPROB_THRESHOLD
    )


def _compression_ratio(text: bytes) -> float:
    """Whisper's repetition measure: the text's length over its zlib-compressed length."""
    import zlib

    if not text:
        return 0.0
    return round(len(text) / len(zlib.compress(text)), 4)


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    outputs: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        outputs[i] = out
    finished = [out for out in outputs if out is not None and out.finished]
    if len(finished) != len(streams):
        raise unavailable("the transcription was aborted")
    return finished


def build_router(
    engine: AsyncLLM, served: list[str], max_file_bytes: int, counted: Any
) -> APIRouter:
    """The audio routes; `counted` runs each call as one in-flight request."""
    router = APIRouter()
    server = AudioServer(engine, served, max_file_bytes)

    @router.post("/v1/audio/transcriptions", openapi_extra=AUDIO_FORM_OPENAPI)
    async def create_transcription(request: Request) -> Any:
        return await counted(lambda: server.handle("transcribe", request))

    @router.post("/v1/audio/translations", openapi_extra=AUDIO_FORM_OPENAPI)
    async def create_translation(request: Request) -> Any:
        return await counted(lambda: server.handle("translate", request))

    return router
