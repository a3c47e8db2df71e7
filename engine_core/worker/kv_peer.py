"""The PeerConnector's worker side: a rank serves KV blocks to decode engines
and pulls a producer's blocks into its own cache (core/kv_connector.py is
the scheduler side).

Each rank of a producer runs a `KVServer` thread: a ZeroMQ ROUTER socket
(tcp; CURVE when the connector names a key directory) that answers
`{"seq", "block_ids"}` with a header frame (`seq`, layers, dtype, block
shape) and then each layer's key blocks and value blocks, one frame each,
sent without copies. The producer's scheduler holds those blocks until the
consumer says it is done with them (or a timeout passes), so nothing writes
them while they are read. A consumer rank pulls from the same rank of the
producer (the TP sizes must match: each rank holds its KV heads) and writes
the frames into its own blocks; a header that does not match its own cache
(another model, dtype or block size) is an error, never a silent copy.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import zmq

from pagoda.protocol.curve import secure_server
from pagoda.protocol.dealer_calls import DealerCalls

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def _layout(kv_caches: KVCaches) -> dict[str, Any]:
    k = kv_caches[0][0]
    return {"layers": len(kv_caches), "dtype": str(k.dtype), "block_shape": list(k.shape[1:])}


class KVServer:
    """Answers block reads from one rank's KV cache on a thread of its own."""

    def __init__(
        self,
        caches: Callable[[], KVCaches],
        host: str,
        port: int,
        advertise_host: str,
        curve_dir: str | None,
    ) -> None:
        self._caches = caches
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._auth = secure_server(self._ctx, [self._sock], curve_dir) if curve_dir else None
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertise_host}:{port}"
        self.num_reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            ident, payload = self._sock.recv_multipart()
            seq = None
            try:
                message = decoder.decode(payload)
                seq = message.get("seq")
                frames = self._read(message["block_ids"], seq)
            except Exception as e:  # a bad read answers an error, the thread serves on
                frames = [msgspec.msgpack.encode({"seq": seq, "error": str(e) or repr(e)})]
            self._sock.send_multipart([ident, *frames], copy=False)

    @torch.inference_mode()
    def _read(self, block_ids: list[int], seq: Any) -> list[Any]:
        kv_caches = self._caches()
        if not kv_caches:
            raise RuntimeError("this rank has no KV cache (asleep?)")
        num_blocks = kv_caches[0][0].shape[0]
        if any(not isinstance(b, int) or not 0 <= b < num_blocks for b in block_ids):
            raise ValueError(f"block ids must be in [0, {num_blocks})")
        index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
        frames: list[Any] = [msgspec.msgpack.encode({"seq": seq, **_layout(kv_caches)})]
        for k, v in kv_caches:
            for cache in (k, v):
                blocks = cache.index_select(0, index).cpu().contiguous()
                frames.append(blocks.reshape(-1).view(torch.uint8).numpy())
        self.num_reads += 1
        return frames

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


class KVPuller:
    """Pulls blocks from producers' KVServers into one rank's cache."""

    def __init__(self, curve_dir: str | None) -> None:
        self._calls = DealerCalls(curve_dir)

    @torch.inference_mode()
    def pull(
        self,
        kv_caches: KVCaches,
        endpoint: str,
        remote_ids: list[int],
        local_ids: list[int],
        timeout_s: float,
    ) -> int:
        """Copy the producer's `remote_ids` blocks into `local_ids`; returns bytes moved."""
        if len(remote_ids) != len(local_ids):
            raise ValueError("remote and local block lists differ in length")
        if not remote_ids:
            return 0
        try:
            header, frames = self._calls.call(endpoint, {"block_ids": remote_ids}, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no KV blocks from {endpoint} within {timeout_s:g} s") from None
        if "error" in header:
            raise RuntimeError(f"the producer refused the read: {header['error']}")
        mine = _layout(kv_caches)
        if {k: header.get(k) for k in mine} != mine:
            theirs = {k: header.get(k) for k in mine}
            raise ValueError(f"the producer's KV layout {theirs} differs from this engine's {mine}")
        if len(frames) != 1 + 2 * len(kv_caches):
            raise RuntimeError("the producer sent a malformed KV reply")
        index = torch.tensor(local_ids, dtype=torch.long, device=kv_caches[0][0].device)
        moved = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about read-only frames
            for i, (k, v) in enumerate(kv_caches):
                for j, cache in enumerate((k, v)):
                    frame = frames[1 + 2 * i + j]
                    shape = (len(local_ids), *cache.shape[1:])
                    blocks = torch.frombuffer(frame.buffer, dtype=cache.dtype).view(shape)
                    cache.index_copy_(0, index, blocks.to(cache.device))
                    moved += len(frame.buffer)
        return moved

    def close(self) -> None:
        self._calls.close()
