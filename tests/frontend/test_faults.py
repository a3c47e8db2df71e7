"""Faults injected into real processes on loopback, and garbage on their sockets.

Each test asserts what clients see, how long until the server is healthy
again, and that nothing is left running: no child process, no request and
no KV block held in the engine (GET /stats runs the block manager's
invariant check). Figures are printed (pytest -s) for docs/reliability.md.
Elsewhere: SIGSTOP of the engine in test_stuck.py, kill -9 of a standalone
engine core mid-stream (and its restart) in test_engine_restart.py.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from pagoda.protocol.addresses import split_address
from pagoda.protocol.messages import AddRequest, Outputs, RequestDelta, UtilityResult
from pagoda.protocol.sampling_params import SamplingParams
from tests.frontend.conftest import ENGINE_FLAGS, Server
from tests.frontend.servers import (
    REPO,
    Pagoda,
    Processes,
    api_argv,
    child_pids,
    cmdline,
    free_port,
    is_gone,
    raw_exchange,
    start_pagoda,
    wait_healthy,
    wait_pagoda_healthy,
)

pytestmark = pytest.mark.slow

_STREAM = {"prompt": "Count:", "ignore_eos": True, "stream": True, "temperature": 0}


class StreamReader(threading.Thread):
    """Reads one SSE completion stream into `lines` (arrival time, line)."""

    def __init__(self, base: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = base + "/v1/completions"
        self.body = {**_STREAM, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
        self.lines: list[tuple[float, str]] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append((time.monotonic(), line))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def wait_generating(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.lines) < 2:
            assert time.monotonic() < deadline and self.is_alive(), (self.lines, self.error)
            time.sleep(0.05)

    def completion_tokens(self) -> int:
        """The usage of a stream that ended normally (asserts it did)."""
        assert self.error is None and self.lines[-1][1] == "data: [DONE]", self.lines[-3:]
        usage = msgspec.json.decode(self.lines[-2][1].removeprefix("data: "))["usage"]
        return int(usage["completion_tokens"])


def _idle_engine(base: str, timeout: float = 15) -> dict[str, Any]:
    """Wait until the engine holds no request and no KV block; its stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats: dict[str, Any] = httpx.get(base + "/stats", timeout=10).json()
        if stats["num_running"] == stats["num_waiting"] == stats["num_used_blocks"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def _completion_works(base: str) -> None:
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text[:300]


# ------------------------------------------------------------ kill -9 of processes


def test_killed_api_server_among_two_leaves_the_other_intact(server: Server) -> None:
    procs = Processes()
    port = free_port()
    doomed = procs.start(api_argv(server.address, port), "api-doomed")
    doomed_base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(doomed_base, procs, timeout=60)
        survivor = StreamReader(server.base_url, max_tokens=32)
        victim = StreamReader(doomed_base, max_tokens=900)
        survivor.wait_generating()
        victim.wait_generating()
        os.kill(doomed.pid, signal.SIGKILL)
        killed = time.monotonic()
        # The engine aborts the dead server's request once its heartbeats
        # have been missing for 5 s: running drops to what the survivor has.
        while True:
            stats = httpx.get(server.base_url + "/stats", timeout=10).json()
            if stats["num_running"] + stats["num_waiting"] <= int(survivor.is_alive()):
                break
            assert time.monotonic() - killed < 15, stats
            time.sleep(0.1)
        print(f"engine dropped the killed API server's request {time.monotonic() - killed:.1f} s")
        survivor.join(timeout=120)
        assert survivor.completion_tokens() == 32  # intact, to the last token
        _idle_engine(server.base_url)
        _completion_works(server.base_url)
        assert procs.stop() == [-signal.SIGKILL]
    finally:
        procs.stop()


def _unavailable_count(server: Server) -> int:
    return server.procs.logs[1].read_text(errors="replace").count("engine core unavailable")


def test_an_idle_api_server_keeps_hearing_an_engine_busy_for_another(server: Server) -> None:
    # The engine heartbeats every quiet frontend even while its output queue
    # is busy with another one's stream; it used to heartbeat only when the
    # whole queue was quiet, so an idle API server declared it dead after 5 s.
    procs = Processes()
    port = free_port()
    busy_base = f"http://127.0.0.1:{port}"
    procs.start(api_argv(server.address, port), "api-busy")
    try:
        wait_healthy(busy_base, procs, timeout=60)
        before = _unavailable_count(server)
        body = {**_STREAM, "max_tokens": 900}
        with httpx.stream("POST", busy_base + "/v1/completions", json=body, timeout=60) as r:
            started = time.monotonic()
            for line in r.iter_lines():
                assert '"error"' not in line, line
                if time.monotonic() - started > 7.0:  # past the 5 s silence limit
                    break
        # Not polled meanwhile: a poll is itself a word from the engine.
        assert _unavailable_count(server) == before
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        _idle_engine(server.base_url)  # the closed stream was aborted
        assert procs.stop() == [0]
    finally:
        procs.stop()


def _engine_and_api_pids(pagoda_pid: int) -> tuple[int, list[int]]:
    children = child_pids(pagoda_pid)
    engine = [pid for pid in children if cmdline(pid)[0] == "pagoda::engine-core"]
    assert len(engine) == 1, children
    return engine[0], [pid for pid in children if pid != engine[0]]


def _wait_exit(pagoda: Pagoda, since: float, timeout: float = 60) -> tuple[int, str, float]:
    """pagoda's exit code, its output, and seconds from `since` to its exit."""
    code = pagoda.proc.wait(timeout=timeout)
    return code, pagoda.output(), time.monotonic() - since


def test_pagoda_serve_engine_killed_mid_stream() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pagoda = start_pagoda(port, ENGINE_FLAGS)
    proc = pagoda.proc
    try:
        wait_pagoda_healthy(base, pagoda)
        engine, api_servers = _engine_and_api_pids(proc.pid)
        runtime_dir = Path(cmdline(engine)[cmdline(engine).index("--address") + 1][6:]).parent
        stream = StreamReader(base, max_tokens=900)
        stream.wait_generating()
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        stream.join(timeout=10)
        # The client sees an error event at once, then [DONE].
        assert stream.lines[-1][1] == "data: [DONE]", stream.lines[-2:]
        assert '"error"' in stream.lines[-2][1] and "engine core" in stream.lines[-2][1]
        assert stream.lines[-2][0] - killed < 2.0
        # pagoda stops the API server and exits non-zero, naming the child.
        code, log, took = _wait_exit(pagoda, killed)
        print(f"pagoda exited {took:.1f} s after the engine core was killed")
        assert code == 1
        assert "pagoda: engine-core was killed by SIGKILL; stopping the others" in log
        assert all(is_gone(pid) for pid in [engine, *api_servers])
        assert not runtime_dir.exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_runtime_dir_deleted_then_api_server_killed_under_pagoda_serve() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pagoda = start_pagoda(port, ENGINE_FLAGS, "--api-server-count", "2")
    proc = pagoda.proc
    late = Processes()
    try:
        wait_pagoda_healthy(base, pagoda)
        engine, api_servers = _engine_and_api_pids(proc.pid)
        address = cmdline(engine)[cmdline(engine).index("--address") + 1]
        runtime_dir = Path(address[len("ipc://") :]).parent
        stream = StreamReader(base, max_tokens=24)
        stream.wait_generating()
        shutil.rmtree(runtime_dir)
        # Attached API servers keep their connections: serving goes on.
        stream.join(timeout=120)
        assert stream.completion_tokens() == 24
        for _ in range(4):  # over both API servers (one shared port)
            _completion_works(base)
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        # A newly started API server finds no socket to connect to.
        late_api = late.start(api_argv(address, free_port(), "--engine-timeout", "3"), "api-late")
        assert late_api.wait(timeout=60) == 3
        assert "no engine core answered" in late.tail()
        # kill -9 of one API server: pagoda stops the rest (the engine's
        # shutdown must cope with its sockets' directory gone) and exits 1.
        os.kill(api_servers[0], signal.SIGKILL)
        killed = time.monotonic()
        code, log, took = _wait_exit(pagoda, killed)
        print(f"pagoda exited {took:.1f} s after an API server was killed")
        assert code == 1, log
        assert "pagoda: api-server 0 was killed by SIGKILL; stopping the others" in log
        assert "Traceback" not in log, log
        assert "did not stop in time" not in log, log
        assert all(is_gone(pid) for pid in [engine, *api_servers])
    finally:
        late.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------- garbage on the HTTP port


def _tls_client_hello() -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="pagoda.test")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


# Header deadline of the API server (frontend/http_protocol.py), default 10 s.
_HEADER_TIMEOUT_S = 10.0


def test_http_garbage_gets_4xx_or_a_closed_connection(server: Server) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    huge_headers = b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 1000) for i in range(200))
    one_mb_header = b"GET /health HTTP/1.1\r\nX: " + b"a" * (1 << 20) + b"\r\n\r\n"
    h2_preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    cases: dict[str, tuple[list[bytes], float, bytes]] = {
        "random bytes": ([os.urandom(4096).replace(b"\n", b"")], 0.0, b"400|408"),
        "half a request": (
            [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"],
            0.0,
            b"408",
        ),
        "huge headers": ([b"GET /health HTTP/1.1\r\nHost: x\r\n" + huge_headers], 0.0, b"400"),
        "1 MB header": ([one_mb_header], 0.0, b"400"),
        "trickled headers": ([bytes([b]) for b in b"GET /health HTTP/1.1\r\nX: y"], 0.5, b"408"),
        "HTTP/2 preface": ([h2_preface], 0.0, b"404"),
        "TLS ClientHello": ([_tls_client_hello()], 0.0, b"400"),
        "closed mid-line": ([b"GET /heal"], -1.0, b""),
    }
    results: dict[str, tuple[bytes, float]] = {}

    def run(name: str, parts: list[bytes], delay: float) -> None:
        started = time.monotonic()
        if delay < 0:  # send and close at once, read nothing
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(parts[0])
            results[name] = (b"", 0.0)
            return
        results[name] = (raw_exchange(port, parts, delay), time.monotonic() - started)

    threads = [
        threading.Thread(target=run, args=(name, parts, delay))
        for name, (parts, delay, _) in cases.items()
    ]
    for t in threads:
        t.start()
    # The server keeps serving while the slow ones hold their connections.
    _completion_works(server.base_url)
    for t in threads:
        t.join(timeout=_HEADER_TIMEOUT_S + 30)
    for name, (_, _, expected) in cases.items():
        reply, took = results[name]
        status_line = reply.split(b"\r\n", 1)[0]
        print(f"{name}: {status_line.decode(errors='replace')!r} after {took:.1f} s")
        # h11 refuses some bytes at once (400); others wait for a line end (408).
        assert any(code in status_line for code in expected.split(b"|")), (name, reply[:200])
        assert took < _HEADER_TIMEOUT_S + 10, (name, took)
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    _completion_works(server.base_url)


# ------------------------------------------ garbage on the API server's output socket


class EngineProxy(threading.Thread):
    """Stands between an API server and the real engine core, and can inject.

    The API server's output socket is a DEALER that connects to the engine's
    bound ROUTER: only whoever binds the engine's address can send there. So
    the test binds its own address, relays every message both ways under the
    API server's identity, and slips garbage into the output direction.
    """

    def __init__(self, address: str, engine_address: str) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.front_in = self.ctx.socket(zmq.ROUTER)
        self.front_out = self.ctx.socket(zmq.ROUTER)
        front_in_addr, front_out_addr = split_address(address)
        self.front_in.bind(front_in_addr)
        self.front_out.bind(front_out_addr)
        self.engine_in, self.engine_out = split_address(engine_address)
        self.inject: queue.Queue[list[bytes]] = queue.Queue()
        self.identity: bytes | None = None
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front_in, zmq.POLLIN)
        back_in = back_out = None
        try:
            while not self.stopping.is_set():
                for sock, _ in poller.poll(20):
                    if sock is self.front_in:
                        identity, payload = self.front_in.recv_multipart()
                        if back_in is None:
                            self.identity = identity
                            back_in, back_out = self._connect(identity)
                            poller.register(back_out, zmq.POLLIN)
                        assert back_in is not None
                        back_in.send(payload)
                    elif sock is back_out:
                        assert self.identity is not None
                        self.front_out.send_multipart([self.identity, back_out.recv()])
                while self.identity is not None and not self.inject.empty():
                    self.front_out.send_multipart([self.identity, *self.inject.get()])
        finally:
            for s in (back_in, back_out, self.front_in, self.front_out):
                if s is not None:
                    s.close(linger=0)
            self.ctx.term()

    def _connect(self, identity: bytes) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        back_in = self.ctx.socket(zmq.DEALER)
        back_out = self.ctx.socket(zmq.DEALER)
        for sock, addr in ((back_out, self.engine_out), (back_in, self.engine_in)):
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
        return back_in, back_out

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=5)


def _output_garbage() -> list[list[bytes]]:
    """Frames no engine sends: each must be dropped with a log line."""
    enc = msgspec.msgpack.Encoder()
    outputs = enc.encode(Outputs([RequestDelta("x", [1, 2, 3])], None, time.time()))
    return [
        [b""],
        [os.urandom(64)],
        [outputs[: len(outputs) // 2]],  # truncated
        [b"\xc1"],  # a byte msgpack never uses
        [enc.encode(AddRequest("wrong-way", [1], SamplingParams(), 0.0))],  # a frontend's message
        [enc.encode({"type": "outputs"})],  # the right tag, no fields
        [enc.encode({"type": "outputs", "deltas": "x", "stats": 5, "timestamp": "y"})],
        [enc.encode({"type": "no-such-message"})],
        [enc.encode([1, 2, 3])],
        [b"\x92" * 1000],  # nested arrays, truncated
        [b"\xdd\xff\xff\xff\xff"],  # an array header claiming 4 G items
        [b"x" * (32 << 20)],  # 32 MB of nothing
        [outputs, b"extra frame"],  # two frames: the engine always sends one
    ]


def _harmless() -> list[list[bytes]]:
    """Well-formed messages about nothing this server asked for: ignored."""
    enc = msgspec.msgpack.Encoder()
    return [
        [enc.encode(Outputs([RequestDelta("nobody-asked", [1, 2])], None, time.time()))],
        [enc.encode(UtilityResult(987654, result="nobody called"))],
    ]


def test_garbage_on_the_api_servers_output_socket(server: Server, tmp_path: Path) -> None:
    proxy = EngineProxy(f"ipc://{tmp_path}/proxy", server.address)
    procs = Processes()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs.start(api_argv(f"ipc://{tmp_path}/proxy", port), "api-proxied")
    try:
        wait_healthy(base, procs, timeout=60)
        stream = StreamReader(base, max_tokens=24)
        stream.wait_generating()
        garbage = _output_garbage()
        for frames in garbage + _harmless():
            proxy.inject.put(frames)
        # The stream goes on to its last token through the garbage.
        stream.join(timeout=120)
        assert stream.completion_tokens() == 24
        log = procs.logs[0]
        deadline = time.monotonic() + 10
        while log.read_text(errors="replace").count("dropped") < len(garbage):
            assert time.monotonic() < deadline, procs.tail()
            time.sleep(0.2)
        assert log.read_text(errors="replace").count("dropped") == len(garbage)
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        _completion_works(base)
        _idle_engine(base)
        assert procs.stop() == [0]  # and it still shuts down cleanly
    finally:
        procs.stop()
        proxy.stop()


# ------------------------------------------------------------ pagoda itself killed


_PARENT = """
import subprocess, sys, time
from pagoda.frontend.pagoda_cli import die_with_parent
child = subprocess.Popen(["sleep", "120"], preexec_fn=die_with_parent())
print(child.pid, flush=True)
time.sleep(120)
"""


def test_children_of_a_killed_pagoda_do_not_outlive_it() -> None:
    # pagoda serve starts its engine core and API servers with die_with_parent():
    # kill -9 of pagoda itself must not leave them running (here with `sleep`
    # as the child, so that no model has to load).
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], cwd=REPO, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not is_gone(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while not is_gone(child):
            assert time.monotonic() < deadline, "the child outlived its killed parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)


def test_client_leaving_mid_body_is_not_an_error(server: Server) -> None:
    """A body cut short (the client left, or the body deadline closed the
    connection) ends the request quietly: no traceback, nothing else hurt."""
    port = int(server.base_url.rsplit(":", 1)[1])
    api_log = server.procs.logs[1]
    before = api_log.read_text(errors="replace").count("Traceback")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n"
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(head + b'{"messages": [')
            time.sleep(0.2)
    _completion_works(server.base_url)
    time.sleep(0.5)
    assert api_log.read_text(errors="replace").count("Traceback") == before
