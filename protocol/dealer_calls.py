"""Request and answer over ZeroMQ DEALER sockets, one per endpoint. Imports no torch.

The KV connector's calls (a consumer engine asking a producer's side
channel, a consumer rank reading a producer rank's blocks) send a msgpack
object with a `seq` number; the answer's first frame is a msgpack object
carrying the same `seq`, any further frames are payload. An answer older
than the call (one that came after its caller gave up) is skipped; a call
not answered in time drops its socket, so that a late answer is never read.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from pagoda.protocol.curve import secure_client


class DealerCalls:
    """Numbered calls to several endpoints (CURVE clients with `curve_dir`)."""

    def __init__(self, curve_dir: str | None = None) -> None:
        self._curve_dir = curve_dir
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._socks: dict[str, zmq.Socket[Any]] = {}
        self._seq = 0

    def call(
        self, endpoint: str, message: dict[str, Any], timeout_s: float
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """Send `message` (with a fresh `seq`); the answer's decoded first frame
        and all its frames. TimeoutError when it does not come in time."""
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            if self._curve_dir:
                secure_client([sock], self._curve_dir)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        self._seq += 1
        seq = self._seq
        sock.send(msgspec.msgpack.encode({**message, "seq": seq}))
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                self._socks.pop(endpoint).close(0)
                raise TimeoutError(f"{endpoint} did not answer within {timeout_s:g} s")
            frames = sock.recv_multipart(copy=False)
            header = msgspec.msgpack.decode(frames[0].bytes)
            if header.get("seq") == seq:
                return header, frames

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
        self._ctx.term()
