"""Grammar compiles in a child process, so that a runaway compile can be killed.

xgrammar's compile cannot be interrupted: a schema built to blow up keeps a
thread busy (and its memory growing) for minutes. Compiling in a child
process bounds both: at the deadline the engine kills the child, which frees
its CPU and memory at once, and carries on with a fresh one.

The wire, over the child's stdin/stdout, is length-prefixed frames (4 bytes
big-endian + payload) and never pickle:
- parent → child: one StructuredOutputsParams, msgpack-encoded (typed decode);
- child → parent: first an empty "ready" frame, then per job one status byte
  (0: the CompiledGrammar's serialize_json(), 1: an error message) + UTF-8.

Run as `python -m pagoda.engine_core.structured_output.grammar_worker
PARENT_PID TOKENIZER_DIR VOCAB_SIZE STOP_IDS`.
"""

from __future__ import annotations

import os
import select
import struct
import subprocess
import sys
import time
from typing import IO

import msgspec

from pagoda.engine_core.lifetime import die_with_parent
from pagoda.protocol.sampling_params import StructuredOutputsParams

_LEN = struct.Struct(">I")
_OK, _ERROR = 0, 1


class WorkerDied(RuntimeError):
    """The child exited (or closed its pipe) before it answered."""


class WorkerTimeout(TimeoutError):
    """The child did not answer by the deadline."""


class GrammarWorker:
    """One compile child process, seen from the engine."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        argv = [
            sys.executable,
            "-m",
            "pagoda.engine_core.structured_output.grammar_worker",
            str(os.getpid()),
            tokenizer_path,
            str(vocab_size),
            ",".join(str(t) for t in stop_token_ids),
        ]
        # stderr is the engine's: xgrammar's own log lines land in the engine log.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.started_at = time.monotonic()
        self._buf = bytearray()
        self.ready = False

    def wait_ready(self, deadline: float) -> None:
        """Block until the child has its compiler (raises WorkerTimeout / WorkerDied)."""
        if not self.ready:
            self._read_frame(deadline)
            self.ready = True

    def compile(self, params: StructuredOutputsParams, deadline: float) -> tuple[bool, str]:
        """(True, serialized grammar) or (False, error message) from the child."""
        self.wait_ready(deadline)
        assert self.proc.stdin is not None
        try:
            _write_frame(self.proc.stdin, msgspec.msgpack.encode(params))
        except (BrokenPipeError, OSError) as e:
            raise WorkerDied(f"grammar worker pipe closed: {e}") from None
        reply = self._read_frame(deadline)
        if not reply:
            raise WorkerDied("grammar worker sent an empty reply")
        return reply[0] == _OK, reply[1:].decode("utf-8", errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass

    def _read_frame(self, deadline: float) -> bytes:
        assert self.proc.stdout is not None
        try:
            fd = self.proc.stdout.fileno()
        except ValueError:  # closed by kill()
            raise WorkerDied("grammar worker was killed") from None
        while True:
            if len(self._buf) >= _LEN.size:
                (size,) = _LEN.unpack_from(self._buf)
                if len(self._buf) >= _LEN.size + size:
                    frame = bytes(self._buf[_LEN.size : _LEN.size + size])
                    del self._buf[: _LEN.size + size]
                    return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout("grammar worker did not answer in time")
            try:
                readable, _, _ = select.select([fd], [], [], remaining)
                chunk = os.read(fd, 1 << 20) if readable else None
            except (OSError, ValueError) as e:  # the pipe was closed by kill() (shutdown)
                raise WorkerDied(f"grammar worker pipe closed: {e}") from None
            if chunk is None:
                continue
            if not chunk:
                raise WorkerDied(f"grammar worker exited (status {self.proc.poll()})")
            self._buf += chunk


def _write_frame(pipe: IO[bytes], payload: bytes) -> None:
    pipe.write(_LEN.pack(len(payload)) + payload)
    pipe.flush()


def _read_exact(pipe: IO[bytes], n: int) -> bytes | None:
    data = pipe.read(n)
    return data if data is not None and len(data) == n else None


def main(argv: list[str]) -> int:
    parent_pid, tokenizer_path, vocab_size, stop_ids = argv
    die_with_parent(int(parent_pid))
    # Frames go out on a private copy of stdout; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer

    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    from pagoda.engine_core.structured_output.grammar_compile import compile_with, describe_error

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_path)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer,
        vocab_size=int(vocab_size),
        stop_token_ids=[int(t) for t in stop_ids.split(",") if t],
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write_frame(out, b"")
    decoder = msgspec.msgpack.Decoder(StructuredOutputsParams)
    while True:
        header = _read_exact(inp, _LEN.size)
        if header is None:
            return 0  # the engine closed the pipe: it is shutting down
        payload = _read_exact(inp, _LEN.unpack(header)[0])
        if payload is None:
            return 0
        params = decoder.decode(payload)
        try:
            reply = bytes([_OK]) + compile_with(compiler, params).serialize_json().encode()
        except Exception as e:  # noqa: BLE001 - every compile error goes back to its request
            reply = bytes([_ERROR]) + describe_error(params.kind, e).encode()
        _write_frame(out, reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
