"""One utterance of a realtime transcription session, transcribed while it arrives.

An utterance is the audio between two final commits. Its samples are cut
into windows of at most 30 s exactly as the HTTP route cuts an upload
(`frontend/audio.split_audio`: each cut at the quietest 0.1 s of the second
before the 30 s mark), so that the text at the end equals the route's text
for the same audio:

- a window that is full is closed: transcribed once more as the route does
  it (greedy, with the no-speech rule), and its text is final;
- the open window (the audio after the last cut) is transcribed again each
  time about a second more audio has arrived (without the no-speech rule,
  which costs a second encoder pass); the text two such decodes in a row
  agree on is sent as deltas (`frontend/realtime.stable_text`);
- at the final commit the open window is transcribed one last time; the
  text is the windows' texts joined, and whatever of it was not sent yet
  goes out as the last delta.

Sent text is never taken back: should the last decode disagree with text
already sent (rare: two decodes agreed on it), the `done` event's text is
the final transcription and the deltas stop where they diverged.
"""

from __future__ import annotations

import asyncio
import functools
import math
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

from pagoda.frontend.api.serving_audio import AudioServer
from pagoda.frontend.audio import (
    N_SAMPLES,
    OVERLAP_SECONDS,
    SAMPLE_RATE,
    Samples,
    quietest_point,
)
from pagoda.frontend.realtime import (
    POLICY_VIOLATION,
    REDECODE_SAMPLES,
    AudioFormatError,
    EventError,
    SessionEnd,
    new_stable_text,
    pcm16_samples,
    stable_text,
)

Send = Callable[[str, dict[str, Any]], Awaitable[None]]
Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class Utterance:
    """The audio of one utterance, its windows' texts and what was sent of them.

    `run` is the utterance's one task: it decodes as audio comes (`append`)
    and ends after the final commit (`finish`) with the done events, sent
    through `send(kind, fields)` where kind is "delta" or "done".
    """

    def __init__(
        self, audio: AudioServer, language: str, item_id: str, request_id: str, send: Send
    ) -> None:
        self.audio = audio
        self.language = language
        self.item_id = item_id
        self.request_id = request_id
        self.send = send
        self.data: Samples = np.zeros(SAMPLE_RATE, dtype=np.float32)  # grows by doubling
        self.num_samples = 0
        self.window_start = 0  # the open window's first sample
        self.closed_texts: list[str] = []
        self.last_hypothesis = ""
        self.sent = ""
        self.decoded_upto = 0  # num_samples at the last decode of the open window
        self.num_decodes = 0
        self.num_prompt_tokens = 0  # of the closed windows' and the final decodes
        self.num_completion_tokens = 0
        self.final = False
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None  # `run`, once started
        self.interim: asyncio.Task[str] | None = None  # a decode of the open window

    @property
    def num_bytes(self) -> int:
        """The utterance's audio as the client sent it: PCM16."""
        return 2 * self.num_samples

    def append(self, samples: Samples) -> None:
        end = self.num_samples + len(samples)
        if end > len(self.data):
            grown = np.zeros(max(end, 2 * len(self.data)), dtype=np.float32)
            grown[: self.num_samples] = self.data[: self.num_samples]
            self.data = grown
        self.data[self.num_samples : end] = samples
        self.num_samples = end
        self.wake.set()

    def finish(self) -> None:
        """The final commit: no more audio comes. A decode of the open window
        still running is dropped (its engine request aborted): the final
        decode covers more."""
        self.final = True
        if self.interim is not None:
            self.interim.cancel()
        self.wake.set()

    async def run(self, after: asyncio.Task[None] | None = None) -> None:
        """Decode until the final commit, then send the done events. `after`: the
        previous utterance's task, whose events go out first."""
        if after is not None:
            await asyncio.gather(after, return_exceptions=True)
        while True:
            await self.wake.wait()
            self.wake.clear()
            await self._close_full_windows()
            if self.final:
                await self._finish()
                return
            if self.num_samples - self.decoded_upto >= REDECODE_SAMPLES:
                await self._decode_open_window()

    async def _close_full_windows(self) -> None:
        """Close each window over 30 s at the cut `split_audio` would make."""
        while self.num_samples - self.window_start > N_SAMPLES:
            end = self.window_start + N_SAMPLES
            cut = quietest_point(self.data, end - OVERLAP_SECONDS * SAMPLE_RATE, end)
            text = await self._transcribe(self.window_start, cut, counted=True)
            self.closed_texts.append(text)
            self.window_start = cut
            self.last_hypothesis = ""
            await self._send_delta(new_stable_text(self.sent, "".join(self.closed_texts).strip()))

    async def _decode_open_window(self) -> None:
        upto = self.num_samples
        self.interim = asyncio.ensure_future(self._transcribe(self.window_start, upto, False))
        try:
            await asyncio.wait({self.interim})
        finally:
            self.interim.cancel()  # when `run` itself is cancelled
        if self.interim.cancelled():  # by `finish`
            return
        text = self.interim.result()
        hypothesis = ("".join(self.closed_texts) + text).strip()
        stable = stable_text(self.last_hypothesis, hypothesis)
        self.last_hypothesis = hypothesis
        self.decoded_upto = upto
        await self._send_delta(new_stable_text(self.sent, stable))

    async def _finish(self) -> None:
        text = ""
        if self.num_samples > self.window_start:
            text = await self._transcribe(self.window_start, self.num_samples, counted=True)
        final = ("".join(self.closed_texts) + text).strip()
        await self._send_delta(new_stable_text(self.sent, final))
        usage = {
            "type": "duration",
            "seconds": math.ceil(self.num_samples / SAMPLE_RATE),
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
        }
        metrics = self.audio.engine.metrics
        if metrics is not None:  # seconds of audio; its pace was the speaker's, not ours
            metrics.observe_audio(self.num_samples / SAMPLE_RATE, None)
        await self.send("done", {"text": final, "usage": usage})

    async def _send_delta(self, delta: str) -> None:
        if delta:
            self.sent += delta
            await self.send("delta", {"delta": delta})

    async def _transcribe(self, start: int, end: int, counted: bool) -> str:
        self.num_decodes += 1
        request_id = f"{self.request_id}-{self.num_decodes}"
        samples = self.data[start:end].copy()
        # The no-speech rule costs a second encoder pass: the final texts only.
        text, num_prompt, num_completion = await self.audio.transcribe_window(
            samples, self.language, request_id, no_speech_rule=counted
        )
        if counted:
            self.num_prompt_tokens += num_prompt
            self.num_completion_tokens += num_completion
        return text


class Transcriber:
    """A session's audio events: the utterance audio goes to, and the committed
    ones still decoding, whose events go out in order (each utterance's task
    waits for the one committed before it).

    Events go out through `send(type, fields)` under vLLM's name and OpenAI's;
    tasks run through the session's `spawn`, which reports their failures.
    """

    def __init__(
        self, audio: AudioServer, session_id: str, send: Send, spawn: Spawn, max_audio_bytes: int
    ) -> None:
        self.audio = audio
        self.session_id = session_id
        self.send = send
        self.spawn = spawn
        self.max_audio_bytes = max_audio_bytes
        self.language = "en"
        self.utterance: Utterance | None = None
        self.committed_task: asyncio.Task[None] | None = None  # the last committed one's
        self.previous_item_id: str | None = None
        self.just_committed = False  # no audio since the last utterance ended

    def append(self, audio: object, decode: bool) -> None:
        """input_audio_buffer.append; `decode`: the model is checked, decoding may run."""
        try:
            samples = pcm16_samples(audio)
        except AudioFormatError as e:
            raise EventError(f"Invalid audio data: {e}", "invalid_audio") from None
        utterance = self._current()
        if utterance.num_bytes + 2 * len(samples) > self.max_audio_bytes:
            raise SessionEnd(
                POLICY_VIOLATION,
                f"the audio buffer is over {self.max_audio_bytes} bytes: commit with "
                "final=true sooner",
                "audio_buffer_full",
            )
        utterance.append(samples)
        self.just_committed = False
        if decode:
            self.start()

    async def commit(self, final: object) -> None:
        """input_audio_buffer.commit: `final` true (or absent, with audio buffered)
        ends the utterance; otherwise decoding starts. A final commit with no
        audio since an utterance ended ends nothing (a client that sent
        OpenAI's commit, then vLLM's final one, gets one done)."""
        if final is not None and not isinstance(final, bool):
            raise EventError("final must be true or false", "invalid_event")
        if final and self.just_committed:
            return
        utterance = self._current()
        self.start()
        if final or (final is None and utterance.num_samples):
            utterance.finish()
            self.utterance = None
            self.committed_task = utterance.task
            self.just_committed = True
            ids = {"previous_item_id": self.previous_item_id, "item_id": utterance.item_id}
            await self.send("input_audio_buffer.committed", ids)
            self.previous_item_id = utterance.item_id

    async def clear(self) -> None:
        """input_audio_buffer.clear: the utterance's audio is dropped, its decode aborted."""
        if self.utterance is not None and self.utterance.task is not None:
            self.utterance.task.cancel()
        self.utterance = None
        self.just_committed = False
        await self.send("input_audio_buffer.cleared", {})

    def start(self) -> None:
        """Run the current utterance's task (after the last committed one's), unless it runs."""
        utterance = self._current()
        if utterance.task is None or utterance.task.done():
            utterance.task = self.spawn(utterance.run(after=self.committed_task))

    def _current(self) -> Utterance:
        if self.utterance is None:
            item_id = f"item_{uuid.uuid4().hex[:24]}"
            send = functools.partial(self._send_text, item_id)
            request_id = f"rt-{self.session_id}-{item_id}"
            self.utterance = Utterance(self.audio, self.language, item_id, request_id, send)
        return self.utterance

    async def _send_text(self, item_id: str, kind: str, fields: dict[str, Any]) -> None:
        """An utterance's "delta" and "done", under vLLM's name and OpenAI's."""
        item = {"item_id": item_id, "content_index": 0}
        if kind == "delta":
            await self.send("transcription.delta", fields)
            await self.send("conversation.item.input_audio_transcription.delta", {**item, **fields})
        else:
            await self.send("transcription.done", fields)
            completed = {**item, "transcript": fields["text"], "usage": fields["usage"]}
            await self.send("conversation.item.input_audio_transcription.completed", completed)
