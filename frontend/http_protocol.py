"""uvicorn's HTTP/1.1 protocol with a deadline on reading request headers.

uvicorn closes idle keep-alive connections but never times out a request
whose headers are still arriving: a client that sends half a request line,
random bytes without a line end, or trickles its headers one byte at a time
holds its connection (and its file descriptor) for ever. This protocol
answers 408 and closes the connection when a request's headers are not
complete `header_timeout` seconds after the connection opened or the
previous response ended. Bodies are not covered (routes read them under the
body size limit of frontend/api/body_guard.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_BODY = b"Request headers took too long."
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol that closes connections whose request headers never complete."""

    header_timeout: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        # Headers are in once h11 has moved past IDLE for the client's side.
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A keep-alive connection waits for the next request's headers; the
        # keep-alive timer covers the silence, this one a request left half sent.
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.logger.warning("request headers incomplete after %.1f s: closed", self.header_timeout)
        self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def header_timeout_protocol(header_timeout: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn.Config(http=...) with this deadline."""
    return type(
        "HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": header_timeout}
    )
