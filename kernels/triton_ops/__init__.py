"""Triton kernels for the CUDA path: paged attention and the hot elementwise ops.

One module per op, each with a launcher that checks shapes, strides and
dtypes (ValueError on anything it cannot run) and a plain-torch reference in
`reference.py`. On a machine without CUDA the kernels run in Triton's
interpreter when TRITON_INTERPRET=1 is set before triton is imported; that is
how the tests check them on the CPU.

Importing this package does not import triton; `triton_available()` says
whether the op modules can be imported.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Whether triton is installed (the op modules import it at load)."""
    return importlib.util.find_spec("triton") is not None
