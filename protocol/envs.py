"""The environment variables Pagoda reads, all in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where derived files live: converted tokenizers, compiled kernels.

    PAGODA_CACHE_DIR, else $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda.
    """
    base = os.environ.get("PAGODA_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(xdg) / "pagoda"


def api_key_from_env() -> str | None:
    """PAGODA_API_KEY: the API key when --api-key is not given."""
    return os.environ.get("PAGODA_API_KEY") or None
