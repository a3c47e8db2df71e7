"""Child processes that die with the engine core (grammar compiles, workers)."""

from __future__ import annotations

import os
import signal


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies, even by kill -9."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
