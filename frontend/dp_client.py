"""DPClient: several engine cores (data parallel) behind one client interface.

`api-server --engine ADDR0,ADDR1,...` attaches to every engine core; each
new request goes to the least loaded one: the running + waiting requests it
reported with its last outputs, plus the requests this API server sent it
since that report (so that a burst between two reports is spread, not
herded). A request's abort goes to the engine that has it. Control calls
(sleep, reset_prefix_cache, profiling, ...) go to every engine, and their
answers fold as protocol/control.py says.

The engines must serve the same model; the first one's Ready describes
them, with the KV blocks summed.

Under `pagoda serve --enable-elastic-ep` the set changes while serving
(frontend/elastic.py): `add_engines` attaches new engine cores at the end,
`retire` stops routing to the last ones, waits for their requests to end
and lets them go. Indices of the engines that stay never change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from pagoda.frontend.engine_client import AsyncMPClient, EngineDeadError
from pagoda.protocol.control import CONTROL_CALLS
from pagoda.protocol.messages import AddRequest, Ready, RequestDelta, SchedulerStats


class DPClient:
    """The AsyncMPClient interface over several engine cores."""

    def __init__(
        self, addresses: list[str], curve_dir: str | None = None, elastic: bool = False
    ) -> None:
        """`elastic`: engines come and go while serving (one address is enough)."""
        if len(addresses) < (1 if elastic else 2):
            raise ValueError("data parallel needs at least two engine addresses")
        self.address = ",".join(addresses)
        self.curve_dir = curve_dir
        self.clients = [AsyncMPClient(a, curve_dir=curve_dir) for a in addresses]
        # New requests go to the first `routable` engines (the others drain).
        self.routable = len(addresses)
        self.ready: Ready | None = None
        self._readies: list[Ready] = []
        self._owner: dict[str, int] = {}  # request id -> engine index
        self._sent_since_stats = [0] * len(addresses)
        self._stats_seen: list[SchedulerStats | None] = [None] * len(addresses)
        self.num_routed = [0] * len(addresses)

    async def start(self, timeout: float = 60.0) -> Ready:
        readies = await asyncio.gather(*(c.start(timeout) for c in self.clients))
        first = readies[0]
        for other, client in zip(readies[1:], self.clients[1:], strict=True):
            _check_same(first, other, client.address)
        self._readies = list(readies)
        self.ready = msgspec.structs.replace(
            first, num_kv_blocks=sum(r.num_kv_blocks for r in readies)
        )
        return self.ready

    async def add_engines(self, addresses: list[str], timeout: float) -> None:
        """Attach more engine cores (they must serve the same model); on any
        failure none is added."""
        assert self.ready is not None
        clients = [AsyncMPClient(a, curve_dir=self.curve_dir) for a in addresses]
        try:
            readies = await asyncio.gather(*(c.start(timeout) for c in clients))
            for ready, client in zip(readies, clients, strict=True):
                _check_same(self.ready, ready, client.address)
        except BaseException:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
            raise
        self.clients += clients
        self._readies += readies
        n = len(clients)
        self._sent_since_stats += [0] * n
        self._stats_seen += [None] * n
        self.num_routed += [0] * n
        self.routable = len(self.clients)
        self._sum_blocks()

    def promote_last(self, n: int) -> None:
        """Move the last n engines to the front (the ones to keep when the
        others retire), their requests' owners renumbered with them."""
        total = len(self.clients)
        order = list(range(total - n, total)) + list(range(total - n))
        where = {old: new for new, old in enumerate(order)}
        self._owner = {rid: where[i] for rid, i in self._owner.items()}
        self.clients = [self.clients[i] for i in order]
        self._readies = [self._readies[i] for i in order]
        self._sent_since_stats = [self._sent_since_stats[i] for i in order]
        self._stats_seen = [self._stats_seen[i] for i in order]
        self.num_routed = [self.num_routed[i] for i in order]

    async def retire(self, keep: int, drain_timeout: float) -> bool:
        """Route nothing more to the engines past the first `keep`; once their
        requests have ended, detach them. False (and every engine routable
        again) if requests are still there after `drain_timeout` seconds."""
        self.routable = keep
        deadline = asyncio.get_running_loop().time() + drain_timeout
        while any(index >= keep for index in self._owner.values()):
            if asyncio.get_running_loop().time() >= deadline:
                self.routable = len(self.clients)
                return False
            await asyncio.sleep(0.05)
        retired = self.clients[keep:]
        del self.clients[keep:], self._readies[keep:], self._sent_since_stats[keep:]
        del self._stats_seen[keep:], self.num_routed[keep:]
        self._sum_blocks()
        await asyncio.gather(*(c.close() for c in retired), return_exceptions=True)
        return True

    def _sum_blocks(self) -> None:
        assert self.ready is not None
        blocks = sum(r.num_kv_blocks for r in self._readies)
        self.ready = msgspec.structs.replace(self.ready, num_kv_blocks=blocks)
        self.address = ",".join(c.address for c in self.clients)

    # ------------------------------------------------------------ state

    @property
    def dead(self) -> str | None:
        """Why serving is impaired: any engine core that is down."""
        for client in self.clients:
            if client.dead is not None:
                return f"{client.address}: {client.dead}"
        return None

    @property
    def stats(self) -> SchedulerStats:
        """The engines' stats summed (KV usage averaged)."""
        all_stats = [c.stats for c in self.clients]
        summed = {
            name: sum(getattr(s, name) for s in all_stats)
            for name in SchedulerStats.__struct_fields__
            if name
            not in ("kv_cache_usage", "is_sleeping", "spec_decode_num_accepted_tokens_per_pos")
        }
        per_pos = [s.spec_decode_num_accepted_tokens_per_pos for s in all_stats]
        total = SchedulerStats(
            kv_cache_usage=sum(s.kv_cache_usage for s in all_stats) / len(all_stats),
            spec_decode_num_accepted_tokens_per_pos=[
                sum(p[i] for p in per_pos if i < len(p))
                for i in range(max(len(p) for p in per_pos))
            ],
            **summed,
        )
        # Sleep is commanded to all engines together.
        return msgspec.structs.replace(total, is_sleeping=all_stats[0].is_sleeping)

    @property
    def last_output_time(self) -> float:
        return min(c.last_output_time for c in self.clients)

    def load(self, index: int) -> int:
        """Requests on engine `index`: as it last reported, plus those sent since."""
        client = self.clients[index]
        if client.stats is not self._stats_seen[index]:
            self._stats_seen[index] = client.stats
            self._sent_since_stats[index] = 0
        return client.stats.num_running + client.stats.num_waiting + self._sent_since_stats[index]

    # ------------------------------------------------------------ requests

    async def add_request(
        self, request: AddRequest, handler: Callable[[RequestDelta | None], None]
    ) -> None:
        live = [i for i, c in enumerate(self.clients[: self.routable]) if c.dead is None]
        if not live:
            raise EngineDeadError(self.dead or "no engine core is available")
        index = min(live, key=self.load)
        self._owner[request.request_id] = index
        self._sent_since_stats[index] += 1
        self.num_routed[index] += 1

        def on_delta(delta: RequestDelta | None) -> None:
            if delta is None or delta.finish_reason is not None:
                self._owner.pop(request.request_id, None)
            handler(delta)

        try:
            await self.clients[index].add_request(request, on_delta)
        except BaseException:
            self._owner.pop(request.request_id, None)
            raise

    def forget(self, request_id: str) -> None:
        # The owner stays known: an abort may follow (AsyncLLM forgets, then aborts).
        index = self._owner.get(request_id)
        if index is not None:
            self.clients[index].forget(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._owner.pop(request_id, None)
            if index is not None:
                by_engine.setdefault(index, []).append(request_id)
        # One after another, not gathered in new tasks: aborts are sent from
        # cleanup code of cancelled requests, where a new task would be cancelled too.
        for index, ids in by_engine.items():
            await self.clients[index].abort(ids)

    async def call_utility(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Call on every engine; the answers folded by the call's `combine`."""
        results = await self.call_utility_all(method, *args, timeout=timeout, kwargs=kwargs)
        call = CONTROL_CALLS.get(method)
        if call is not None and call.combine == "sum":
            return self._sum_stats(results)
        return results[0]

    def _sum_stats(self, engines: list[dict[str, Any]]) -> dict[str, Any]:
        """The engines' integer statistics summed; each engine's own under "engines"."""
        totals = {
            key: sum(e[key] for e in engines)
            for key in engines[0]
            if all(isinstance(e.get(key), int) and not isinstance(e[key], bool) for e in engines)
        }
        return {**totals, "engines": engines, "num_routed": list(self.num_routed)}

    async def call_utility_all(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call on every engine; one answer per engine, in order."""
        return list(
            await asyncio.gather(
                *(
                    c.call_utility(method, *args, timeout=timeout, kwargs=kwargs)
                    for c in self.clients
                )
            )
        )

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))


def _check_same(first: Ready, other: Ready, address: str) -> None:
    if (other.model_name, other.max_model_len, other.vocab_size) != (
        first.model_name,
        first.max_model_len,
        first.vocab_size,
    ):
        raise EngineDeadError(
            f"the engine core at {address} serves {other.model_name} "
            f"(max_model_len {other.max_model_len}), not {first.model_name} "
            f"(max_model_len {first.max_model_len})"
        )
