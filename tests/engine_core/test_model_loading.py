"""A model that cannot be loaded fails with ModelLoadError naming the file."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.model_config import ModelLoadError
from tests.engine_core.helpers import NUM_THREADS


def load(model: Path | str) -> EngineCore:
    config = EngineConfig(
        model=str(model), dtype="float32", kv_cache_memory_bytes=1 << 20, num_threads=NUM_THREADS
    )
    return EngineCore(config)


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match=re.escape(str(missing))):
        load(missing)


def test_directory_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json") as info:
        load(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_config_json_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path / "config.json"))):
        load(tmp_path)


def test_unsupported_architecture(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    model = copy_model(tiny_models["llama"], tmp_path / "gpt2")
    config_file = model / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as info:
        load(model)
    assert str(config_file) in str(info.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tmp_path: Path, tiny_models: dict[str, Path], damage: str) -> None:
    model = copy_model(tiny_models["llama"], tmp_path / "broken")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x00\xff" * 64 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=re.escape(str(weights))):
        load(model)


def test_missing_weight(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    model = copy_model(tiny_models["llama"], tmp_path / "incomplete")
    weights = model / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.1.down_proj.weight") as info:
        load(model)
    assert str(model) in str(info.value)


def test_corrupt_gguf(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x01" * 100)
    with pytest.raises(ModelLoadError, match=re.escape(str(broken))):
        load(broken)


def test_gguf_tokenizer_converts_from_a_checkout_root(tmp_path: Path) -> None:
    """`python -c` / `python -m` in the repository root put the root on
    sys.path, where the folder kernels/ could stand in for Hugging Face's
    `kernels` that transformers' GGUF conversion imports: the conversion,
    into an empty cache, must still work there."""
    root = Path(__file__).resolve().parents[2]
    code = (
        "from pagoda.engine_core.model_config import resolve_model_path\n"
        "from pagoda.engine_core.tokenizer_files import tokenizer_dir_for\n"
        "print(tokenizer_dir_for(resolve_model_path(None)))\n"
    )
    env = {**os.environ, "PAGODA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (Path(done.stdout.strip()) / "tokenizer.json").is_file()
