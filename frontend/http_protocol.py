"""uvicorn's HTTP/1.1 protocol with deadlines on reading a request.

uvicorn closes idle keep-alive connections but never times out a request
that is still arriving: a client that sends half a request line, random
bytes without a line end, or trickles its headers or its body one byte at a
time holds its connection (and its file descriptor, and for a body the
route waiting on it) for ever. This protocol answers 408 and closes the
connection when a request's headers are not complete `header_timeout`
seconds after the connection opened or the previous response ended, or its
body is not complete `body_timeout` seconds after its headers were. (The
body's size limit is frontend/api/body_guard.py's.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _timeout_response(text: bytes) -> bytes:
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text)
    )


_HEADERS_TOO_SLOW = _timeout_response(b"Request headers took too long.")
_BODY_TOO_SLOW = _timeout_response(b"Request body took too long.")


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol that closes connections whose request never completes."""

    header_timeout: float = 10.0
    body_timeout: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        self._disarm_body_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        state = self.conn.their_state
        # Headers are in once h11 has moved past IDLE for the client's side;
        # the body is in once it has moved past SEND_BODY.
        if state is not h11.IDLE:
            self._disarm_header_deadline()
        if state is h11.SEND_BODY:
            if self._body_deadline is None:
                self._body_deadline = self.loop.call_later(self.body_timeout, self._body_too_slow)
        else:
            self._disarm_body_deadline()

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

    def _disarm_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.logger.warning("request headers incomplete after %.1f s: closed", self.header_timeout)
        self.transport.write(_HEADERS_TOO_SLOW)
        self.transport.close()

    def _body_too_slow(self) -> None:
        self._body_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        self.logger.warning("request body incomplete after %.1f s: closed", self.body_timeout)
        # The route is still waiting for the body, so nothing has been answered
        # yet; closing the transport hands it a disconnect.
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(_BODY_TOO_SLOW)
        self.transport.close()


def header_timeout_protocol(
    header_timeout: float, body_timeout: float = 60.0
) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn.Config(http=...) with these deadlines."""
    return type(
        "HeaderTimeoutProtocol",
        (HeaderTimeoutProtocol,),
        {"header_timeout": header_timeout, "body_timeout": body_timeout},
    )
