"""Clients of an engine core: in-process (offline SDK) and over ZeroMQ (servers).

Both speak the same messages (protocol/): add requests, abort them, call
utilities, receive per-request deltas. The in-process client steps the
engine itself; the ZeroMQ client attaches to a running `engine-core`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagoda.protocol.addresses import split_address
from pagoda.protocol.control import CONTROL_CALLS, timeout_of
from pagoda.protocol.curve import secure_client
from pagoda.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    EngineDead,
    Heartbeat,
    Hello,
    Outputs,
    Ready,
    RequestDelta,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
    make_frontend_codec,
)

if TYPE_CHECKING:
    from pagoda.engine_core.config import EngineConfig

logger = logging.getLogger(__name__)


HEARTBEAT_INTERVAL_S = 0.5
# The engine's output thread speaks at least every 0.5 s, even mid-step. A
# dead engine process is noticed at once (the socket monitor sees the
# connection drop); this silence limit only catches a hung or unreachable
# one, and is generous so that a starved but live engine is not declared dead.
ENGINE_SILENCE_LIMIT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine core went away or never answered."""


class UtilityError(RuntimeError):
    """An engine utility call failed; `kind` says how (see UtilityResult.error_kind)."""

    def __init__(self, message: str, kind: str | None) -> None:
        super().__init__(message)
        self.kind = kind or "failed"


class InprocClient:
    """Runs an EngineCore inside this process (used by the offline LLM)."""

    def __init__(self, config: EngineConfig) -> None:
        from pagoda.engine_core.core.engine import EngineCore  # torch lives behind this import

        self.engine = EngineCore(config)
        self.ready = self.engine.ready_message()
        self._pending_errors: list[RequestDelta] = []

    def add_request(self, request: AddRequest) -> None:
        error = self.engine.add_request(request)
        if error is not None:
            self._pending_errors.append(error)

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)

    def has_work(self) -> bool:
        return bool(self._pending_errors) or self.engine.has_work()

    def get_outputs(self) -> list[RequestDelta]:
        """Run one engine step; the deltas it produced."""
        deltas, self._pending_errors = self._pending_errors, []
        deltas += [delta for _, delta in self.engine.step()]
        return deltas

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a control call of protocol/control.py on the engine; ValueError if refused."""
        call = CONTROL_CALLS.get(method)
        if call is None or call.on_server:
            raise ValueError(f"unknown utility method {method!r}")
        args_, kwargs_ = call.bind(args, kwargs)
        return getattr(self.engine, method)(*args_, **kwargs_)


class AsyncMPClient:
    """An asyncio client of an engine-core process over ZeroMQ.

    Deltas are routed to per-request callbacks registered by add_request;
    everything runs on the event loop thread.
    """

    def __init__(
        self, address: str, client_id: str | None = None, curve_dir: str | None = None
    ) -> None:
        self.address = address
        self.curve_dir = curve_dir  # CURVE keys for a tcp engine (engine_core/curve.py)
        self.client_id = client_id or f"fe-{uuid.uuid4().hex[:12]}"
        self.ready: Ready | None = None
        self.stats = SchedulerStats()
        self.dead: str | None = None
        self._ctx = zmq.asyncio.Context()
        self._encoder, self._decoder = make_frontend_codec()
        self._handlers: dict[str, Callable[[RequestDelta | None], None]] = {}
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._in_sock: zmq.asyncio.Socket | None = None
        self._out_sock: zmq.asyncio.Socket | None = None
        self.last_output_time = time.monotonic()
        # Requests failed while the engine was silent, not yet aborted there: a
        # stopped (SIGSTOP) or starved engine that wakes up would otherwise run
        # them to max_tokens for nobody, holding their KV blocks.
        self._orphaned: list[str] = []

    async def start(self, timeout: float = 60.0) -> Ready:
        """Connect and handshake; raises EngineDeadError if nobody answers."""
        in_addr, out_addr = split_address(self.address)
        identity = self.client_id.encode()
        self._out_sock = self._ctx.socket(zmq.DEALER)
        self._out_sock.setsockopt(zmq.IDENTITY, identity)
        self._out_sock.setsockopt(zmq.LINGER, 0)
        if self.curve_dir is not None:
            secure_client([self._out_sock], self.curve_dir)
        self._out_sock.connect(out_addr)
        self._in_sock = self._ctx.socket(zmq.DEALER)
        self._in_sock.setsockopt(zmq.IDENTITY, identity)
        self._in_sock.setsockopt(zmq.LINGER, 0)
        # Queue only to a live connection, so that a send to a dead engine
        # fails at once instead of waiting forever.
        self._in_sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.curve_dir is not None:
            secure_client([self._in_sock], self.curve_dir)
        self._in_sock.connect(in_addr)
        ready_future: asyncio.Future[Ready] = asyncio.get_running_loop().create_future()
        self._tasks.append(asyncio.create_task(self._output_loop(ready_future)))
        deadline = time.monotonic() + timeout
        # The engine may still be loading: repeat Hello until it answers.
        while not ready_future.done():
            try:
                await self._send(Hello(self.client_id, PROTOCOL_VERSION))
            except EngineDeadError:
                pass  # not listening yet
            try:
                await asyncio.wait_for(asyncio.shield(ready_future), timeout=1.0)
            except TimeoutError:
                if time.monotonic() > deadline:
                    await self.close()
                    raise EngineDeadError(f"no engine core answered at {self.address}") from None
        ready = ready_future.result()
        if ready.error:
            await self.close()
            raise EngineDeadError(ready.error)
        self.ready = ready
        self.last_output_time = time.monotonic()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
        self._tasks.append(asyncio.create_task(self._monitor_loop()))
        return ready

    async def _monitor_loop(self) -> None:
        """Fail in-flight work the moment the engine's connection drops (kill -9)."""
        assert self._out_sock is not None
        monitor = self._out_sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and self.dead is None:
                    self._fail_all(f"the engine core at {self.address} disconnected")
        except (zmq.ZMQError, asyncio.CancelledError):
            pass
        finally:
            try:
                self._out_sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)

    def _on_ready(self, ready: Ready) -> None:
        """A Ready after the engine died: an engine core is back at the address."""
        if self.dead is None or self.ready is None:
            return
        old = self.ready
        same = (
            ready.error is None
            and ready.model_path == old.model_path
            and ready.tokenizer_path == old.tokenizer_path
            and ready.vocab_size == old.vocab_size
            and ready.max_model_len == old.max_model_len
            and ready.block_size == old.block_size
        )
        if not same:
            self.dead = (
                f"the engine core at {self.address} came back with a different model or "
                f"settings ({ready.error or ready.model_path}); restart this API server"
            )
            logger.error("%s", self.dead)
            return
        logger.info("engine core %s is back at %s: serving again", ready.engine_id, self.address)
        self.ready = ready
        self.stats = SchedulerStats()
        self.last_output_time = time.monotonic()
        self.dead = None

    async def _send(self, msg: msgspec.Struct) -> None:
        assert self._in_sock is not None
        try:
            await self._in_sock.send(self._encoder.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineDeadError(f"the engine core at {self.address} is unreachable") from None

    async def add_request(
        self, request: AddRequest, handler: Callable[[RequestDelta | None], None]
    ) -> None:
        """Send a request; `handler` gets its deltas (None if the engine died)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._handlers[request.request_id] = handler
        await self._send(request)

    def forget(self, request_id: str) -> None:
        self._handlers.pop(request_id, None)

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._handlers.pop(request_id, None)
        if self.dead is None and request_ids:
            await self._send(Abort(list(request_ids)))

    async def call_utility(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Call an engine utility (protocol/control.py; `timeout` defaults to the
        call's own); raises UtilityError, EngineDeadError or TimeoutError."""
        if timeout is None:
            timeout = timeout_of(method)
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        try:
            await self._send(UtilityCall(call_id, method, list(args), dict(kwargs or {})))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._utility_futures.pop(call_id, None)

    async def _output_loop(self, ready_future: asyncio.Future[Ready]) -> None:
        assert self._out_sock is not None
        while True:
            try:
                frames = await self._out_sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            # The engine sends one frame per message; anything else is not its.
            if len(frames) != 1:
                logger.warning("dropped a message with %d frames from the engine", len(frames))
                continue
            try:
                msg = self._decoder.decode(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("dropped an undecodable message from the engine: %s", e)
                continue
            self.last_output_time = time.monotonic()
            if isinstance(msg, Outputs):
                if msg.stats is not None:
                    self.stats = msg.stats
                for delta in msg.deltas:
                    handler = self._handlers.get(delta.request_id)
                    if handler is not None:
                        if delta.finish_reason is not None:
                            del self._handlers[delta.request_id]
                        handler(delta)
            elif isinstance(msg, UtilityResult):
                future = self._utility_futures.get(msg.call_id)
                if future is not None and not future.done():
                    if msg.error is not None:
                        future.set_exception(UtilityError(msg.error, msg.error_kind))
                    else:
                        future.set_result(msg.result)
            elif isinstance(msg, Ready):
                if not ready_future.done():
                    ready_future.set_result(msg)
                else:
                    self._on_ready(msg)
            elif isinstance(msg, EngineDead):
                self._fail_all(msg.reason)

    async def _heartbeat_loop(self) -> None:
        """Send our heartbeats; declare the engine dead when its stop coming.

        While the engine is dead, say Hello instead: an engine core started
        again at the same address answers Ready and serving resumes.
        """
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            if self._orphaned:
                try:
                    # Ahead of the Hello: an engine that was only stopped reads
                    # this first when it resumes.
                    await self._send(Abort(self._orphaned))
                    self._orphaned = []
                except (EngineDeadError, zmq.ZMQError):
                    pass  # gone for good; a new engine never heard of them
            if self.dead is not None:
                message: msgspec.Struct = Hello(self.client_id, PROTOCOL_VERSION)
            else:
                silent = time.monotonic() - self.last_output_time
                if silent > ENGINE_SILENCE_LIMIT_S:
                    self._fail_all(f"no word from the engine core for {silent:.1f} s")
                    continue
                message = Heartbeat(self.client_id)
            try:
                await self._send(message)
            except (EngineDeadError, zmq.ZMQError):
                pass  # not connected (yet): the silence check or the next Hello decides

    def _fail_all(self, reason: str) -> None:
        self.dead = reason
        handlers, self._handlers = self._handlers, {}
        logger.warning("engine core unavailable (%s): failed %d requests", reason, len(handlers))
        self._orphaned.extend(handlers)
        for handler in handlers.values():
            handler(None)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._tasks = []
        for sock in (self._in_sock, self._out_sock):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
