"""A cache of what a GGUF file turns into: its config and dequantized weights.

Parsing a GGUF file's metadata (a 49k-token vocabulary) and dequantizing its
tensors take seconds; a server restart should not pay that again. The first
load writes `config.json` and `model.safetensors` (float32, exactly the
dequantized values; with the quantized blocks as stored, when the CPU
kernels use them, in `blocks.safetensors`) under
~/.cache/pagoda/gguf/<key>, keyed by the file's
path, size and mtime; later loads memory-map them. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pagoda.protocol.envs import cache_root

_VERSION = 2  # bump when what is cached changes meaning


def cache_dir_for(gguf_path: str) -> Path:
    stat = os.stat(gguf_path)
    key = f"{_VERSION}:{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache_root() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:16]


def load_cached_config(gguf_path: str) -> dict[str, Any] | None:
    file = cache_dir_for(gguf_path) / "config.json"
    try:
        return dict(json.loads(file.read_text()))
    except (OSError, ValueError):
        return None


def store_config(gguf_path: str, config: Any) -> None:
    directory = cache_dir_for(gguf_path)
    os.makedirs(directory, exist_ok=True)
    _atomic_write(directory / "config.json", json.dumps(dataclasses.asdict(config)).encode())


# The cached tensor files: the dequantized weights, and the quantized blocks
# as stored (pagoda.engine_core.loaders.gguf.load_gguf_blocks).
WEIGHTS_FILE = "model.safetensors"
BLOCKS_FILE = "blocks.safetensors"


def cached_weights_file(gguf_path: str, name: str = WEIGHTS_FILE) -> Path | None:
    file = cache_dir_for(gguf_path) / name
    return file if file.is_file() else None


def weights_file_to_write(gguf_path: str, name: str = WEIGHTS_FILE) -> Path:
    directory = cache_dir_for(gguf_path)
    os.makedirs(directory, exist_ok=True)
    return directory / name


def _atomic_write(target: Path, data: bytes) -> None:
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, target)
