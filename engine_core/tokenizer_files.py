"""Where a frontend finds the tokenizer of the model an engine serves.

An HF directory carries its own tokenizer files. For a GGUF file the
tokenizer, its special tokens and chat template live in the metadata: they
are converted once with transformers and cached under ~/.cache/pagoda
(never written next to the user's model).
"""

from __future__ import annotations

import hashlib
import logging
import os
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
