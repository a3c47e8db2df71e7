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


def dp_addresses(base: str, size: int) -> list[str]:
    """Addresses of `size` data-parallel engine cores named after `base`.

    ipc: base, base-dp1, base-dp2 ...; tcp: each engine takes two ports, so
    the i-th starts at port + 2 i.
    """
    if size == 1:
        return [base]
    if base.startswith("tcp://"):
        host, _, port = base[len("tcp://") :].rpartition(":")
        return [f"tcp://{host}:{int(port) + 2 * i}" for i in range(size)]
    split_address(base)  # checks the form
    return [base] + [f"{base}-dp{i}" for i in range(1, size)]
