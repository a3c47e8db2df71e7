"""KV connectors (`--kv-transfer-config`) and the PeerConnector's scheduler side.

Imports no torch. vLLM's JSON configures a connector: `{"kv_connector":
NAME, "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_ip",
"kv_port", "kv_connector_extra_config": {...}}`. Two exist:
`OffloadingConnector` (a host-memory tier for prefix blocks,
core/kv_offload.py) and `PeerConnector`, which moves a prompt's KV from a
prefill engine (the producer) to a decode engine (the consumer), pulled by
the consumer as NIXL does, over ZeroMQ.

The producer: a request sent with `kv_transfer_params: {"do_remote_decode":
true}` keeps its blocks when it finishes (vLLM's `request_finished` with a
delayed free), and its last delta carries what a consumer needs:
`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`,
`remote_host`, `remote_port`, `remote_request_id`. A side channel (a
ROUTER socket on a thread of its own at kv_ip:kv_port, CURVE with a key
directory) answers a consumer's "take" (the blocks, every rank's data
endpoint, after checking the consumer's prompt is the one prefilled; the
hold is renewed) and "done" (the blocks are freed at the next step).
Blocks nobody releases within `timeout_s` are freed anyway.

The consumer: a request with `do_remote_prefill` and the producer's fields.
Before it is first scheduled the engine allocates its blocks (local prefix
hits first, vLLM's `get_num_new_matched_tokens`), takes the rest from the
producer, has every rank pull its part from the same rank of the producer
(worker/kv_peer.py; the TP sizes must match), says "done", and the request
computes only its last prompt token. Any failure (producer gone or slow,
blocks expired, another prompt, another layout) falls back to computing the
prompt here, visibly: the last delta says `"kv_transfer": "recomputed"`
with the reason, and the `kv_recomputed` counter counts it.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from pagoda.protocol.curve import secure_server
from pagoda.protocol.dealer_calls import DealerCalls

CONNECTORS = ("OffloadingConnector", "PeerConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """--kv-transfer-config, checked."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(text: str | None) -> KVTransferConfig | None:
    """The config, or None without one; a bad one is a clear error at start."""
    if text is None:
        return None
    try:
        config: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    name = config.get("kv_connector")
    if name not in CONNECTORS:
        raise ValueError(f"KV connector {name!r} is not available; choose from {list(CONNECTORS)}")
    role = config.get("kv_role", "kv_both")
    if role not in ROLES:
        raise ValueError(f"kv_role must be one of {list(ROLES)}, not {role!r}")
    port = config.get("kv_port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError("kv_port must be an integer port (0: any free port)")
    ip = config.get("kv_ip", "127.0.0.1")
    if not isinstance(ip, str) or not ip:
        raise ValueError("kv_ip must be a host name or address")
    extra = config.get("kv_connector_extra_config")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    return KVTransferConfig(name, role, ip, port, extra)


class KVTransferError(Exception):
    """A transfer that cannot happen; the request is computed here instead."""


def prompt_digest(token_ids: list[int]) -> str:
    """Names a prompt across processes (Python's hash() is salted per process)."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:32]


def remote_prefill_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """The producer's fields of a `do_remote_prefill` request, checked (None: not one)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    for key, kind in (("remote_host", str), ("remote_port", int), ("remote_request_id", str)):
        value = params.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"kv_transfer_params.{key} is missing or not a {kind.__name__}")
    return params


@dataclass
class _Held:
    """A finished request's blocks, kept for a consumer to pull."""

    block_ids: list[int]
    num_tokens: int
    digest: str
    deadline: float


@dataclass
class PeerStats:
    transfers: int = 0
    transfer_tokens: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    recomputed: int = 0
    served: int = 0
    expired: int = 0


class PeerConnector:
    """The scheduler side of KV transfers between engines (see the module doc)."""

    def __init__(
        self,
        config: KVTransferConfig,
        engine_id: str,
        block_size: int,
        world_size: int,
        data_endpoints: list[str],
    ) -> None:
        extra = config.extra
        timeout = _seconds(extra, "timeout_s", 120.0)
        self.pull_timeout_s = _seconds(extra, "pull_timeout_s", 30.0)
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.world_size = world_size
        self.data_endpoints = data_endpoints
        self.timeout_s = timeout
        self.curve_dir: str | None = extra.get("curve_keys")
        self.advertise_host = advertised_host(config)
        self.stats = PeerStats()
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._released: list[str] = []
        self._next_id = 0
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._calls = DealerCalls(self.curve_dir)  # a consumer's side-channel calls
        self._auth: Any = None
        self._stop = threading.Event()
        self.side_port = 0
        if config.is_producer:
            self._server = self._ctx.socket(zmq.ROUTER)
            self._server.linger = 0
            if self.curve_dir:
                self._auth = secure_server(self._ctx, [self._server], self.curve_dir)
            if config.kv_port:
                self._server.bind(f"tcp://{config.kv_ip}:{config.kv_port}")
                self.side_port = config.kv_port
            else:
                self.side_port = self._server.bind_to_random_port(f"tcp://{config.kv_ip}")
            self._thread = threading.Thread(target=self._serve, name="kv-side", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ producer

    def request_finished(
        self, request_id: str, token_ids: list[int], block_ids: list[int]
    ) -> tuple[str, dict[str, Any]]:
        """Hold a finished request's blocks; (hold key, the params for a consumer)."""
        with self._lock:
            self._next_id += 1
            key = f"{self.engine_id}-{self._next_id}"
            self._held[key] = _Held(
                list(block_ids),
                len(token_ids),
                prompt_digest(token_ids),
                time.monotonic() + self.timeout_s,
            )
        return key, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": list(block_ids),
            "remote_host": self.advertise_host,
            "remote_port": self.side_port,
            "remote_request_id": key,
            "tp_size": self.world_size,
        }

    def take_released(self) -> list[str]:
        """Holds to free now: released by their consumer, or past the timeout."""
        now = time.monotonic()
        with self._lock:
            expired = [key for key, held in self._held.items() if held.deadline < now]
            for key in expired:
                del self._held[key]
            self.stats.expired += len(expired)
            released, self._released = self._released, []
        return released + expired

    def drop_held(self) -> list[str]:
        """Forget every hold (the KV cache is going away); their keys, to free."""
        with self._lock:
            keys = list(self._held) + self._released
            self._held.clear()
            self._released = []
        return keys

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        while not self._stop.is_set():
            if not self._server.poll(100):
                continue
            ident, payload = self._server.recv_multipart()
            try:
                message = decoder.decode(payload)
                reply = self._answer(message)
            except Exception as e:  # a malformed call answers an error
                message, reply = {}, {"error": f"bad side-channel call: {e}"}
            reply["seq"] = message.get("seq") if isinstance(message, dict) else None
            self._server.send_multipart([ident, msgspec.msgpack.encode(reply)])

    def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        key = message.get("remote_request_id")
        with self._lock:
            held = self._held.get(key)  # type: ignore[arg-type]
            if held is None:
                return {"error": f"no KV held for {key!r} (expired or already taken)"}
            if message.get("op") == "done":
                del self._held[key]  # type: ignore[arg-type]
                self._released.append(key)  # type: ignore[arg-type]
                self.stats.served += 1
                return {"ok": True}
            if message.get("op") != "take":
                return {"error": f"unknown side-channel op {message.get('op')!r}"}
            if message.get("block_size") != self.block_size:
                return {
                    "error": f"block size {message.get('block_size')} differs from "
                    f"the producer's {self.block_size}"
                }
            if message.get("digest") != held.digest:
                return {"error": "the prompt differs from the one the producer prefilled"}
            held.deadline = time.monotonic() + self.timeout_s
            return {
                "ok": True,
                "block_ids": held.block_ids,
                "num_tokens": held.num_tokens,
                "endpoints": self.data_endpoints,
            }

    # ------------------------------------------------------------ consumer

    def call(self, params: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
        """One side-channel call to the producer named by `params`; its answer."""
        endpoint = f"tcp://{params['remote_host']}:{params['remote_port']}"
        try:
            reply, _ = self._calls.call(endpoint, message, min(self.timeout_s, 10.0))
        except TimeoutError:
            raise KVTransferError(f"the producer at {endpoint} did not answer") from None
        if "error" in reply:
            raise KVTransferError(reply["error"])
        return reply

    def close(self) -> None:
        self._stop.set()
        if self.config.is_producer:
            self._thread.join(timeout=2)
            self._server.close(0)
        self._calls.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def _seconds(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"kv_connector_extra_config.{key} must be a positive number of seconds")
    return float(value)


def advertised_host(config: KVTransferConfig) -> str:
    """The host consumers reach this engine at: `advertise_host`, else kv_ip
    (a wildcard bind advertises the host name)."""
    host = config.extra.get("advertise_host")
    if isinstance(host, str) and host:
        return host
    if config.kv_ip in ("0.0.0.0", "*", "::"):
        return socket.getfqdn()
    return config.kv_ip
