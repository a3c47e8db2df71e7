"""Start and stop real engine-core and api-server processes for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def raw_exchange(port: int, parts: list[bytes], delay: float = 0.0, until: bytes = b"") -> bytes:
    """Send `parts` on a raw connection (with `delay` after each); what came
    back before the server closed it, or as soon as the reply holds `until`."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            for part in parts:
                s.sendall(part)
                time.sleep(delay)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed first: what it said is still readable
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
                if until and until in data:
                    break  # a complete answer on a keep-alive connection
        except ConnectionResetError:
            pass
        return data


def free_port(avoid: tuple[int, ...] = ()) -> int:
    """A loopback port free now, other than those in `avoid` (ports chosen
    for processes that have not bound them yet)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port


def engine_tcp_ports() -> tuple[int, int]:
    """(engine port, HTTP port): a TCP engine binds its port and the next
    one, so both must be free, and the API server's port must be neither."""
    while True:
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port, free_port(avoid=(port, port + 1))


@dataclass
class Processes:
    """A set of child processes started by a test, stopped together."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def start(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        log = Path(tempfile.mkstemp(prefix=f"pagoda-{name}-", suffix=".log")[1])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
            )
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def stop(self) -> list[int | None]:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=20))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes.append(proc.wait())
        return codes

    def tail(self, n: int = 40) -> str:
        out = []
        for log in self.logs:
            lines = log.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(out)


def engine_argv(address: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pagoda.engine_core.cli", "--address", address, *extra]


def api_argv(address: str, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pagoda.frontend.cli",
        "--engine",
        address,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        *extra,
    ]


def wait_healthy(base_url: str, procs: Processes, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a server process exited early:\n{procs.tail()}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server not healthy after {timeout} s:\n{procs.tail()}")


def ipc_address() -> str:
    directory = tempfile.mkdtemp(prefix="pagoda-test-")
    return f"ipc://{directory}/engine"


@contextmanager
def private_server(
    directory: object, engine_flags: tuple[str, ...], *api_flags: str, name: str = "private"
) -> Iterator[str]:
    """An engine core and one API server of a test's own; yields the base URL."""
    procs = Processes()
    address = f"ipc://{directory}/engine"
    port = free_port()
    procs.start(engine_argv(address, *engine_flags), f"engine-{name}")
    procs.start(api_argv(address, port, *api_flags), f"api-{name}")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs)
        yield base
    finally:
        procs.stop()


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def is_gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def cmdline(pid: int) -> list[str]:
    """A process's command line as words: Pagoda's processes show their role
    first (their process title), then their flags, in one string."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().replace("\0", " ").split()


@dataclass
class Pagoda:
    """A `pagoda serve` process; its children's output and its own go to `log`."""

    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_pagoda(port: int, engine_flags: tuple[str, ...], *extra: str) -> Pagoda:
    """`pagoda serve` in its own session (a file, not a pipe, so that no child blocks)."""
    argv = [sys.executable, "-m", "pagoda.frontend.pagoda_cli", "serve", "--port", str(port)]
    log = Path(tempfile.mkstemp(prefix="pagoda-serve-", suffix=".log")[1])
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*argv, *engine_flags, *extra],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Pagoda(proc, log)


def wait_pagoda_healthy(base: str, pagoda: Pagoda, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pagoda.proc.poll() is not None:
            raise RuntimeError(pagoda.output()[-3000:])
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("pagoda serve did not become healthy")
