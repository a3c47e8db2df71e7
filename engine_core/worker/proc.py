"""A worker process: one rank of the `mp` executor (executor/mp.py).

Started by the engine core as `python -m pagoda.engine_core.worker.proc
--channel ipc://DIR --rank R --parent-pid PID` (a fresh interpreter: nothing
of the caller's script runs again), it takes its WorkerSpec as the first
message on the channel, joins the torch.distributed group of the engine's
ranks, builds its Worker, then serves the channel until told to stop: plans
to execute and control calls by name, msgpack in and out over ZeroMQ. It
dies with the engine core (Linux: PR_SET_PDEATHSIG), so a killed engine
leaves no workers behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import zmq

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.plan import SchedulePlan
from pagoda.engine_core.lifetime import die_with_parent
from pagoda.engine_core.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Frames of the channel. Engine -> worker: [kind, payload]; worker -> engine:
# [rank, status, payload], the payload msgpack (an error: {"type", "message", "kind"}).
SPEC, EXECUTE, RPC, STOP = b"spec", b"execute", b"rpc", b"stop"
READY, OK, ERROR = b"ready", b"ok", b"error"


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to start (sent once, as msgpack)."""

    config: EngineConfig
    model_config: ModelConfig
    rank: int
    world_size: int
    dist_init_method: str | None = None  # tcp://host:port of torch.distributed, for world > 1
    dist_timeout_s: float = 300.0
    # Names the shared-memory segments of a group whose ranks share one host
    # (unique per engine); None: collectives over torch.distributed alone.
    shm_tag: str | None = None


def inbox_address(channel: str, rank: int) -> str:
    """Where a rank's messages come from: ipc://DIR/rank<r>, or for a tcp
    channel tcp://HOST:PORT the port PORT + 2 + r (PORT + 1 takes the replies)."""
    if channel.startswith("tcp://"):
        host, _, port = channel[len("tcp://") :].rpartition(":")
        return f"tcp://{host}:{int(port) + 2 + rank}"
    return f"{channel}/rank{rank}"


def replies_address(channel: str) -> str:
    if channel.startswith("tcp://"):
        host, _, port = channel[len("tcp://") :].rpartition(":")
        return f"tcp://{host}:{int(port) + 1}"
    return f"{channel}/replies"


def error_payload(e: BaseException) -> bytes:
    """An exception as the engine re-raises it: "caller" marks the caller's
    mistakes (ValueError and the like), which the engine reports and survives."""
    caller = isinstance(e, ValueError | TypeError | KeyError | FileNotFoundError)
    return msgspec.msgpack.encode(
        {
            "type": type(e).__name__,
            "message": str(e),
            "kind": getattr(e, "kind", ""),
            "caller": caller,
        }
    )


def main(argv: list[str] | None = None) -> int:
    """The process's main: an error at start is reported on the channel."""
    parser = argparse.ArgumentParser(prog="pagoda-worker")
    parser.add_argument(
        "--channel", required=True, help="the engine's channel: ipc://DIR or tcp://HOST:PORT"
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    ns = parser.parse_args(argv)
    die_with_parent(ns.parent_pid)
    try:
        import setproctitle

        setproctitle.setproctitle(f"pagoda::worker-{ns.rank}")
    except ImportError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core stops its workers
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(inbox_address(ns.channel, ns.rank))
    replies = ctx.socket(zmq.PUSH)
    replies.connect(replies_address(ns.channel))
    rank = str(ns.rank).encode()
    try:
        kind, payload = inbox.recv_multipart()
        if kind != SPEC:
            raise ValueError(f"expected the worker spec first, got {kind!r}")
        spec = msgspec.msgpack.decode(payload, type=WorkerSpec)
        worker = start_worker(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which fails with it
        logger.error("worker %d cannot start: %s", ns.rank, traceback.format_exc())
        replies.send_multipart([rank, ERROR, error_payload(e)])
        replies.close(linger=2000)
        ctx.term()
        return 1
    replies.send_multipart([rank, READY, b""])
    _serve(worker, spec.rank, spec.rank == spec.config.result_rank, inbox, replies)
    worker.shutdown()
    replies.close(linger=1000)
    inbox.close(linger=0)
    ctx.term()
    return 0


def start_workers(channel: str, ranks: range) -> list[subprocess.Popen[bytes]]:
    """A worker process per rank, each taking its spec from the channel."""
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagoda.engine_core.worker.proc",
                "--channel",
                channel,
                "--rank",
                str(rank),
                "--parent-pid",
                str(os.getpid()),
            ],
            stdin=subprocess.DEVNULL,
        )
        for rank in ranks
    ]


def run_headless(config: EngineConfig) -> int:
    """`engine-core --headless`: this node's ranks only, for the engine core on
    node 0; returns when they end (the first failure's exit code)."""
    channel = f"tcp://{config.master_addr}:{config.master_port + 1}"
    procs = start_workers(channel, config.local_ranks)
    logger.info(
        "node %d of %d: workers for ranks %s of the engine at %s",
        config.node_rank,
        config.nnodes,
        list(config.local_ranks),
        config.master_addr,
    )

    def stop(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status = 0
    while any(proc.poll() is None for proc in procs):
        for rank, proc in zip(config.local_ranks, procs, strict=True):
            code = proc.poll()
            if code not in (None, 0) and status == 0:
                logger.error("worker rank %d (pid %d) exited with code %d", rank, proc.pid, code)
                status = 1
                stop(signal.SIGTERM, None)
        time.sleep(0.2)
    return status


def start_worker(spec: WorkerSpec) -> Any:
    """Join the ranks' torch.distributed group (world > 1) and build this rank's Worker."""
    if spec.world_size > 1:
        import torch
        import torch.distributed as dist

        on_gpu = torch.cuda.is_available() and spec.config.device != "cpu"
        if on_gpu:
            # Each local rank on its own GPU ("cuda" then means that one).
            local = spec.rank - spec.config.local_ranks.start
            torch.cuda.set_device(local % torch.cuda.device_count())
        backend = "nccl" if on_gpu else "gloo"
        dist.init_process_group(
            backend,
            init_method=spec.dist_init_method,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.dist_timeout_s),
        )
    from pagoda.engine_core.worker.worker import Worker

    return Worker(spec.config, spec.model_config, spec.rank, spec.shm_tag)


def _serve(
    worker: Any, rank_id: int, reports: bool, inbox: zmq.Socket, replies: zmq.Socket
) -> None:
    """Serve the channel; `reports`: this rank's step results are the engine's."""
    rank = str(rank_id).encode()
    plans = msgspec.msgpack.Decoder(SchedulePlan)
    encode = msgspec.msgpack.encode
    while True:
        kind, payload = inbox.recv_multipart()
        if kind == STOP:
            return
        try:
            if kind == EXECUTE:
                result = worker.execute_model(plans.decode(payload))
                # The last stage's ranks all sample the same tokens; one reports them.
                replies.send_multipart([rank, OK, encode(result) if reports else b""])
            elif kind == RPC:
                method, args, kwargs = msgspec.msgpack.decode(payload)
                if method.startswith("_") or not callable(getattr(worker, method, None)):
                    raise ValueError(f"workers have no control call {method!r}")
                replies.send_multipart([rank, OK, encode(getattr(worker, method)(*args, **kwargs))])
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except Exception as e:  # noqa: BLE001 - reported to the engine
            logger.exception("worker %d: %s failed", rank_id, kind.decode(errors="replace"))
            replies.send_multipart([rank, ERROR, error_payload(e)])


if __name__ == "__main__":
    sys.exit(main())
