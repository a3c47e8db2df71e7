"""The `ray` executor: one Ray actor per rank, on a Ray cluster already running.

The engine core joins the cluster that RAY_ADDRESS names (`auto` when unset:
the one `ray start --head` started on this host) and never starts one of its
own. It reserves a placement group of one bundle per rank ({"CPU": 1}, or
{"GPU": 1} on CUDA; packed onto as few nodes as hold them), starts a
`RankActor` in each bundle, and every actor builds its rank's Worker as a
worker process of the `mp` executor does (worker/proc.py's `start_worker`):
torch.distributed meets at rank 0's node address, on a port free there.

Plans and control calls cross as the msgpack bytes of the `mp` executor and
their replies decode alike; a worker's error in a call comes back as
ValueError (the caller's mistake) or RuntimeError. Every wait is bounded: an
actor that dies, or does not answer within PAGODA_WORKER_CALL_TIMEOUT
seconds, ends the engine with an ExecutorError naming its rank.

An actor runs its calls in the order they were made, so steps may be
submitted ahead (`submit`, then `collect`: each pipeline stage busy with its
own plan) and a control call may follow them at once. The actors see the
cluster's environment plus the engine's PAGODA_* variables, and end with the
engine core (Ray ends a driver's actors when it goes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import uuid
from collections import deque
from typing import Any

import msgspec
import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.plan import SchedulePlan, StepResult
from pagoda.engine_core.executor.base import (
    ExecutorError,
    RankExecutor,
    raise_rank_error,
    return_type,
)
from pagoda.engine_core.executor.mp import CALL_TIMEOUT_S, START_TIMEOUT_S
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.worker.proc import ERROR, OK, WorkerSpec, error_payload, start_worker

logger = logging.getLogger(__name__)

NO_CLUSTER = "start one with `ray start --head` (or set RAY_ADDRESS to its head's host:port)"
# A reply: (status, msgpack payload), status OK or ERROR as on the mp channel.
Reply = tuple[bytes, bytes]


class RayExecutor(RankExecutor):
    """Ray actors, one per rank, in a placement group of this engine's."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        from pagoda.engine_core.worker.worker import device_type

        self.world_size = config.world_size
        self._result_rank = config.result_rank
        self._actors: list[Any] = []
        self._group: PlacementGroup | None = None
        self._pids: list[int | None] = [None] * self.world_size
        # Steps submitted and not yet collected: their replies' refs, by rank.
        self._steps: deque[list[Any]] = deque()
        self._failed = False
        self._closed = False
        self._connected_here = _connect()
        try:
            on_gpu = device_type(config) == "cuda"
            self._group = _reserve(self.world_size, "GPU" if on_gpu else "CPU")
            self._actors = _start_actors(self._group, self.world_size, on_gpu)
            self._start_workers(config, model_config)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "%d Ray actors ready (pids %s)", self.world_size, ", ".join(map(str, self._pids))
        )

    @property
    def pids(self) -> list[int | None]:
        """The actors' process ids, by rank (on their nodes)."""
        return list(self._pids)

    def _start_workers(self, config: EngineConfig, model_config: ModelConfig) -> None:
        """Find where the actors run, then have every one join torch.distributed
        and build its Worker."""
        places = self._gather([a.where.remote() for a in self._actors], START_TIMEOUT_S, "start")
        nodes = [msgspec.msgpack.decode(p) for p in places]
        self._pids = [node["pid"] for node in nodes]
        init = None
        if self.world_size > 1:
            (port,) = self._gather([self._actors[0].free_port.remote()], START_TIMEOUT_S, "start")
            host = nodes[0]["address"]
            host = f"[{host}]" if ":" in host else host
            init = f"tcp://{host}:{msgspec.msgpack.decode(port)}"
        node_ids = [node["node_id"] for node in nodes]
        # Ranks on one host add their partial sums through shared memory named
        # after this engine; spread over hosts, through torch.distributed alone.
        shm_tag = uuid.uuid4().hex[:16] if len(set(node_ids)) == 1 else None
        starts = []
        for rank, actor in enumerate(self._actors):
            rank_config = config
            if config.num_threads is None:
                # A host's cores shared among its ranks, not each rank taking all.
                threads = max(nodes[rank]["cores"] // node_ids.count(node_ids[rank]), 1)
                rank_config = dataclasses.replace(config, num_threads=threads)
            spec = WorkerSpec(
                config=rank_config,
                model_config=model_config,
                rank=rank,
                world_size=self.world_size,
                dist_init_method=init,
                shm_tag=shm_tag,
            )
            starts.append(actor.start.remote(msgspec.msgpack.encode(spec)))
        self._gather(starts, START_TIMEOUT_S, "start")

    # ------------------------------------------------------------ the seam

    def submit(self, plan: SchedulePlan) -> None:
        """Start a step on every rank and return; `collect` takes its result."""
        self._steps.append(self._call("execute", msgspec.msgpack.encode(plan)))

    def collect(self) -> StepResult:
        """The oldest submitted step's result."""
        replies = self._gather(self._steps.popleft(), CALL_TIMEOUT_S, "execute")
        return msgspec.msgpack.decode(replies[self._result_rank], type=StepResult)

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        payload = msgspec.msgpack.encode([method, list(args), kwargs or {}])
        replies = self._call_all("rpc", payload, method)
        kind = return_type(method)
        return [msgspec.msgpack.decode(p, type=kind) for p in replies]

    def check_health(self) -> None:
        self._call_all("ping", b"", "a health check")

    def shutdown(self) -> None:
        """Stop the workers, end the actors and free their placement group; never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._actors and not self._failed:
                # Let each Worker free what it holds; a rank stuck in a
                # collective with a dead peer is ended below all the same.
                ray.wait(
                    [a.stop.remote() for a in self._actors],
                    num_returns=len(self._actors),
                    timeout=5.0,
                )
        except Exception:  # noqa: BLE001 - shutting down regardless
            logger.debug("stopping the Ray actors", exc_info=True)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                logger.debug("killing a Ray actor", exc_info=True)
        try:
            if self._group is not None:
                remove_placement_group(self._group)
            if self._connected_here:
                ray.shutdown()
        except Exception:  # noqa: BLE001
            logger.warning("leaving the Ray cluster", exc_info=True)

    # ------------------------------------------------------------- calls

    def _call(self, method: str, payload: bytes) -> list[Any]:
        """Call an actor method on every rank; its replies' object refs, by rank."""
        if self._closed:
            raise ExecutorError("the workers have been shut down")
        return [getattr(actor, method).remote(payload) for actor in self._actors]

    def _call_all(self, method: str, payload: bytes, what: str) -> list[bytes]:
        return self._gather(self._call(method, payload), CALL_TIMEOUT_S, what)

    def _gather(self, refs: list[Any], timeout_s: float, what: str) -> list[bytes]:
        """Every rank's reply payload, in rank order; ExecutorError on a death,
        a time-out or a failed start (and the executor is then broken). A
        rank's error in a call is raised as ValueError or RuntimeError."""
        try:
            replies = self._wait(refs, timeout_s, what)
        except ExecutorError:
            self._failed = True
            raise
        failed = [(rank, p) for rank, (status, p) in enumerate(replies) if status == ERROR]
        if failed:
            if what == "start":
                self._failed = True
            raise_rank_error(*failed[0], what)
        return [payload for _, payload in replies]

    def _wait(self, refs: list[Any], timeout_s: float, what: str) -> list[Reply]:
        """The replies, in rank order, as each comes: the first actor to die
        fails the call at once, not when the others time out."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        got: dict[int, Reply] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            left = max(deadline - time.monotonic(), 0.0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                rank = min(rank_of[ref] for ref in pending)
                raise ExecutorError(
                    f"worker rank {rank} did not answer {what} within {timeout_s:g} s"
                )
            for ref in ready:
                rank = rank_of[ref]
                try:
                    got[rank] = ray.get(ref)
                except RayActorError as e:
                    raise ExecutorError(f"{self._name(rank)} died: {_first_line(e)}") from e
                except RayError as e:
                    raise ExecutorError(f"{self._name(rank)} failed in {what}: {e}") from e
        return [got[rank] for rank in range(len(refs))]

    def _name(self, rank: int) -> str:
        pid = self._pids[rank]
        return f"worker rank {rank}" + (f" (pid {pid})" if pid is not None else "")


class RankActor:
    """One rank in a Ray actor: its Worker, driven by the RayExecutor.

    Every method answers a Reply: (OK, msgpack payload) or (ERROR, the
    error's type, message and kind), as a worker process answers on the
    `mp` channel.
    """

    def __init__(self) -> None:
        self.worker: Any = None
        self.reports = False  # this rank's step results are the engine's

    def where(self, _: bytes = b"") -> Reply:
        """The actor's node (id, address, cores) and process id."""
        place = {
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "cores": os.cpu_count() or 1,
            "pid": os.getpid(),
        }
        return OK, msgspec.msgpack.encode(place)

    def free_port(self, _: bytes = b"") -> Reply:
        """A port free on this node, for torch.distributed to meet at."""
        with socket.socket() as s:
            s.bind(("", 0))
            return OK, msgspec.msgpack.encode(s.getsockname()[1])

    def start(self, spec_bytes: bytes) -> Reply:
        try:
            spec = msgspec.msgpack.decode(spec_bytes, type=WorkerSpec)
            self.worker = start_worker(spec)
        except Exception as e:  # noqa: BLE001 - reported to the engine, which fails with it
            logger.exception("worker cannot start")
            return ERROR, error_payload(e)
        self.reports = spec.rank == spec.config.result_rank
        return OK, b""

    def execute(self, plan: bytes) -> Reply:
        try:
            result = self.worker.execute_model(msgspec.msgpack.decode(plan, type=SchedulePlan))
        except Exception as e:  # noqa: BLE001 - reported to the engine
            logger.exception("a step failed")
            return ERROR, error_payload(e)
        return OK, msgspec.msgpack.encode(result) if self.reports else b""

    def rpc(self, call: bytes) -> Reply:
        try:
            method, args, kwargs = msgspec.msgpack.decode(call)
            if method.startswith("_") or not callable(getattr(self.worker, method, None)):
                raise ValueError(f"workers have no control call {method!r}")
            return OK, msgspec.msgpack.encode(getattr(self.worker, method)(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - reported to the engine
            logger.exception("a control call failed")
            return ERROR, error_payload(e)

    def ping(self, _: bytes = b"") -> Reply:
        return OK, b""

    def stop(self, _: bytes = b"") -> Reply:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        return OK, b""


def _connect() -> bool:
    """Join the running cluster; True when this call connected (False: the
    process was connected already, by its own script)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS", "auto")
    _check_reachable(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except ConnectionError as e:
        if address == "auto":
            raise ValueError(f"no Ray cluster to join: {NO_CLUSTER}") from e
        # Something answers there but would not take us (a token the cluster
        # wants, another version of Ray): Ray's reason ends its message.
        reason = str(e.__cause__ or e).strip().splitlines()[-1]
        raise ValueError(f"cannot join the Ray cluster at {address}: {reason}") from e
    return True


def _check_reachable(address: str) -> None:
    """A host:port address with nothing listening fails here, at once (Ray
    itself would keep trying to reach it for minutes)."""
    if address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
    except (OSError, ValueError) as e:
        raise ValueError(f"no Ray cluster at RAY_ADDRESS={address} ({e}): {NO_CLUSTER}") from e


def _reserve(size: int, resource: str) -> PlacementGroup:
    """A placement group of one bundle of `resource` per rank, once the cluster grants it."""
    total = ray.cluster_resources().get(resource, 0.0)
    if total < size:
        raise ValueError(
            f"{size} ranks need {size} {resource}s of the Ray cluster, which has {total:g} "
            "(see `ray status`)"
        )
    group = placement_group([{resource: 1.0}] * size, strategy="PACK")
    if not group.wait(timeout_seconds=START_TIMEOUT_S):
        remove_placement_group(group)
        raise ExecutorError(
            f"the Ray cluster did not grant {size} {resource}s within {START_TIMEOUT_S:g} s: "
            "others hold them (see `ray status`)"
        )
    return group


def _start_actors(group: PlacementGroup, size: int, on_gpu: bool) -> list[Any]:
    """One RankActor in each bundle of the group; rank r in bundle r."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PAGODA_")}
    actor_class = ray.remote(RankActor)
    return [
        actor_class.options(
            num_cpus=0 if on_gpu else 1,
            num_gpus=1 if on_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=rank
            ),
            runtime_env={"env_vars": env} if env else None,
        ).remote()
        for rank in range(size)
    ]


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
