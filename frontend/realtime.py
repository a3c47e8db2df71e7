"""The parts of a realtime (WebSocket) session that know nothing of WebSockets:
its limits, the message-rate bucket, PCM16 audio, and which text of a growing
transcription is stable enough to send.

Incremental transcription re-decodes the audio heard so far each time about
a second more has arrived. Whisper may still change the last words of a
hypothesis as more audio comes in (a word cut at the buffer's end, a
sentence whose punctuation depends on what follows), so only the text that
two hypotheses in a row agree on, up to the last whole word they share, is
sent ("local agreement"); what was sent is never taken back.
"""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagoda.frontend.audio import Samples

# Audio between two decodes of the growing buffer, in samples (1 s at 16 kHz).
REDECODE_SAMPLES = 16_000


@dataclass(frozen=True)
class RealtimeLimits:
    """Per API server: how many sessions, and what each may do."""

    max_sessions: int = 100
    # PCM16 bytes buffered for one utterance (between final commits): 25 MiB
    # is about 13 minutes at 16 kHz.
    max_audio_bytes: int = 25 << 20
    # A session that sends nothing this long while nothing of it runs is closed.
    idle_timeout: float = 300.0
    # Client events per second, over a one-second burst.
    max_messages_per_second: float = 100.0


class MessageRate:
    """A token bucket of `rate` events per second that holds at most `rate`."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.updated = time.monotonic()

    def allow(self) -> bool:
        """Take one event's token; False when the bucket is empty."""
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


# RFC 6455 close codes a session ends with.
NORMAL_CLOSURE = 1000
POLICY_VIOLATION = 1008
INTERNAL_ERROR = 1011


class EventError(ValueError):
    """A client event refused with an error event (`code` says why); the session goes on."""

    def __init__(self, message: str, code: str = "invalid_event") -> None:
        super().__init__(message)
        self.code = code


class SessionEnd(Exception):
    """Close the session with `code`, after an error event when `error_code` is set."""

    def __init__(self, code: int, reason: str, error_code: str | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.error_code = error_code


def session_model(event: dict[str, Any]) -> Any:
    """The model a session.update names: vLLM's `model`, or OpenAI's in `session`."""
    if "model" in event:
        return event["model"]
    session = event.get("session")
    if not isinstance(session, dict):
        return None
    return transcription_option(session, "model") or session.get("model")


def transcription_option(session: dict[str, Any], key: str) -> Any:
    """`key` of OpenAI's transcription settings in a session object:
    `input_audio_transcription` (beta) or `audio.input.transcription` (GA)."""
    beta = session.get("input_audio_transcription")
    if isinstance(beta, dict) and key in beta:
        return beta[key]
    audio = session.get("audio")
    ga = audio.get("input", {}).get("transcription") if isinstance(audio, dict) else None
    return ga.get(key) if isinstance(ga, dict) else None


class AudioFormatError(ValueError):
    """An append's audio is not base64 PCM16."""


def pcm16_samples(audio: object) -> Samples:
    """float32 samples in [-1, 1) of base64 little-endian PCM16 (16 kHz mono)."""
    if not isinstance(audio, str) or not audio:
        raise AudioFormatError("audio must be a non-empty base64 string of PCM16 samples")
    try:
        data = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise AudioFormatError("audio is not valid base64") from None
    if len(data) % 2:
        raise AudioFormatError("PCM16 audio has an even number of bytes")
    if not data:
        raise AudioFormatError("the audio holds no samples")
    # The scale soundfile reads a 16-bit WAV with: the same samples as an upload.
    return (np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0).astype(np.float32)


def stable_text(previous: str, current: str) -> str:
    """The text two successive hypotheses agree on, cut after the last whole
    word they share (a word is whole when both go on past it)."""
    n = 0
    limit = min(len(previous), len(current))
    while n < limit and previous[n] == current[n]:
        n += 1
    cut = current.rfind(" ", 0, n)  # a space both share, with text after it in both
    return current[:cut] if cut > 0 else ""


def new_stable_text(sent: str, stable: str) -> str:
    """What of `stable` goes out now, given `sent` went out before: its rest
    when it extends `sent`, else nothing (sent text is never taken back)."""
    return stable[len(sent) :] if stable.startswith(sent) else ""
