"""Where a frontend finds the tokenizer of the model an engine serves.

An HF directory carries its own tokenizer files. For a GGUF file the
tokenizer, its special tokens and chat template live in the metadata: they
are converted once with transformers and cached under ~/.cache/pagoda
(never written next to the user's model).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
from pathlib import Path

from pagoda.engine_core.model_config import ModelLoadError
from pagoda.protocol.envs import cache_root

logger = logging.getLogger(__name__)


def tokenizer_dir_for(model_path: str) -> str:
    """A directory holding tokenizer.json (+ config and chat template)."""
    if not model_path.endswith(".gguf"):
        return model_path
    stat = os.stat(model_path)
    fingerprint = f"{model_path}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    target = cache_root() / "tokenizers" / key
    if (target / "tokenizer.json").is_file():
        return str(target)
    logger.info("converting the GGUF tokenizer of %s into %s", model_path, target)
    prefer_hf_kernels()
    from transformers import AutoTokenizer

    path = Path(model_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers raises many types
        raise ModelLoadError(
            f"{model_path}: cannot read the tokenizer from GGUF metadata: {e}"
        ) from e
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(str(tmp))
    os.makedirs(target.parent, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:
        pass  # another process won the race; its copy is identical
    return str(target)


def prefer_hf_kernels() -> None:
    """Started from a checkout with `python -m` or `python -c` (or under
    pytest), the checkout's root is on sys.path, and its folder kernels/
    (imported as pagoda.kernels) would stand in for Hugging Face's `kernels`
    package, which transformers' modeling code (the GGUF conversion among
    it) imports. Load theirs first, from the other entries, so `import
    kernels` finds it in sys.modules. Installed from a wheel, nothing is
    shadowed and this does nothing."""
    root = Path(__file__).resolve().parents[1]  # the folder holding kernels/
    if "kernels" in sys.modules or not (root / "kernels").is_dir():
        return
    on_path = [p for p in sys.path if Path(p or ".").resolve() == root]
    if not on_path:
        return
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if p not in on_path]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # transformers older than 5.25 does without it
    finally:
        sys.path[:] = saved
