"""The ray executor: Ray actors behind the same seam as the worker processes.

A local Ray cluster is started the way a user starts one (`ray start
--head`) and the engine joins it through RAY_ADDRESS. Two ranks on Ray give
the tokens of one rank in the engine process, errors come back as the mp
executor's, an actor that dies ends the engine with an error naming its
rank, and an engine with no cluster to join says so at once.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.executor import ExecutorError
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.engine_core.helpers import RequestRecord, random_prompts, run_to_completion
from tests.engine_core.test_mp_executor import (
    assert_close_logprobs,
    counting_submits,
    requests,
    tiny_engine,
)

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

from pagoda.engine_core.executor.ray import RayExecutor  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A one-node Ray cluster of 4 CPUs, as `ray start --head` gives it; its address.

    It runs with token authentication off (a token left in ~/.ray would
    otherwise turn it on for the cluster but not for the engine). Only its own
    processes are stopped at the end: `ray stop` would stop every Ray
    cluster of this user on the host.
    """
    # Short: Ray's unix sockets live under it, and their paths are limited.
    temp_dir = tempfile.mkdtemp(prefix="pgr-", dir="/tmp")
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    command = [str(Path(sys.executable).with_name("ray")), "start", "--head"]
    command += ["--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "4"]
    command += ["--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp_dir]
    with pytest.MonkeyPatch.context() as mp:
        try:
            started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
            assert started.returncode == 0, started.stdout + started.stderr
            mp.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
            mp.setenv("RAY_AUTH_MODE", "disabled")
            yield f"127.0.0.1:{port}"
        finally:
            stop_cluster(temp_dir)


def stop_cluster(temp_dir: str) -> None:
    """End the processes of the cluster whose temp dir this is: those that name
    it on their command lines (GCS, raylet, monitors) and their children (the
    agents and the workers)."""
    cluster: set[int] = set()
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if temp_dir.encode() in (entry / "cmdline").read_bytes():
                cluster.add(int(entry.name))
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    children = {pid for pid, parent in parents.items() if parent in cluster}
    # At once, as `ray stop --force` does (raylet and GCS take their time over SIGTERM).
    for pid in (cluster | children) - {os.getpid()}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_no_cluster_to_join_is_a_clear_error(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """First in the module: the engine's own connection is what is tried (a
    process joined to Ray already uses the cluster it joined)."""
    assert not ray.is_initialized()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"no Ray cluster at RAY_ADDRESS=.*ray start --head"):
        tiny_engine(tiny_models["llama"], "ray", tensor_parallel_size=2)
    assert time.monotonic() - started < 10


@pytest.fixture(scope="module")
def ray_engine(ray_cluster: str, tiny_models: dict[str, Path]) -> Iterator[EngineCore]:
    engine = tiny_engine(tiny_models["llama"], "ray", tensor_parallel_size=2)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def one_rank(tiny_models: dict[str, Path]) -> dict[str, RequestRecord]:
    """What the requests give at one rank, in the engine process."""
    engine = tiny_engine(tiny_models["llama"], "uni")
    try:
        return run_to_completion(engine, requests(engine.info.vocab_size)).records
    finally:
        engine.shutdown()


def assert_same_tokens(got: dict[str, RequestRecord], expected: dict[str, RequestRecord]) -> None:
    """The same tokens; logprobs and prompt logprobs within 1e-4."""
    for request_id, one in expected.items():
        assert got[request_id].token_ids == one.token_ids, request_id
        assert_close_logprobs(got[request_id].logprobs, one.logprobs)
        assert_close_logprobs(got[request_id].prompt_logprobs or [], one.prompt_logprobs or [])


def test_two_ranks_on_ray_give_the_single_rank_tokens(
    ray_engine: EngineCore, one_rank: dict[str, RequestRecord]
) -> None:
    """Greedy, seeded top-p and penalized sampling, logprobs and prompt
    logprobs, with the vocabulary and heads split over two actors."""
    assert isinstance(ray_engine.executor, RayExecutor)
    two = run_to_completion(ray_engine, requests(ray_engine.info.vocab_size)).records
    assert_same_tokens(two, one_rank)


def test_pipeline_stages_on_ray_keep_a_plan_in_flight_each(
    ray_cluster: str, tiny_models: dict[str, Path], one_rank: dict[str, RequestRecord]
) -> None:
    """Two stages, an actor each: an actor runs its calls in the order they
    came, so the first stage takes the next plan while the second finishes
    the one before; the tokens of one rank."""
    engine = tiny_engine(tiny_models["llama"], "ray", pipeline_parallel_size=2)
    try:
        assert [i.stage for i in engine.executor.collective_rpc("describe")] == [0, 1]
        depths: list[int] = []
        engine.executor.submit = counting_submits(engine, depths)  # type: ignore[method-assign]
        two = run_to_completion(engine, requests(engine.info.vocab_size)).records
        assert max(depths) == 2
    finally:
        engine.shutdown()
    assert_same_tokens(two, one_rank)


def test_control_calls_reach_the_actors(ray_engine: EngineCore) -> None:
    executor = ray_engine.executor
    info = executor.collective_rpc("describe")
    assert [i.rank for i in info] == [0, 1]
    # Both actors on the one node: their partial sums meet in shared memory.
    assert [i.all_reduce for i in info] == ["shm", "shm"]
    with pytest.raises(ValueError, match="no control call"):
        executor.collective_rpc("no_such_call")
    with pytest.raises(ValueError, match="no control call"):
        executor.collective_rpc("_decoder", ("x",))
    with pytest.raises(ValueError, match="no profile is running"):
        executor.collective_rpc("stop_profile", ("/tmp", "x"))
    executor.check_health()


def test_a_killed_actor_fails_the_engine_naming_its_rank(
    ray_cluster: str, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's PAGODA_* variables reach the actors.
    monkeypatch.setenv("PAGODA_CPU_ALLREDUCE", "gloo")
    engine = tiny_engine(tiny_models["llama"], "ray", tensor_parallel_size=2)
    try:
        executor = engine.executor
        assert isinstance(executor, RayExecutor)
        assert [i.all_reduce for i in executor.collective_rpc("describe")] == ["gloo", "gloo"]
        prompt = random_prompts(6, 1, engine.info.vocab_size, 8, 8)[0]
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        assert engine.add_request(AddRequest("doomed", prompt, params, 0.0)) is None
        engine.step()
        pid = executor.pids[1]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ExecutorError, match=rf"worker rank 1 \(pid {pid}\) died"):
            while engine.has_work():
                engine.step()
        assert time.monotonic() - started < 5
        with pytest.raises(ExecutorError, match="rank 1"):
            executor.check_health()
    finally:
        started = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - started < 5
