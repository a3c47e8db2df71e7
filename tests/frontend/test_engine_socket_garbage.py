"""Garbage sent straight to the engine core's input socket with a raw ZeroMQ DEALER.

Malformed, truncated, oversized and wrong-type frames and a wrong protocol
version are dropped (or answered with an error) with a log line; the engine
keeps serving the real API server's clients throughout.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import msgspec
import zmq

from pagoda.protocol.addresses import split_address
from pagoda.protocol.messages import (
    PROTOCOL_VERSION,
    AddRequest,
    Hello,
    UtilityCall,
    make_frontend_codec,
)
from pagoda.protocol.sampling_params import SamplingParams
from tests.frontend.conftest import Server

_enc = msgspec.msgpack.Encoder()


def _garbage() -> list[list[bytes]]:
    valid_add = _enc.encode(
        AddRequest("raw-ok", [1, 2, 3], SamplingParams(max_tokens=2), time.time())
    )
    return [
        [b""],
        [b"\x00\xff\xfe garbage"],
        [valid_add[: len(valid_add) // 2]],  # truncated
        [b"\xc1"],  # a byte msgpack never uses
        [_enc.encode({"type": "add"})],  # the right tag, no fields
        [_enc.encode({"type": "add", "request_id": 7, "prompt_token_ids": "x"})],
        [_enc.encode({"type": "no-such-message"})],
        [_enc.encode([1, 2, 3])],
        [_enc.encode({"type": "abort", "request_ids": [None, 3]})],
        [_enc.encode({"type": "utility", "call_id": "x", "method": 5})],
        [b"\x92" * 1000],  # nested arrays, truncated
        [b"\xdd\xff\xff\xff\xff"],  # an array header claiming 4 G items
        [b"x" * (32 << 20)],  # 32 MB of nothing
        [valid_add, b"extra frame"],  # a valid message with an extra frame
        [b"a", b"b", b"c"],
    ]


def _semantic_garbage() -> list[bytes]:
    """Well-typed messages with values no request may have: each gets an error back."""
    sp = SamplingParams
    now = time.time()
    return [
        _enc.encode(AddRequest("raw-oov", [10**9], sp(max_tokens=2), now)),
        _enc.encode(AddRequest("raw-neg", [-1], sp(max_tokens=2), now)),
        _enc.encode(AddRequest("raw-empty", [], sp(max_tokens=2), now)),
        _enc.encode(AddRequest("raw-long", [1] * 5000, sp(max_tokens=2), now)),
        _enc.encode(AddRequest("raw-n", [1], sp(n=0), now)),
        _enc.encode(AddRequest("raw-temp", [1], sp(temperature=float("nan")), now)),
        _enc.encode(AddRequest("raw-bias", [1], sp(logit_bias={10**9: 1.0}), now)),
    ]


def _completion_works(server: Server) -> None:
    r = httpx.post(server.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text[:300]


def _engine_log(server: Server) -> str:
    log: Path = server.procs.logs[0]
    return log.read_text(errors="replace")


def test_garbage_frames_are_dropped_and_engine_keeps_serving(server: Server) -> None:
    in_addr, _ = split_address(server.address)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"raw-garbage")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(in_addr)
    try:
        before = _engine_log(server).count("dropped")
        garbage = _garbage()
        for frames in garbage:
            sock.send_multipart(frames)
        _completion_works(server)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if _engine_log(server).count("dropped") - before >= len(garbage) - 1:
                break
            time.sleep(0.2)
        # One log line per dropped message (the 2-frame valid message counts too).
        assert _engine_log(server).count("dropped") - before >= len(garbage) - 1
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        _completion_works(server)
    finally:
        sock.close()
        ctx.term()


def test_bad_values_and_wrong_protocol_version_get_errors(server: Server) -> None:
    in_addr, out_addr = split_address(server.address)
    identity = b"raw-values"
    ctx = zmq.Context()
    out = ctx.socket(zmq.DEALER)
    out.setsockopt(zmq.IDENTITY, identity)
    out.setsockopt(zmq.LINGER, 0)
    out.connect(out_addr)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(in_addr)
    encoder, _ = make_frontend_codec()
    try:
        time.sleep(0.3)  # let the output socket connect before the engine answers
        sock.send(encoder.encode(Hello("raw-values", PROTOCOL_VERSION + 99)))
        bad = _semantic_garbage()
        for payload in bad:
            sock.send(payload)
        sock.send(encoder.encode(UtilityCall(1, "no_such_method")))
        ready = None
        errors: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (ready is None or len(errors) < len(bad)):
            if not out.poll(500):
                continue
            msg = msgspec.msgpack.decode(out.recv())
            if msg.get("type") == "ready":
                ready = msg
            elif msg.get("type") == "outputs":
                for delta in msg["deltas"]:
                    # RequestDelta is array-like: [request_id, new_token_ids, finish_reason, ...]
                    if delta[2] == "error":
                        errors[delta[0]] = delta
        assert ready is not None and "protocol version mismatch" in (ready["error"] or "")
        assert set(errors) == {
            "raw-oov",
            "raw-neg",
            "raw-empty",
            "raw-long",
            "raw-n",
            "raw-temp",
            "raw-bias",
        }  # noqa: E501
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        _completion_works(server)
    finally:
        sock.close()
        out.close()
        ctx.term()
