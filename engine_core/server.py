"""EngineCoreServer: the engine core as a process that frontends talk to.

Two ROUTER sockets: requests come in on one, outputs go out on the other,
addressed by the sending frontend's identity. An input thread decodes
messages into a queue and an output thread encodes and sends, so the busy
loop does no socket I/O and no (de)serialization of its own:

    while running:
        drain the input queue (block on it when there is nothing to do)
        deltas = engine.step()              # schedule → execute → update
        output queue ← deltas grouped by client, one message per client
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.core.engine_utilities import EngineBusyError
from pagoda.engine_core.core.lora_manager import LoRAError
from pagoda.engine_core.executor import ExecutorError
from pagoda.protocol.addresses import split_address
from pagoda.protocol.control import CONTROL_CALLS
from pagoda.protocol.curve import bind_address, secure_server
from pagoda.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    EngineDead,
    EngineMessage,
    Heartbeat,
    Hello,
    Outputs,
    RequestDelta,
    UtilityCall,
    UtilityResult,
    make_engine_codec,
)

logger = logging.getLogger(__name__)

# How long the output thread retries a handshake reply while a frontend's
# output socket is still connecting.
_READY_RETRY_S = 5.0
# An idle engine sends each frontend a heartbeat this often; frontends take
# a few missed ones as the engine's death.
HEARTBEAT_INTERVAL_S = 0.5
# An idle engine in lockstep with others: how long it waits for input between
# its checks whether another engine has work.
LOCKSTEP_IDLE_WAIT_S = 0.01
# A frontend silent this long is taken for dead and its requests are aborted.
CLIENT_SILENCE_LIMIT_S = 5.0


class EngineCoreServer:
    """Runs an EngineCore behind ZeroMQ sockets until stopped."""

    def __init__(self, engine: EngineCore, address: str, curve_dir: str | None = None) -> None:
        self.engine = engine
        # tcp without CURVE keys binds to loopback only (curve.bind_address).
        address = bind_address(address, curve_dir)
        self.address = address
        self.input_queue: queue.Queue[tuple[bytes, object]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[bytes, EngineMessage] | None] = queue.Queue()
        self.stop_event = threading.Event()
        self._dead_reason = "engine core is shutting down"
        self.clients: set[bytes] = set()
        # When each frontend last spoke (its heartbeats arrive every 0.5 s).
        self.last_seen: dict[bytes, float] = {}
        self._next_liveness_check = 0.0
        self._ctx = zmq.Context()
        in_addr, out_addr = split_address(address)
        self._in_sock = self._ctx.socket(zmq.ROUTER)
        self._out_sock = self._ctx.socket(zmq.ROUTER)
        self._out_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._auth = None
        if curve_dir is not None:
            self._auth = secure_server(self._ctx, [self._in_sock, self._out_sock], curve_dir)
        self._in_sock.bind(in_addr)
        self._out_sock.bind(out_addr)
        self._threads = [
            threading.Thread(target=self._input_loop, name="engine-input", daemon=True),
            threading.Thread(target=self._output_loop, name="engine-output", daemon=True),
        ]
        # One handler per control call of protocol/control.py: EngineCore's
        # method of that name, or this server's own answer.
        own: dict[str, Callable[..., Any]] = {
            "ping": lambda: "pong",
            "echo": lambda *args, **kwargs: {"args": list(args), "kwargs": kwargs},
        }
        self._utilities: dict[str, Callable[..., Any]] = {
            name: own[name] if call.on_server else getattr(engine, name)
            for name, call in CONTROL_CALLS.items()
        }

    # ------------------------------------------------------------ busy loop

    def run(self) -> int:
        """Serve until stopped (0), or until the workers fail (1: the clients
        are told why, and the reason is logged naming the rank)."""
        for thread in self._threads:
            thread.start()
        # In lockstep with other engines (experts split over them) an idle engine
        # checks often whether another has work, since none steps without it.
        lockstep = self.engine.lockstep
        wait = LOCKSTEP_IDLE_WAIT_S if lockstep else 0.5
        try:
            while not self.stop_event.is_set():
                self._drain_inputs(block=not self.engine.has_work(), timeout=wait)
                self._drop_silent_clients()
                if not (self.engine.any_engine_busy() if lockstep else self.engine.has_work()):
                    self.engine.executor.check_health()
                    self.engine.release_kv_holds()
                    continue
                self._send_deltas(self.engine.step())
        except ExecutorError as e:
            logger.error("engine core failed: %s", e)
            self._dead_reason = f"engine core failed: {e}"
            return 1
        except RuntimeError as e:
            if not lockstep:
                raise
            # A collective with the other expert-parallel engines failed: one of
            # them is gone, and no step can run without it.
            logger.error("an expert-parallel engine failed: %s", e)
            self._dead_reason = f"an expert-parallel engine failed: {e}"
            return 1
        finally:
            self._shutdown()
        return 0

    def stop(self) -> None:
        self.stop_event.set()

    def _drain_inputs(self, block: bool, timeout: float = 0.5) -> None:
        try:
            if block:
                identity, msg = self.input_queue.get(timeout=timeout)
                self._handle(identity, msg)
            while True:
                identity, msg = self.input_queue.get_nowait()
                self._handle(identity, msg)
        except queue.Empty:
            pass

    def _drop_silent_clients(self) -> None:
        """Abort the requests of frontends whose heartbeats stopped (crashed, killed)."""
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + 1.0
        for identity, seen in list(self.last_seen.items()):
            if now - seen > CLIENT_SILENCE_LIMIT_S:
                client_id = identity.decode(errors="replace")
                aborted = self.engine.abort_client(client_id)
                logger.warning(
                    "frontend %s silent for %.1f s: aborted its %d requests",
                    client_id,
                    now - seen,
                    aborted,
                )
                del self.last_seen[identity]
                self.clients.discard(identity)

    def _handle(self, identity: bytes, msg: object) -> None:
        client_id = identity.decode(errors="replace")
        self.last_seen[identity] = time.monotonic()
        if isinstance(msg, AddRequest):
            error = self.engine.add_request(msg, client_id)
            if error is not None:
                self.output_queue.put(
                    (identity, Outputs([error], self.engine.stats(), time.time()))
                )
        elif isinstance(msg, Abort):
            self.engine.abort_requests(msg.request_ids)
        elif isinstance(msg, UtilityCall):
            self.output_queue.put((identity, self._call_utility(msg)))
        elif isinstance(msg, Hello):
            self.clients.add(identity)
            ready = self.engine.ready_message()
            if msg.protocol_version != PROTOCOL_VERSION:
                ready.error = (
                    f"protocol version mismatch: engine speaks {PROTOCOL_VERSION}, "
                    f"frontend {msg.protocol_version}"
                )
            self.output_queue.put((identity, ready))
        elif isinstance(msg, Heartbeat):
            pass

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        control = CONTROL_CALLS.get(call.method)
        if control is None:
            return UtilityResult(
                call.call_id,
                error=f"unknown utility method {call.method!r}",
                error_kind="unknown_method",
            )
        method = self._utilities[call.method]
        try:
            args, kwargs = control.bind(call.args, call.kwargs)
            return UtilityResult(call.call_id, result=method(*args, **kwargs))
        except EngineBusyError as e:
            return UtilityResult(call.call_id, error=str(e), error_kind="busy")
        except LoRAError as e:  # not_found / invalid / busy
            return UtilityResult(call.call_id, error=str(e), error_kind=e.kind)
        except (ValueError, TypeError) as e:  # bad arguments: the caller's mistake
            return UtilityResult(call.call_id, error=str(e), error_kind="invalid")
        except Exception as e:  # noqa: BLE001 - reported to the caller, engine keeps going
            logger.exception("utility call %s failed", call.method)
            return UtilityResult(
                call.call_id, error=f"{type(e).__name__}: {e}", error_kind="failed"
            )

    def _send_deltas(self, deltas: list) -> None:
        if not deltas:
            return
        by_client: dict[str, list[RequestDelta]] = defaultdict(list)
        for request, delta in deltas:
            by_client[request.client_id].append(delta)
        stats = self.engine.stats()
        now = time.time()
        for client_id, client_deltas in by_client.items():
            self.output_queue.put((client_id.encode(), Outputs(client_deltas, stats, now)))

    # -------------------------------------------------------------- threads

    def _input_loop(self) -> None:
        _, decoder = make_engine_codec()
        poller = zmq.Poller()
        poller.register(self._in_sock, zmq.POLLIN)
        while not self.stop_event.is_set():
            if not poller.poll(200):
                continue
            frames = self._in_sock.recv_multipart(copy=True)
            if len(frames) != 2:
                logger.warning("dropped a message with %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                msg = decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("dropped an undecodable message from %r: %s", identity[:64], e)
                continue
            self.input_queue.put((identity, msg))

    def _output_loop(self) -> None:
        encoder, _ = make_engine_codec()
        # When each frontend was last sent anything. Heartbeats go to every
        # frontend quiet for HEARTBEAT_INTERVAL_S, also while the queue is busy
        # with another frontend's outputs: an idle API server must not take an
        # engine that streams for others for dead.
        last_sent: dict[bytes, float] = {}
        next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL_S
        while True:
            item: tuple[bytes, EngineMessage] | None | bool
            try:
                item = self.output_queue.get(timeout=HEARTBEAT_INTERVAL_S / 2)
            except queue.Empty:
                item = False  # nothing queued: only heartbeats, if due
            now = time.monotonic()
            if now >= next_heartbeat:
                next_heartbeat = now + HEARTBEAT_INTERVAL_S / 2
                quiet = [
                    identity
                    for identity in list(self.clients)
                    if now - last_sent.get(identity, 0.0) >= HEARTBEAT_INTERVAL_S
                ]
                if quiet:
                    # Tell these frontends that this process lives (and how
                    # loaded it is), even while a long step runs.
                    heartbeat = encoder.encode(Outputs([], self.engine.stats(), time.time()))
                    for identity in quiet:
                        self._send(identity, heartbeat, retry_s=0.0)
                        last_sent[identity] = now
                for identity in set(last_sent) - self.clients:
                    del last_sent[identity]
            if item is None:
                return
            if item is False:
                continue
            assert isinstance(item, tuple)
            identity, msg = item
            retry_s = 0.0 if isinstance(msg, Outputs) else _READY_RETRY_S
            self._send(identity, encoder.encode(msg), retry_s)
            last_sent[identity] = time.monotonic()

    def _send(self, identity: bytes, payload: bytes, retry_s: float) -> None:
        deadline = time.monotonic() + retry_s
        while True:
            try:
                self._out_sock.send_multipart([identity, payload], copy=False)
                return
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH or time.monotonic() > deadline:
                    logger.debug("frontend %r unreachable; dropped a message", identity)
                    return
                time.sleep(0.01)

    def _shutdown(self) -> None:
        for identity in self.clients:
            self.output_queue.put((identity, EngineDead(self._dead_reason)))
        self.output_queue.put(None)
        self._threads[1].join(timeout=2.0)
        self.stop_event.set()
        self._threads[0].join(timeout=2.0)
        self._in_sock.close(linger=0)
        self._out_sock.close(linger=500)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self.engine.shutdown()
        for addr in split_address(self.address):
            if addr.startswith("ipc://"):
                try:
                    os.unlink(addr[len("ipc://") :])
                except OSError:
                    pass
