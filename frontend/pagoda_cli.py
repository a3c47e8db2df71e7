"""`pagoda serve`: one engine core and N API servers, supervised together;
`pagoda run-batch`: a JSONL batch file answered offline (frontend/run_batch.py);
`pagoda bench`: the benchmarks (frontend/bench/).

If any child exits (or is killed), the others are stopped and `pagoda`
exits non-zero naming it; SIGINT or SIGTERM stops all of them. The runtime
directory `pagoda serve` made for the engine's ipc sockets is removed on exit.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from pagoda.engine_core.args import add_engine_args, engine_args_to_argv
from pagoda.frontend.api.tool_calls import TOOL_CALL_PARSERS
from pagoda.frontend.bench.cli import add_bench_args, run_bench
from pagoda.frontend.cli import add_frontend_args, frontend_args_to_argv
from pagoda.frontend.run_batch import add_run_batch_args, run_batch
from pagoda.protocol.addresses import default_ipc_address, dp_addresses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(ns: argparse.Namespace) -> int:
    address = ns.address or default_ipc_address()
    # A runtime directory made here is ours to remove; one named by --address is not.
    runtime_dir = None if ns.address else os.path.dirname(address[len("ipc://") :])
    python = sys.executable
    engines: list[tuple[str, subprocess.Popen[bytes]]] = []
    api_servers: list[tuple[str, subprocess.Popen[bytes]]] = []
    addresses = dp_addresses(address, ns.data_parallel_size)
    engine_flags = engine_args_to_argv(ns)
    if ns.curve_keys:
        engine_flags += ["--curve-keys", ns.curve_keys]
    if ns.data_parallel_size > 1 and ns.num_threads is None:
        # The engines share the cores rather than each claiming all of them.
        threads = max(1, (os.cpu_count() or 1) // ns.data_parallel_size)
        engine_flags += ["--num-threads", str(threads)]
    ep_port = _free_port() if ns.enable_expert_parallel and len(addresses) > 1 else 0
    for i, engine_address in enumerate(addresses):
        engine_argv = [
            python,
            "-m",
            "pagoda.engine_core.cli",
            "--address",
            engine_address,
            *engine_flags,
        ]
        if len(addresses) > 1:
            engine_argv += ["--data-parallel-rank", str(i)]
        if len(addresses) > 1 and ns.enable_expert_parallel:
            # The experts are split over the engines, which meet here.
            engine_argv += [
                "--data-parallel-size",
                str(len(addresses)),
                "--data-parallel-address",
                "127.0.0.1",
                "--data-parallel-rpc-port",
                str(ep_port),
            ]
        # Elastic scaling names every engine by its rank (the supervisor's names).
        single = len(addresses) == 1 and not ns.enable_elastic_ep
        name = "engine-core" if single else f"engine-core {i}"
        engines.append((name, subprocess.Popen(engine_argv, preexec_fn=die_with_parent())))
    api_argv = [
        python,
        "-m",
        "pagoda.frontend.cli",
        "--engine",
        ",".join(addresses),
        *frontend_args_to_argv(ns),
    ]
    if ns.served_model_name:
        api_argv += ["--served-model-name", ns.served_model_name]
    if ns.curve_keys:
        api_argv += ["--curve-keys", ns.curve_keys]
    supervisor: Supervisor | None = None
    if ns.enable_elastic_ep:
        supervisor = Supervisor(address, engine_flags, engines, ns.enable_expert_parallel)
        api_argv += ["--elastic-ep-supervisor", supervisor.address]
    api_env = dict(os.environ)
    metrics_dir = None
    if ns.api_server_count > 1:
        # prometheus-client sums the API servers' request metrics through files here.
        metrics_dir = tempfile.mkdtemp(prefix="pagoda-metrics-")
        api_env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    for i in range(ns.api_server_count):
        api_server = subprocess.Popen(
            [*api_argv, "--api-server-index", str(i)], env=api_env, preexec_fn=die_with_parent()
        )
        api_servers.append((f"api-server {i}", api_server))

    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    exit_code = 0
    try:
        while not stopping:
            if supervisor is not None:
                supervisor.serve_calls()
            for name, proc in engines + api_servers:
                code = proc.poll()
                if code is not None:
                    print(
                        f"pagoda: {name} {_how_it_ended(code)}; stopping the others",
                        file=sys.stderr,
                        flush=True,
                    )
                    # A child killed by a signal has a negative code; exit 1 then.
                    exit_code = code if code > 0 else 1
                    stopping = True
                    break
            time.sleep(0.2)
    finally:
        # API servers first: they drain their requests (up to --shutdown-timeout)
        # while the engine cores still serve them; then the engine cores.
        _stop(api_servers, ns.shutdown_timeout + 10)
        _stop(engines, 15)
        if supervisor is not None:
            supervisor.close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        if runtime_dir is not None:
            shutil.rmtree(runtime_dir, ignore_errors=True)
    return exit_code


class Supervisor:
    """`--enable-elastic-ep`: starts and stops data-parallel engine cores when the
    API server asks (frontend/elastic.py), on a REP socket beside the engines'.

    Engines started for a scale are pending until committed: one that dies
    then fails that scale only; committed ones are watched like the rest.
    With the experts split over the engines (--enable-expert-parallel), a
    scale starts a new generation of engines in a new expert-parallel world
    (`replace`) instead of adding ranks to the running one.
    """

    def __init__(
        self,
        address: str,
        engine_flags: list[str],
        engines: list[tuple[str, subprocess.Popen[bytes]]],
        experts_split: bool = False,
    ) -> None:
        import zmq

        self.base = address
        self.engine_flags = engine_flags
        self.engines = engines  # the watched list, shared with _serve's loop
        self.experts_split = experts_split
        self.generation = 0  # the running engines' (0: those pagoda serve started)
        self.pending: dict[str, subprocess.Popen[bytes]] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.linger = 0
        if address.startswith("ipc://"):
            self.address = address + ".supervisor"
            self._sock.bind(self.address)
        else:  # tcp engines: the supervisor listens on loopback only
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{port}"

    def serve_calls(self) -> None:
        import msgspec
        import zmq

        while self._sock.poll(0):
            try:
                call = msgspec.msgpack.decode(self._sock.recv())
                ranks = [int(r) for r in call.get("ranks", [])]
                generation = int(call.get("generation", self.generation))
                reply = self._answer(call["op"], ranks, generation, int(call.get("size", 0)))
            except Exception as e:  # noqa: BLE001 - every call gets an answer
                reply = {"error": str(e) or repr(e)}
            try:
                self._sock.send(msgspec.msgpack.encode(reply))
            except zmq.ZMQError:
                pass

    @staticmethod
    def name(rank: int, generation: int) -> str:
        return f"engine-core {rank}" if generation == 0 else f"engine-core g{generation}-{rank}"

    def _answer(self, op: str, ranks: list[int], generation: int, size: int) -> dict[str, object]:
        if op == "mode":
            return {"replace": self.experts_split, "generation": self.generation}
        if op == "start":  # more ranks of the running generation
            addresses = dp_addresses(self.base, max(ranks) + 1)
            for rank in ranks:
                self._spawn(rank, generation, addresses[rank], [])
            return {"addresses": [addresses[r] for r in ranks]}
        if op == "replace":  # a new generation of `size` engines, experts split over them
            if not self.base.startswith("ipc://"):
                raise ValueError("resizing engines that split the experts needs ipc addresses")
            new = self.generation + 1
            addresses = dp_addresses(f"{self.base}-g{new}", size)
            flags = []
            if size > 1:
                flags = ["--data-parallel-size", str(size), "--data-parallel-address", "127.0.0.1"]
                flags += ["--data-parallel-rpc-port", str(_free_port())]
            for rank in range(size):
                self._spawn(rank, new, addresses[rank], flags)
            return {"addresses": addresses, "generation": new}
        names = [self.name(r, generation) for r in ranks]
        if op == "status":
            return {"alive": [n in self.pending and self.pending[n].poll() is None for n in names]}
        if op == "commit":
            for name in names:
                self.engines.append((name, self.pending.pop(name)))
            self.generation = max(self.generation, generation)
            return {"ok": True}
        if op == "stop":
            procs = [self.pending.pop(n) for n in names if n in self.pending]
            for name, proc in list(self.engines):
                if name in names:
                    self.engines.remove((name, proc))
                    procs.append(proc)
            _stop([("engine-core", p) for p in procs], 15)
            return {"ok": True}
        raise ValueError(f"unknown supervisor call {op!r}")

    def _spawn(self, rank: int, generation: int, address: str, flags: list[str]) -> None:
        argv = [sys.executable, "-m", "pagoda.engine_core.cli"]
        argv += ["--address", address, *self.engine_flags, *flags]
        argv += ["--data-parallel-rank", str(rank)]
        self.pending[self.name(rank, generation)] = subprocess.Popen(
            argv, preexec_fn=die_with_parent()
        )

    def close(self) -> None:
        _stop([("engine-core", p) for p in self.pending.values()], 15)
        self._sock.close(0)
        self._ctx.term()


def _how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn: the child gets SIGTERM when this process dies, even by SIGKILL.

    Without it a `pagoda serve` killed with -9 would leave its engine core and
    API servers running, holding the port and the accelerator. Linux only
    (prctl); elsewhere None. Safe as a preexec_fn because pagoda starts no threads.
    """
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return set_death_signal


def _stop(children: list[tuple[str, subprocess.Popen[bytes]]], timeout: float) -> None:
    """SIGTERM these children, wait up to `timeout`, SIGKILL what is left."""
    for _, proc in children:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for name, proc in children:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            print(f"pagoda: {name} did not stop in time; killing it", file=sys.stderr, flush=True)
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start an engine core and API servers")
    add_engine_args(serve)
    add_frontend_args(serve)
    serve.add_argument("--api-server-count", type=int, default=1)
    serve.add_argument("--address", default=None, help="the engine core's address")
    serve.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine cores, each with the whole model; requests go to the least loaded",
    )
    serve.add_argument(
        "--curve-keys", default=None, metavar="DIR", help="CURVE keys for a tcp --address"
    )
    serve.add_argument(
        "--enable-elastic-ep",
        action="store_true",
        help="resize the data-parallel engines while serving: POST /scale_elastic_ep",
    )
    serve.add_argument("model_tag", nargs="?", default=None, help="same as --model")
    batch = sub.add_parser("run-batch", help="answer a JSONL file of OpenAI batch requests")
    add_engine_args(batch)
    add_run_batch_args(batch)
    batch.add_argument("--chat-template", default=None, help="a jinja template file or string")
    batch.add_argument("--enable-auto-tool-choice", action="store_true")
    batch.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None)
    add_bench_args(sub.add_parser("bench", help="benchmark a server, or the engine offline"))
    keys = sub.add_parser("curve-keys", help="make CURVE keys for a tcp engine core")
    keys.add_argument("directory")
    from pagoda.frontend.proxy import add_proxy_args

    add_proxy_args(
        sub.add_parser("proxy", help="one endpoint over prefill and decode instances (KV transfer)")
    )
    ns = parser.parse_args(argv)
    if ns.command == "proxy":
        from pagoda.frontend.proxy import run_proxy

        return run_proxy(ns)
    if ns.command == "curve-keys":
        from pagoda.protocol.curve import generate_keys

        try:
            root = generate_keys(ns.directory)
        except FileExistsError as e:
            parser.error(str(e))
        print(
            f"CURVE keys in {root}: engine-core --curve-keys {root}; api-server --curve-keys {root}"
        )
        return 0
    if ns.command == "bench":
        return run_bench(ns)
    if ns.command == "run-batch":
        if ns.enable_auto_tool_choice and not ns.tool_call_parser:
            parser.error("--enable-auto-tool-choice needs --tool-call-parser")
        return run_batch(ns)
    if ns.command == "serve":
        if ns.model_tag and not ns.model:
            ns.model = ns.model_tag
        if ns.api_server_count < 1:
            parser.error("--api-server-count must be at least 1")
        if ns.data_parallel_size < 1:
            parser.error("--data-parallel-size must be at least 1")
        if ns.enable_elastic_ep and ns.api_server_count != 1:
            parser.error("--enable-elastic-ep runs with one API server (--api-server-count 1)")
        return _serve(ns)
    return 2


if __name__ == "__main__":
    sys.exit(main())
