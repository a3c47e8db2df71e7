"""Generation requests in flight in one API server: counted, capped, drained.

GET /load reports the count (vLLM's server load tracking); a streamed
response counts until its last event is sent. `--max-inflight-requests`
refuses work beyond the cap with a 503 before it reaches the engine. On
SIGTERM `drain` refuses new work (the draining middleware reads `draining`),
waits for what runs, then aborts the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Response
from fastapi.responses import StreamingResponse

from pagoda.frontend.api.common import as_api_error, unavailable
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.async_llm import AsyncLLM

Work = Callable[[], Awaitable[Any]]


async def guarded(work: Work) -> Any:
    """Run a handler's work; any failure becomes a response in the API's error shape."""
    try:
        return await work()
    except Exception as e:  # noqa: BLE001 - every failure gets the API's error shape
        return as_api_error(e).response()


class InFlight:
    """Counts the generation requests of one API server and drains them on shutdown."""

    def __init__(self, engine: AsyncLLM, limit: int | None) -> None:
        self.engine = engine
        self.limit = limit
        self.count = 0
        self.draining = False
        # Why new generation requests are refused for now (an elastic scale
        # running), or None.
        self.refusal: Callable[[], str | None] = lambda: None

    async def counted(
        self, work: Work, shape: Callable[[APIError], Response] = APIError.response
    ) -> Any:
        """Run `work` as one in-flight request; `shape` renders a refusal in the
        route's own error format."""
        reason = self.refusal()
        if reason is not None:
            return shape(unavailable(reason))
        if self.limit is not None and self.count >= self.limit:
            return shape(
                unavailable(
                    f"the server is overloaded: {self.limit} requests are in flight; retry later"
                )
            )
        self.count += 1
        handed_off = False
        try:
            result = await guarded(work)
            if isinstance(result, StreamingResponse):
                result.body_iterator = self._count_until_done(result.body_iterator)
                handed_off = True
            return result
        finally:
            if not handed_off:
                self.count -= 1

    async def _count_until_done(self, body: AsyncIterable[Any]) -> AsyncIterator[Any]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            self.count -= 1

    async def drain(self, timeout: float) -> int:
        """Refuse new requests (503), let in-flight ones finish up to `timeout`, abort the rest.

        Returns how many requests were aborted.
        """
        self.draining = True
        deadline = time.monotonic() + timeout
        while (self.count or self.engine.num_active) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        aborted = await self.engine.abort_all()
        # Let the aborted responses be written before the server closes connections.
        deadline = time.monotonic() + 2.0
        while self.count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return aborted
