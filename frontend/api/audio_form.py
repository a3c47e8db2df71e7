"""The multipart form of the audio routes, read and checked.

OpenAI's fields: `file` (an uploaded file; the same name as a text field is
a 400), `model`, `language`, `prompt`, `response_format` (json, text,
verbose_json, srt, vtt), `timestamp_granularities[]`, `temperature` (0 to 1),
`stream`, `stream_include_usage`; vLLM's `stream_continuous_usage_stats`
(token usage on every streamed chunk) and its sampling extras `top_p`, `top_k`,
`min_p`, `seed`, `repetition_penalty`, `max_completion_tokens`. A file over
--max-audio-file-bytes is a 413.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException

from pagoda.frontend.api.errors import APIError

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
# OpenAI's limit (vLLM's too): 25 MiB.
DEFAULT_MAX_AUDIO_FILE_BYTES = 25 << 20
# Room for the multipart envelope and the other fields around the file.
MULTIPART_SLACK_BYTES = 1 << 20


def _field(kind: str, description: str, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "description": description, **extra}


# The form as OpenAPI describes it (the routes read it by hand, to tell a text
# field from a file and to check the file's size first).
AUDIO_FORM_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": _field("string", "WAV, FLAC, OGG or MP3", format="binary"),
                        "model": _field("string", "the served model's name"),
                        "language": _field("string", "ISO-639-1 code of the speech"),
                        "prompt": _field("string", "text the speech continues"),
                        "response_format": _field(
                            "string", "the answer's format", enum=list(RESPONSE_FORMATS)
                        ),
                        "timestamp_granularities[]": _field(
                            "array",
                            "verbose_json only",
                            items={"type": "string", "enum": ["segment"]},
                        ),
                        "temperature": _field("number", "0 to 1", minimum=0, maximum=1),
                        "stream": _field("boolean", "server-sent text deltas"),
                        "stream_include_usage": _field("boolean", "a last usage chunk"),
                        "stream_continuous_usage_stats": _field("boolean", "usage on every chunk"),
                        "top_p": _field("number", "nucleus sampling"),
                        "top_k": _field("integer", "top-k sampling; 0: off"),
                        "min_p": _field("number", "min-p sampling"),
                        "seed": _field("integer", "sampling seed"),
                        "repetition_penalty": _field("number", "1: off"),
                        "max_completion_tokens": _field("integer", "tokens per 30 s window"),
                    },
                }
            }
        },
    }
}


def audio_body_limit(max_request_body_bytes: int, max_audio_file_bytes: int) -> int:
    """The request body limit of a server that takes audio uploads."""
    return max(max_request_body_bytes, max_audio_file_bytes + MULTIPART_SLACK_BYTES)


@dataclass(frozen=True)
class AudioRequest:
    """A checked audio request; `data` is the uploaded file's bytes."""

    data: bytes
    model: str | None
    language: str | None
    prompt: str | None
    response_format: str
    timestamp_granularities: tuple[str, ...]
    temperature: float
    stream: bool
    stream_include_usage: bool
    stream_continuous_usage_stats: bool
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    repetition_penalty: float
    max_completion_tokens: int | None


def _text(form: Mapping[str, Any], name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise APIError(400, f"{name} must be a text field, not a file", name)
    return value


def _number(form: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    value = _text(form, name)
    if value is None or value == "":
        return default
    try:
        number = kind(value)
    except ValueError:
        raise APIError(400, f"{name} must be a {kind.__name__}, got {value[:30]!r}", name) from None
    if isinstance(number, float) and not math.isfinite(number):
        raise APIError(400, f"{name} must be a finite number", name)
    return number


def _flag(form: Mapping[str, Any], name: str) -> bool:
    value = (_text(form, name) or "false").strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise APIError(400, f"{name} must be true or false, got {value[:30]!r}", name)
    return value in ("true", "1")


def parse_audio_form(
    form: Mapping[str, Any], granularities: list[Any], data: bytes
) -> AudioRequest:
    """Check the form's fields (all but the file, already read into `data`).

    `granularities` are the values of `timestamp_granularities[]` (a repeated
    field); only "segment" timestamps exist here, for verbose_json, as OpenAI.
    """
    response_format = _text(form, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise APIError(
            400,
            f"response_format must be one of {list(RESPONSE_FORMATS)}, "
            f"got {response_format[:30]!r}",
            "response_format",
        )
    grains = []
    for grain in granularities:
        if grain not in ("segment", "word"):
            raise APIError(
                400,
                "timestamp_granularities[] takes 'segment' (or 'word')",
                "timestamp_granularities[]",
            )
        if grain == "word":
            raise APIError(
                400,
                "word timestamps are not available: the decoder runs without timestamps",
                "timestamp_granularities[]",
            )
        grains.append(grain)
    if grains and response_format != "verbose_json":
        raise APIError(
            400,
            "timestamp_granularities[] needs response_format verbose_json",
            "timestamp_granularities[]",
        )
    temperature = _number(form, "temperature", float, 0.0)
    if not 0.0 <= temperature <= 1.0:
        raise APIError(400, "temperature must be between 0 and 1", "temperature")
    stream = _flag(form, "stream")
    include_usage = _flag(form, "stream_include_usage")
    if include_usage and not stream:
        raise APIError(400, "stream_include_usage needs stream", "stream_include_usage")
    continuous_usage = _flag(form, "stream_continuous_usage_stats")
    if continuous_usage and not stream:
        raise APIError(
            400, "stream_continuous_usage_stats needs stream", "stream_continuous_usage_stats"
        )
    if stream and response_format not in ("json", "text"):
        raise APIError(
            400, f"streaming gives text deltas; response_format {response_format} cannot stream",
            "stream",
        )  # fmt: skip
    max_tokens = _number(form, "max_completion_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, "max_completion_tokens must be at least 1", "max_completion_tokens")
    return AudioRequest(
        data=data,
        model=_text(form, "model") or None,
        language=_text(form, "language") or None,
        prompt=_text(form, "prompt"),
        response_format=response_format,
        timestamp_granularities=tuple(grains),
        temperature=temperature,
        stream=stream,
        stream_include_usage=include_usage,
        stream_continuous_usage_stats=continuous_usage,
        top_p=_number(form, "top_p", float, 1.0),
        top_k=_number(form, "top_k", int, 0),
        min_p=_number(form, "min_p", float, 0.0),
        seed=_number(form, "seed", int, None),
        repetition_penalty=_number(form, "repetition_penalty", float, 1.0),
        max_completion_tokens=max_tokens,
    )


async def read_audio_form(request: Request, max_file_bytes: int) -> AudioRequest:
    """The request's multipart form, checked; the file read whole."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise APIError(400, "this route takes multipart/form-data with the audio as `file`")
    try:
        form = await request.form(max_files=1, max_fields=64)
    except MultiPartException as e:
        raise APIError(400, f"the multipart form could not be read: {e.message}") from None
    upload = form.get("file")
    if upload is None:
        raise APIError(400, "the audio `file` is missing", "file")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "`file` must be an uploaded file, not a text field", "file")
    if upload.size is not None and upload.size > max_file_bytes:
        raise APIError(413, f"the audio file is over {max_file_bytes} bytes", "file")
    data = await upload.read()
    if len(data) > max_file_bytes:
        raise APIError(413, f"the audio file is over {max_file_bytes} bytes", "file")
    return parse_audio_form(form, form.getlist("timestamp_granularities[]"), data)
