"""The `mp` executor: one worker process per local rank, started and watched here.

The channel is ZeroMQ over ipc sockets in a private directory: one PUSH
socket per rank carries the plan (the same msgpack bytes to every rank, once
per step) and the control calls, one PULL socket gathers the replies. Every
rank runs every step; all ranks sample the same tokens from the same logits
and the same seeded generators (torch's generator is seeded with --seed on
every rank, and seeded requests draw from Philox keyed by their seed), so
each keeps its own request state with no broadcast of sampled tokens, and
the result of the first rank of the last pipeline stage is the step's.

Steps may be submitted ahead (`submit`, then `collect`): each rank takes its
messages in order, so with pipeline stages the first stage works on the next
plan while later stages finish the one before. Replies are kept per rank in
arrival order; a control call first gathers the steps still in flight
(their results wait for `collect`).

Nothing here waits without a bound: while a reply is due, the worker
processes are checked every 0.1 s, and a rank that exits, or does not
answer within its time limit, ends the engine with an ExecutorError naming
it. Tensors between ranks go over torch.distributed (gloo on the CPU, NCCL on
CUDA), whose collectives time out as well.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.plan import SchedulePlan, StepResult
from pagoda.engine_core.executor.base import (
    ExecutorError,
    RankExecutor,
    raise_rank_error,
    return_type,
)
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.worker.proc import (
    ERROR,
    EXECUTE,
    READY,
    RPC,
    SPEC,
    STOP,
    WorkerSpec,
    inbox_address,
    replies_address,
    start_workers,
)

logger = logging.getLogger(__name__)

# A worker loads its model before it answers; a step or a control call is
# bounded too (generously: a first CPU step may build the compiled kernels).
START_TIMEOUT_S = float(os.environ.get("PAGODA_WORKER_START_TIMEOUT", "600"))
CALL_TIMEOUT_S = float(os.environ.get("PAGODA_WORKER_CALL_TIMEOUT", "300"))
_POLL_MS = 100


class MPExecutor(RankExecutor):
    """Worker processes on this host, one per rank."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.world_size = config.world_size
        self._result_rank = config.result_rank
        self._dir = tempfile.mkdtemp(prefix="pagoda-workers-")
        os.chmod(self._dir, 0o700)
        init: str | None
        if config.nnodes > 1:
            # Workers on other hosts reach this one: the channel over tcp, on
            # the ports after torch.distributed's, bound on every interface
            # (master_addr may be a name, as a Kubernetes service gives it).
            channel = f"tcp://{config.master_addr}:{config.master_port + 1}"
            bound = f"tcp://*:{config.master_port + 1}"
            init = f"tcp://{config.master_addr}:{config.master_port}"
        else:
            channel = bound = f"ipc://{self._dir}"
            init = f"tcp://127.0.0.1:{_free_port()}" if self.world_size > 1 else None
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        # Each rank's replies not yet gathered, in arrival order.
        self._queued: dict[int, deque[tuple[bytes, bytes]]] = {
            rank: deque() for rank in range(self.world_size)
        }
        self._in_flight = 0  # steps submitted and not yet gathered
        self._done: deque[StepResult] = deque()  # gathered, not yet collected
        self._replies.bind(replies_address(bound))
        self._inboxes = []
        for rank in range(self.world_size):
            inbox = self._ctx.socket(zmq.PUSH)
            inbox.bind(inbox_address(bound, rank))
            self._inboxes.append(inbox)
        if config.num_threads is None:
            # The host's cores shared among its ranks, not each rank taking all.
            threads = max((os.cpu_count() or 1) // len(config.local_ranks), 1)
            config = dataclasses.replace(config, num_threads=threads)
        # This node's worker processes (node 0's ranks); other nodes' ranks are
        # started there by `engine-core --headless` and known by their answers.
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._closed = False
        try:
            for rank, proc in zip(
                config.local_ranks, start_workers(channel, config.local_ranks), strict=True
            ):
                self._procs[rank] = proc
            for rank in range(self.world_size):
                spec = WorkerSpec(
                    config=config,
                    model_config=model_config,
                    rank=rank,
                    world_size=self.world_size,
                    dist_init_method=init,
                    # One host: shared memory named after this engine core.
                    shm_tag=str(os.getpid()) if config.nnodes == 1 else None,
                )
                self._send_to(rank, [SPEC, msgspec.msgpack.encode(spec)], START_TIMEOUT_S)
            self._gather(START_TIMEOUT_S, "start")
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "%d worker processes ready (pids %s)",
            self.world_size,
            ", ".join(str(p.pid) for p in self._procs.values()),
        )

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, by rank."""
        return [proc.pid for proc in self._procs.values()]

    # ------------------------------------------------------------ the seam

    def submit(self, plan: SchedulePlan) -> None:
        self._send(EXECUTE, msgspec.msgpack.encode(plan))
        self._in_flight += 1

    def collect(self) -> StepResult:
        if self._done:
            return self._done.popleft()
        return self._gather_step()

    def _gather_step(self) -> StepResult:
        assert self._in_flight > 0, "no step in flight"
        payloads = self._gather(CALL_TIMEOUT_S, "execute")
        self._in_flight -= 1
        return msgspec.msgpack.decode(payloads[self._result_rank], type=StepResult)

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        while self._in_flight:  # their replies come first
            self._done.append(self._gather_step())
        self._send(RPC, msgspec.msgpack.encode([method, list(args), kwargs or {}]))
        payloads = self._gather(CALL_TIMEOUT_S, method)
        kind = return_type(method)
        return [msgspec.msgpack.decode(p, type=kind) for p in payloads]

    def check_health(self) -> None:
        for rank, proc in self._procs.items():
            if proc.poll() is not None:
                raise ExecutorError(_died(rank, proc))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rank, inbox in enumerate(self._inboxes):
            proc = self._procs.get(rank)
            if proc is None or proc.poll() is None:
                try:
                    inbox.send_multipart([STOP, b""], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(1.0)
        for sock in [*self._inboxes, self._replies]:
            sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------- channel

    def _send(self, kind: bytes, payload: bytes) -> None:
        if self._closed:
            raise ExecutorError("the workers have been shut down")
        for rank in range(self.world_size):
            self._send_to(rank, [kind, payload], CALL_TIMEOUT_S)

    def _send_to(self, rank: int, frames: list[bytes], timeout_s: float) -> None:
        """Queue a message for one rank. A PUSH socket with no peer (a worker
        not yet connected, or gone) would block: wait for room, checking on
        the process, within the time limit."""
        inbox, proc = self._inboxes[rank], self._procs.get(rank)
        deadline = time.monotonic() + timeout_s
        while not inbox.poll(_POLL_MS, zmq.POLLOUT):
            if proc is not None and proc.poll() is not None:
                raise ExecutorError(_died(rank, proc))
            if time.monotonic() > deadline:
                raise ExecutorError(f"worker rank {rank} took no message within {timeout_s:g} s")
        inbox.send_multipart(frames, flags=zmq.NOBLOCK)

    def _gather(self, timeout_s: float, what: str) -> list[bytes]:
        """Every rank's reply payload, in rank order; ExecutorError on a death,
        a time-out or a failed start. A rank's error in a call is raised as
        ValueError (the caller's mistake) or RuntimeError."""
        queued = self._queued
        deadline = time.monotonic() + timeout_s
        while not all(queued.values()):
            if self._replies.poll(_POLL_MS):
                rank_b, status, payload = self._replies.recv_multipart()
                queued[int(rank_b)].append((status, payload))
                continue
            for rank, proc in self._procs.items():
                if not queued[rank] and proc.poll() is not None:
                    raise ExecutorError(_died(rank, proc))
            if time.monotonic() > deadline:
                missing = [rank for rank, replies in queued.items() if not replies]
                raise ExecutorError(
                    f"worker rank {missing[0]} did not answer {what} within {timeout_s:g} s"
                )
        got = {rank: replies.popleft() for rank, replies in queued.items()}
        failed = [(rank, p) for rank, (status, p) in sorted(got.items()) if status == ERROR]
        if failed:
            raise_rank_error(*failed[0], what)
        assert all(status in (READY, b"ok") for status, _ in got.values())
        return [got[rank][1] for rank in range(self.world_size)]


def _died(rank: int, proc: subprocess.Popen[bytes]) -> str:
    return f"worker rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
