"""Socket addresses of an engine core. Imports no torch (frontends use it).

An engine core is named by one base address; it binds two sockets derived
from it: one for requests in, one for outputs out.
- ipc:///dir/engine  → ipc:///dir/engine.in, ipc:///dir/engine.out
- tcp://host:port    → tcp://host:port, tcp://host:(port + 1)
"""

from __future__ import annotations

import os
import tempfile


def split_address(base: str) -> tuple[str, str]:
    """(input address, output address) of the engine named by `base`."""
    if base.startswith("ipc://"):
        return base + ".in", base + ".out"
    if base.startswith("tcp://"):
        host, sep, port = base[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"a tcp address needs a port: {base!r}")
        return f"tcp://{host}:{port}", f"tcp://{host}:{int(port) + 1}"
    raise ValueError(f"engine addresses start with ipc:// or tcp://, got {base!r}")


def default_ipc_address() -> str:
    """A fresh ipc address in a private (0700) runtime directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    directory = tempfile.mkdtemp(
        prefix="pagoda-", dir=runtime if runtime and os.path.isdir(runtime) else None
    )
    os.chmod(directory, 0o700)
    return f"ipc://{directory}/engine"


def is_unprotected_tcp(base: str) -> bool:
    """A tcp address reachable beyond this host: its sockets have no authentication."""
    if not base.startswith("tcp://"):
        return False
    host = base[len("tcp://") :].rpartition(":")[0].strip("[]")
    return host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127.")
