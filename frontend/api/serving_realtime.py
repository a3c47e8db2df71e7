"""`WS /v1/realtime`: realtime sessions over a WebSocket.

On a Whisper model a session transcribes audio while it arrives (vLLM's
events, with OpenAI Realtime's names for the same things sent alongside:
`Transcriber` in realtime_transcription.py); on a generate model it holds a
text conversation (OpenAI Realtime's text events: `Conversation` in
realtime_chat.py). This module is the session around them: the handshake,
the receive loop, the limits, dispatch by event type, errors and closing.
docs/api.md ("Realtime (WebSocket)") lists every event.

    server  session.created {id, created, session}       on accept
    client  session.update {model, session: {...}}       →  session.updated
            input_audio_buffer.append {audio}            base64 PCM16, 16 kHz mono
            input_audio_buffer.commit {final}            see below
            input_audio_buffer.clear                     →  input_audio_buffer.cleared
    server  transcription.delta {delta}
              + conversation.item.input_audio_transcription.delta {item_id, delta}
            transcription.done {text, usage}
              + conversation.item.input_audio_transcription.completed {item_id, transcript}
            error {error, code}

A commit with `final: true` ends the utterance (as does OpenAI's commit,
which has no `final`, when audio is buffered): its last text and the done
events follow, and the next audio starts a new utterance. A commit with
`final: false`, or on an empty buffer, only starts decoding (vLLM's
clients send one first). Audio may be appended before the model is
checked; decoding waits for it (`session.update`, or `?model=` on the URL).

Errors in a client's event answer an `error` event and the session goes on.
Error events have vLLM's shape (`error` a string, `code`) unless the client
speaks OpenAI's dialect (a `session` object in session.update, a
conversation or response event on a chat model, or the `realtime`
subprotocol), which gets OpenAI's (`error` an object with `type`, `code`,
`message`, `event_id`).

Limits (`RealtimeLimits`, --realtime-* flags): sessions per API server (one
more is accepted, told why and closed 1008); buffered audio per utterance
and client events per second (an error event, then close 1008); a session
idle (no client event while nothing of it runs) is closed 1000. An engine
that fails closes the session 1011. A client that goes away cancels its
session's tasks, which aborts their engine requests.

Authentication is the app's (`security.py`, checked on the handshake): the
bearer key, or OpenAI's browser subprotocol `openai-insecure-api-key.<key>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from pagoda.frontend.api.common import check_model
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.realtime_chat import Conversation
from pagoda.frontend.api.realtime_transcription import Transcriber
from pagoda.frontend.api.security import API_KEY_SUBPROTOCOL
from pagoda.frontend.api.serving_audio import AudioServer
from pagoda.frontend.async_llm import AsyncLLM, EngineUnavailableError
from pagoda.frontend.engine_client import EngineDeadError
from pagoda.frontend.realtime import (
    INTERNAL_ERROR,
    NORMAL_CLOSURE,
    POLICY_VIOLATION,
    EventError,
    MessageRate,
    RealtimeLimits,
    SessionEnd,
    session_model,
    transcription_option,
)
from pagoda.frontend.whisper_tokens import WhisperTokenError

logger = logging.getLogger(__name__)

TRANSCRIPTION_EVENTS = (
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
)
CHAT_EVENTS = (
    "conversation.item.create",
    "conversation.item.delete",
    "response.create",
    "response.cancel",
)


def choose_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol to accept: "realtime" if offered, else the first one
    offered (a browser fails a handshake that picks none of those it sent)."""
    if "realtime" in offered:
        return "realtime"
    plain = [p for p in offered if not p.startswith(API_KEY_SUBPROTOCOL)]
    choices = plain or offered
    return choices[0] if choices else None


class RealtimeServer:
    """The sessions of one API server: their count, limits and shared servers."""

    def __init__(
        self,
        engine: AsyncLLM,
        served: list[str],
        limits: RealtimeLimits,
        audio: AudioServer | None,
    ) -> None:
        self.engine = engine
        self.served = served
        self.limits = limits
        self.audio = audio  # None: the model does not transcribe
        self.num_sessions = 0

    async def serve(self, websocket: WebSocket) -> None:
        offered = list(websocket.scope.get("subprotocols") or [])
        await websocket.accept(subprotocol=choose_subprotocol(offered))
        session = RealtimeSession(self, websocket, openai_dialect="realtime" in offered)
        if self.num_sessions >= self.limits.max_sessions:
            await session.end(
                SessionEnd(
                    POLICY_VIOLATION,
                    f"too many realtime sessions: this server holds at most "
                    f"{self.limits.max_sessions}",
                    "too_many_sessions",
                )
            )
            return
        self.num_sessions += 1
        try:
            await session.run()
        finally:
            self.num_sessions -= 1


class RealtimeSession:
    """One WebSocket: its receive loop, its utterance or conversation, its tasks."""

    def __init__(self, server: RealtimeServer, websocket: WebSocket, openai_dialect: bool) -> None:
        self.server = server
        self.engine = server.engine
        self.websocket = websocket
        self.openai_dialect = openai_dialect
        self.id = f"sess_{uuid.uuid4().hex[:24]}"
        self.model = server.served[0]
        self.model_checked = False
        self.rate = MessageRate(server.limits.max_messages_per_second)
        self.send_lock = asyncio.Lock()
        self.closed = False
        self.failure: SessionEnd | None = None  # set by a task; the loop closes with it
        self.tasks: set[asyncio.Task[None]] = set()
        self.transcriber = (
            Transcriber(server.audio, self.id, self.send, self.spawn, server.limits.max_audio_bytes)
            if server.audio is not None
            else None
        )
        self.conversation = Conversation(self.engine, lambda: self.model, self.send, self.spawn)
        self.client_event_id: str | None = None

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        await self._check_url_model()
        created = {"id": self.id, "created": int(time.time()), "session": self.session_json()}
        await self.send("session.created", created)
        receiving: asyncio.Task[Any] | None = None
        last_active = time.monotonic()
        try:
            while True:
                if receiving is None:
                    receiving = asyncio.ensure_future(self.websocket.receive())
                await asyncio.wait({receiving}, timeout=0.5)
                if self.failure is not None:
                    raise self.failure
                if not receiving.done():
                    if self.busy:
                        last_active = time.monotonic()
                    elif time.monotonic() - last_active > self.server.limits.idle_timeout:
                        raise SessionEnd(
                            NORMAL_CLOSURE,
                            f"idle for {self.server.limits.idle_timeout:g} s",
                            "idle_timeout",
                        )
                    continue
                message = receiving.result()
                receiving = None
                last_active = time.monotonic()
                if message["type"] == "websocket.disconnect":
                    return
                if not self.rate.allow():
                    raise SessionEnd(
                        POLICY_VIOLATION,
                        f"more than {self.server.limits.max_messages_per_second:g} events "
                        "per second",
                        "rate_limit_exceeded",
                    )
                await self.on_message(message)
        except SessionEnd as end:
            await self.end(end)
        except WebSocketDisconnect:
            pass
        finally:
            self.closed = True
            if receiving is not None:
                receiving.cancel()
            for task in list(self.tasks):
                task.cancel()  # aborts their engine requests
            await asyncio.gather(*self.tasks, return_exceptions=True)

    @property
    def busy(self) -> bool:
        return any(not task.done() for task in self.tasks)

    async def end(self, end: SessionEnd) -> None:
        if end.error_code is not None:
            await self.send_error(end.reason, end.error_code)
        self.closed = True
        if self.websocket.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):  # the client may be gone already
                await self.websocket.close(end.code, end.reason[:120])

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `work` as a task of this session: its failure is reported here."""
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled() or task.exception() is None or self.closed:
            return
        error = task.exception()
        if isinstance(error, EngineDeadError | EngineUnavailableError):
            self.failure = SessionEnd(INTERNAL_ERROR, str(error)[:300], "processing_error")
        elif isinstance(error, ValueError):  # the engine refused the request
            asyncio.ensure_future(self.send_error(str(error)[:300], "processing_error"))
        else:
            logger.error("realtime session task failed", exc_info=error)
            self.failure = SessionEnd(INTERNAL_ERROR, "internal error", "processing_error")

    # ------------------------------------------------------------ sending

    async def send(self, kind: str, fields: dict[str, Any]) -> None:
        """Send one server event; nothing once the session is closed."""
        if self.closed and kind != "error":
            return
        event = {"type": kind, "event_id": f"event_{uuid.uuid4().hex[:24]}", **fields}
        async with self.send_lock:
            if self.websocket.application_state != WebSocketState.CONNECTED:
                return
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                await self.websocket.send_text(json.dumps(event))

    async def send_error(self, message: str, code: str) -> None:
        if self.openai_dialect:
            error = {
                "type": "invalid_request_error",
                "code": code,
                "message": message,
                "param": None,
                "event_id": self.client_event_id,
            }
            await self.send("error", {"error": error})
        else:
            await self.send("error", {"error": message, "code": code})

    # ------------------------------------------------------------ events

    async def on_message(self, message: dict[str, Any]) -> None:
        text = message.get("text")
        if text is None:
            await self.send_error("events are JSON text frames", "invalid_event")
            return
        try:
            event = json.loads(text)
        except ValueError:
            await self.send_error("Invalid JSON", "invalid_json")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            await self.send_error("an event is a JSON object with a string `type`", "invalid_event")
            return
        event_id = event.get("event_id")
        self.client_event_id = event_id if isinstance(event_id, str) else None
        try:
            await self.on_event(event)
        except EventError as e:
            await self.send_error(str(e), e.code)

    async def on_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind in ("session.update", "transcription_session.update"):
            await self.on_session_update(event)
        elif kind in TRANSCRIPTION_EVENTS:
            if self.transcriber is None:
                raise EventError(
                    f"the model `{self.model}` does not transcribe audio: it holds text "
                    "conversations (conversation.item.create, response.create)",
                    "invalid_event",
                )
            await self.on_audio_event(self.transcriber, kind, event)
        elif kind in CHAT_EVENTS:
            if "generate" not in self.engine.ready.supported_tasks:
                raise EventError(
                    f"the model `{self.model}` transcribes audio only: send "
                    "input_audio_buffer events",
                    "invalid_event",
                )
            self.openai_dialect = True
            await self.on_chat_event(kind, event)
        else:
            raise EventError(f"Unknown event type: {kind[:100]}", "unknown_event")

    async def on_session_update(self, event: dict[str, Any]) -> None:
        session = event.get("session")
        if session is not None and not isinstance(session, dict):
            raise EventError("session must be an object", "invalid_event")
        if session is not None:
            self.openai_dialect = True
        model = session_model(event)
        if model is not None:
            if not isinstance(model, str):
                raise EventError("model must be a string", "invalid_event")
            self.model = self._checked_model(model)
        language = event.get("language")
        if session is not None and language is None:
            language = transcription_option(session, "language")
        if language is not None and self.transcriber is not None:
            try:
                self.transcriber.language = self.transcriber.audio.whisper.check_language(
                    str(language)
                )
            except WhisperTokenError as e:
                raise EventError(str(e), "invalid_event") from None
        if session is not None:
            self.conversation.configure(session)
        self.model_checked = True
        if self.transcriber is not None and self.transcriber.utterance is not None:
            self.transcriber.start()  # the audio that waited for the model
        reply = "transcription_session.updated" if "transcription" in event["type"] else None
        await self.send(reply or "session.updated", {"session": self.session_json()})

    def _checked_model(self, model: str) -> str:
        try:
            return check_model(self.engine, self.server.served, model)
        except APIError:
            message = f"The model `{model[:200]}` does not exist."
            raise EventError(message, "model_not_found") from None

    async def _check_url_model(self) -> None:
        model = self.websocket.query_params.get("model")
        if model is None:
            return
        try:
            self.model = self._checked_model(model)
            self.model_checked = True
        except EventError as e:
            await self.send_error(str(e), e.code)

    def session_json(self) -> dict[str, Any]:
        language = self.transcriber.language if self.transcriber is not None else None
        return {
            "id": self.id,
            "object": "realtime.session",
            "model": self.model,
            "modalities": ["text"],
            "input_audio_format": "pcm16",
            "input_audio_transcription": (
                {"model": self.model, "language": language} if language is not None else None
            ),
            "instructions": self.conversation.instructions,
            "temperature": self.conversation.temperature,
            "max_response_output_tokens": self.conversation.max_output_tokens or "inf",
            "turn_detection": None,
        }

    # ------------------------------------------------------- transcription

    async def on_audio_event(
        self, transcriber: Transcriber, kind: str, event: dict[str, Any]
    ) -> None:
        if kind == "input_audio_buffer.append":
            transcriber.append(event.get("audio"), decode=self.model_checked)
        elif kind == "input_audio_buffer.clear":
            await transcriber.clear()
        elif not self.model_checked:
            raise EventError(
                "Model not validated. Make sure to validate the model by sending a "
                "session.update event.",
                "model_not_validated",
            )
        else:
            await transcriber.commit(event.get("final"))

    # ------------------------------------------------------------- chat

    async def on_chat_event(self, kind: str, event: dict[str, Any]) -> None:
        if kind == "conversation.item.create":
            await self.conversation.create_item(event)
        elif kind == "conversation.item.delete":
            await self.conversation.delete_item(event)
        elif kind == "response.create":
            self.conversation.create_response(event)
        elif not await self.conversation.cancel():  # response.cancel
            raise EventError("no response is in progress", "response_cancel_not_active")


def build_router(
    engine: AsyncLLM, served: list[str], limits: RealtimeLimits, audio: AudioServer | None
) -> APIRouter:
    router = APIRouter()
    server = RealtimeServer(engine, served, limits, audio)

    @router.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        await server.serve(websocket)

    return router
