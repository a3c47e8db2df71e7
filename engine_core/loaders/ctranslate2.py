"""CTranslate2 model directories (`model.bin`): Whisper's tensors under Hugging Face names.

The format, as CTranslate2 writes it (binary version 6; little-endian):

    uint32   binary version
    string   spec name ("WhisperSpec")
    uint32   spec revision
    uint32   number of variables, then for each:
        string   name ("encoder/layer_0/self_attention/linear_0/weight")
        uint8    rank, then rank x uint32 dims
        uint8    dtype: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16
        uint32   number of bytes, then the data (row-major)
    uint32   number of aliases, then for each: string alias, string target

where a string is a uint16 length (counting a trailing NUL) and the bytes.
Rank-0 variables are scalars of the spec (`decoder/num_heads`, `pre_norm`).

CTranslate2 fuses projections: a self-attention's `linear_0` is q, k and v
stacked on the output axis, a cross-attention's `linear_0` is q and its
`linear_1` k and v; Whisper's k projection has no bias, so its third of a
fused bias is zeros. Those are split here. The header parse
(`read_variables`, `whisper_dims`) needs no torch: model_config.py reads
the dimensions through it.
Only float32 / float16 / bfloat16 weights are read (int8 models carry
per-row scales this loader does not apply).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MODEL_FILE = "model.bin"
_DTYPE_NAMES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16"}
_DTYPE_SIZES = {0: 4, 1: 1, 2: 2, 3: 4, 4: 2, 5: 2}


class CTranslate2FormatError(Exception):
    """A model.bin this loader cannot read: names the problem."""


@dataclass(frozen=True)
class Variable:
    """One named array of a model.bin: where its bytes are, and what they hold."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # a key of _DTYPE_NAMES' values
    offset: int  # of the data in the file
    num_bytes: int


@dataclass(frozen=True)
class ModelFile:
    """A model.bin's header: its spec and variables (aliases resolved)."""

    spec: str
    revision: int
    variables: dict[str, Variable]

    def scalar(self, name: str, data: bytes | mmap.mmap) -> int:
        """A rank-0 integer variable's value, from the file's bytes."""
        var = self.variables[name]
        raw = data[var.offset : var.offset + var.num_bytes]
        return int.from_bytes(raw, "little", signed=True)


def is_ctranslate2_dir(path: str) -> bool:
    return (Path(path) / MODEL_FILE).is_file()


def read_variables(data: bytes | mmap.mmap) -> ModelFile:
    """Parse the header of a model.bin held in `data` (the data are not copied)."""
    pos = 0

    def take(fmt: str) -> int:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return int(value)

    def string() -> str:
        nonlocal pos
        n = take("H")
        text = data[pos : pos + n].rstrip(b"\0").decode()
        pos += n
        return text

    try:
        version = take("I")
        if version < 5:
            raise CTranslate2FormatError(f"binary version {version} is not supported (need >= 5)")
        spec = string()
        revision = take("I")
        variables: dict[str, Variable] = {}
        for _ in range(take("I")):
            name = string()
            shape = tuple(take("I") for _ in range(take("B")))
            dtype_id = take("B")
            num_bytes = take("I")
            if dtype_id not in _DTYPE_NAMES:
                raise CTranslate2FormatError(f"{name}: unknown dtype id {dtype_id}")
            count = 1
            for d in shape:
                count *= d
            if count * _DTYPE_SIZES[dtype_id] != num_bytes or pos + num_bytes > len(data):
                raise CTranslate2FormatError(f"{name}: {num_bytes} bytes do not match {shape}")
            variables[name] = Variable(name, shape, _DTYPE_NAMES[dtype_id], pos, num_bytes)
            pos += num_bytes
        for _ in range(take("I") if pos < len(data) else 0):
            alias, target = string(), string()
            variables[alias] = variables[target]
    except (struct.error, UnicodeDecodeError, KeyError) as e:
        raise CTranslate2FormatError(f"truncated or corrupt header: {e}") from e
    return ModelFile(spec, revision, variables)


def read_model_file(path: str) -> tuple[ModelFile, mmap.mmap]:
    """The header and the whole file's bytes (a memory map) of DIR/model.bin."""
    file = Path(path) / MODEL_FILE
    with open(file, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return read_variables(data), data
    except CTranslate2FormatError as e:
        raise CTranslate2FormatError(f"{file}: {e}") from e


def whisper_dims(path: str) -> dict[str, int]:
    """Hugging Face's Whisper config dimensions, from a model.bin's shapes and
    scalars (a CTranslate2 config.json holds none)."""
    header, data = read_model_file(path)
    if header.spec != "WhisperSpec":
        raise CTranslate2FormatError(f"{path}: spec {header.spec} is not supported")
    v = header.variables

    def count(side: str) -> int:
        names = (n.split("/")[1] for n in v if n.startswith(f"{side}/layer_"))
        return len({n for n in names if n.removeprefix("layer_").isdigit()})

    try:
        return {
            "d_model": v["decoder/embeddings/weight"].shape[1],
            "vocab_size": v["decoder/embeddings/weight"].shape[0],
            "num_mel_bins": v["encoder/conv1/weight"].shape[1],
            "encoder_layers": count("encoder"),
            "encoder_attention_heads": header.scalar("encoder/num_heads", data),
            "encoder_ffn_dim": v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
            "decoder_layers": count("decoder"),
            "decoder_attention_heads": header.scalar("decoder/num_heads", data),
            "decoder_ffn_dim": v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
            "max_source_positions": v["encoder/position_encodings/encodings"].shape[0],
            "max_target_positions": v["decoder/position_encodings/encodings"].shape[0],
        }
    except KeyError as e:
        raise CTranslate2FormatError(f"{path}: model.bin lacks {e}") from e


# CTranslate2's Whisper names → Hugging Face's, within a layer (None: split below).
_LAYER_PARTS = {
    "self_attention/layer_norm": "self_attn_layer_norm",
    "self_attention/linear_1": "self_attn.out_proj",
    "attention/layer_norm": "encoder_attn_layer_norm",
    "attention/linear_0": "encoder_attn.q_proj",
    "attention/linear_2": "encoder_attn.out_proj",
    "ffn/layer_norm": "final_layer_norm",
    "ffn/linear_0": "fc1",
    "ffn/linear_1": "fc2",
}
_TOP_PARTS = {
    "encoder/conv1": "model.encoder.conv1",
    "encoder/conv2": "model.encoder.conv2",
    "encoder/position_encodings": "model.encoder.embed_positions",
    "encoder/layer_norm": "model.encoder.layer_norm",
    "decoder/embeddings": "model.decoder.embed_tokens",
    "decoder/position_encodings": "model.decoder.embed_positions",
    "decoder/layer_norm": "model.decoder.layer_norm",
}
_LEAVES = {
    "weight": "weight",
    "bias": "bias",
    "gamma": "weight",
    "beta": "bias",
    "encodings": "weight",
}


def whisper_names(name: str) -> list[str]:
    """The Hugging Face names a CTranslate2 Whisper variable becomes (fused
    ones become two or three, in order); [] for what the model does not read."""
    path, _, leaf = name.rpartition("/")
    hf_leaf = _LEAVES.get(leaf)
    if hf_leaf is None:
        return []
    if path in _TOP_PARTS:
        return [f"{_TOP_PARTS[path]}.{hf_leaf}"]
    parts = path.split("/")
    if len(parts) < 3 or not parts[1].startswith("layer_"):
        return []
    side, layer, inner = parts[0], parts[1].removeprefix("layer_"), "/".join(parts[2:])
    prefix = f"model.{side}.layers.{layer}"
    if inner == "self_attention/linear_0":
        return [f"{prefix}.self_attn.{p}_proj.{hf_leaf}" for p in ("q", "k", "v")]
    if inner == "attention/linear_1":
        return [f"{prefix}.encoder_attn.{p}_proj.{hf_leaf}" for p in ("k", "v")]
    part = _LAYER_PARTS.get(inner)
    return [f"{prefix}.{part}.{hf_leaf}"] if part else []


def ctranslate2_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A CTranslate2 Whisper directory's weights as (Hugging Face name, tensor)
    pairs, fused projections split, in the file's own dtype."""
    import torch

    header, data = read_model_file(path)
    if header.spec != "WhisperSpec":
        raise CTranslate2FormatError(f"{path}: spec {header.spec} is not supported")
    for name, var in header.variables.items():
        if name == "decoder/projection/weight":
            continue  # an alias of the token embeddings (tied)
        names = whisper_names(name)
        if not names:
            continue
        if var.dtype not in ("float32", "float16", "bfloat16"):
            raise CTranslate2FormatError(f"{path}: {name}: {var.dtype} weights are not supported")
        dtype = getattr(torch, var.dtype)
        raw = bytearray(data[var.offset : var.offset + var.num_bytes])  # owned, writable
        tensor = torch.frombuffer(raw, dtype=dtype).reshape(var.shape)
        for hf, piece in zip(names, tensor.chunk(len(names), dim=0), strict=True):
            if hf.endswith("k_proj.bias"):
                continue  # Whisper's k projection has no bias (CTranslate2 stores zeros)
            yield hf, piece
