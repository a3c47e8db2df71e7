"""Elastic data parallelism (`pagoda serve --enable-elastic-ep`): the number of
engine cores changes while the API server serves (vLLM's `/scale_elastic_ep`).

`pagoda serve` is the supervisor: it owns the engine-core processes and
answers, on a ZeroMQ REP socket of its runtime directory, `start` (spawn
engine cores for these data-parallel ranks, with the flags of the first),
`status` (which of them are alive), `commit` (they belong to the server
now: from then on their death stops it, as any engine's does) and `stop`
(terminate them). The API server's `ElasticScaler` runs a scale:

- up, N → M: the supervisor starts ranks N..M-1; the DPClient attaches to
  them once each is ready (loaded, answering); one that dies or is not ready
  in time fails the scale: the new ranks are stopped and N engines serve on
  (500).
- down, N → M: ranks M..N-1 get no new requests; once their requests have
  ended (up to `drain_timeout`) the DPClient lets them go and the
  supervisor stops them. Requests still running at the deadline: every
  engine takes requests again and N serve on (408).

While a scale runs, new generation requests are refused with 503 and
`Retry-After` (the in-flight ones go on); `/health`, `/metrics`, `/load`
and `/is_scaling_elastic_ep` answer as usual. The scaling state is cleared
when the scale ends, however it ends.

Without --enable-expert-parallel every engine holds the whole model (its
tensor-parallel ranks split it), so a scale adds or removes engines and
moves nothing. With it, the engines split the experts among themselves
(worker/expert_parallel.py) in one torch.distributed world whose size is
fixed, so a scale N → M (`replace`) starts M new engines in a new world
(each loading its 1/M of the experts) while the N old ones serve; once all
M answer, new requests go to them, the old ones finish what they run (up
to `drain_timeout`; past it the new engines are stopped and the old serve
on, 408) and stop. Memory holds both generations for the while.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagoda.frontend.dp_client import DPClient

SUPERVISOR_TIMEOUT_S = 30.0
START_TIMEOUT_S = 300.0
# A replacement that failed: how long the new engines' requests may take to end.
ROLLBACK_DRAIN_S = 3600.0


class ScaleError(Exception):
    """A scale that could not be done; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class SupervisorLink:
    """Calls to `pagoda serve`'s supervisor socket (one at a time)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None

    async def call(self, message: dict[str, Any], timeout: float = SUPERVISOR_TIMEOUT_S) -> Any:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.linger = 0
            self._sock.connect(self.address)
        sock = self._sock
        await sock.send(msgspec.msgpack.encode(message))
        if not await sock.poll(int(timeout * 1000)):
            sock.close(0)  # a REQ socket that missed its answer cannot send again
            self._sock = None
            raise ScaleError(500, "the supervisor (pagoda serve) did not answer")
        reply = msgspec.msgpack.decode(await sock.recv())
        if "error" in reply:
            raise ScaleError(500, f"the supervisor refused: {reply['error']}")
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
        self._ctx.term()


class ElasticScaler:
    """Runs one scale at a time over a DPClient and the supervisor."""

    def __init__(self, client: DPClient, supervisor: SupervisorLink) -> None:
        self.client = client
        self.supervisor = supervisor
        self.scaling = False
        self.last_scale_s: float | None = None

    @property
    def size(self) -> int:
        return len(self.client.clients)

    async def scale(self, new_size: int, drain_timeout: float) -> None:
        """Scale to `new_size` engines; ScaleError (with its status) if it cannot."""
        if self.scaling:
            raise ScaleError(409, "a scale is already running; wait for it to finish")
        if new_size == self.size:
            raise ScaleError(400, f"already serving {new_size} data parallel engines")
        self.scaling = True
        started = time.monotonic()
        try:
            mode = await self.supervisor.call({"op": "mode"})
            if mode["replace"]:
                await self._replace(new_size, drain_timeout, int(mode["generation"]))
            elif new_size > self.size:
                await self._up(new_size)
            else:
                await self._down(new_size, drain_timeout)
            self.last_scale_s = time.monotonic() - started
        finally:
            self.scaling = False

    async def _up(self, new_size: int) -> None:
        ranks = list(range(self.size, new_size))
        reply = await self.supervisor.call({"op": "start", "ranks": ranks})
        await self._attach(reply["addresses"], ranks, 0)
        await self.supervisor.call({"op": "commit", "ranks": ranks})

    async def _replace(self, new_size: int, drain_timeout: float, generation: int) -> None:
        """Experts split over the engines: start `new_size` engines in a new
        expert-parallel world while the old ones serve, route to them once all
        are ready, then let the old ones finish their requests and stop them."""
        old = self.size
        reply = await self.supervisor.call({"op": "replace", "size": new_size})
        new, ranks = int(reply["generation"]), list(range(new_size))
        await self._attach(reply["addresses"], ranks, new)
        self.client.promote_last(new_size)
        if not await self.client.retire(new_size, drain_timeout):
            # The old engines still run requests: they serve on and the new ones
            # go once the requests routed to them meanwhile have ended.
            self.client.promote_last(old)
            await self.client.retire(old, ROLLBACK_DRAIN_S)
            await self._stop(ranks, new)
            raise ScaleError(
                408,
                f"requests on the engines to replace did not finish within {drain_timeout:g} s; "
                f"still serving {old} data parallel engines",
            )
        await self.supervisor.call({"op": "commit", "ranks": ranks, "generation": new})
        await self._stop(list(range(old)), generation)

    async def _attach(self, addresses: list[str], ranks: list[int], generation: int) -> None:
        """Attach the engines the supervisor started, watching them while they
        load; any that dies or does not answer in time: stopped, ScaleError."""
        attach = asyncio.ensure_future(self.client.add_engines(addresses, START_TIMEOUT_S))
        try:
            while not attach.done():
                done, _ = await asyncio.wait({attach}, timeout=0.5)
                if done:
                    break
                status = await self.supervisor.call(
                    {"op": "status", "ranks": ranks, "generation": generation}
                )
                dead = [r for r, alive in zip(ranks, status["alive"], strict=True) if not alive]
                if dead:
                    attach.cancel()
                    raise ScaleError(
                        500,
                        f"engine core rank {dead[0]} died while starting; "
                        f"still serving {self.size} data parallel engines",
                    )
            attach.result()
        except ScaleError:
            await self._stop(ranks, generation)
            raise
        except Exception as e:  # noqa: BLE001 - any failure to attach rolls back
            await self._stop(ranks, generation)
            raise ScaleError(
                500, f"the new engine cores did not start ({e}); still serving {self.size}"
            ) from None

    async def _down(self, new_size: int, drain_timeout: float) -> None:
        old = self.size
        if not await self.client.retire(new_size, drain_timeout):
            raise ScaleError(
                408,
                f"requests on the engines to retire did not finish within {drain_timeout:g} s; "
                f"still serving {old} data parallel engines",
            )
        await self._stop(list(range(new_size, old)))

    async def _stop(self, ranks: list[int], generation: int | None = None) -> None:
        call: dict[str, Any] = {"op": "stop", "ranks": ranks}
        if generation is not None:
            call["generation"] = generation
        try:
            await self.supervisor.call(call, timeout=60.0)
        except ScaleError:
            pass  # the supervisor reaps what it can; the scale's answer says what failed
