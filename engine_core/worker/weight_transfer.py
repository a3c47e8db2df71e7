"""New weights from a trainer: over a torch.distributed group of its own, or from files.

The trainer is rank 0 of a group it creates without touching any default
process group (a `TCPStore` at master_address:master_port as its master,
then `ProcessGroupGloo(store, 0, world_size)`, or NCCL on GPUs); engine
rank r joins as `rank_offset + r`. For each update the trainer broadcasts
the tensors one by one in `names` order and every rank receives every
tensor: each keeps what it holds (its tensor-parallel shard, its pipeline
stage's layers) when the model is rebuilt from them.

The `file` backend reads the tensors from a safetensors file or directory
on this host instead. Either way nothing is loaded until every tensor has
arrived and matches the model (its name, its shape, a floating dtype): a
bad update is refused whole, naming the tensor, and the serving weights
stay as they were.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch

# How long a rank waits for the trainer to join or to send.
TRANSFER_TIMEOUT_S = float(os.environ.get("PAGODA_WEIGHT_TRANSFER_TIMEOUT", "300"))
BACKENDS = ("gloo", "nccl", "file")
DEFAULT_PACKED_BUFFER_BYTES = 1 << 30
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class WeightUpdateError(ValueError):
    """An update refused before anything was loaded (the caller's mistake)."""


def parse_dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise WeightUpdateError(f"dtype {name!r} is not one of {sorted(set(_DTYPES))}")
    return dtype


class WeightTransfer:
    """This rank's membership of the trainer's group."""

    def __init__(self, backend: str, init_info: dict[str, Any], rank: int, device: torch.device):
        import torch.distributed as dist

        try:
            host = str(init_info["master_address"])
            port = int(init_info["master_port"])
            offset = int(init_info.get("rank_offset", 1))
            world_size = int(init_info["world_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightUpdateError(
                f"init_info needs master_address, master_port, world_size (and rank_offset): {e}"
            ) from None
        if not 0 < offset + rank < world_size:
            raise WeightUpdateError(
                f"engine rank {rank} at rank_offset {offset} is outside the trainer's "
                f"world of {world_size} (rank 0 is the trainer)"
            )
        if not 0 < port < 65536 or world_size < 2:
            raise WeightUpdateError("master_port must be a port and world_size at least 2")
        _reachable(host, port)
        timeout = timedelta(seconds=TRANSFER_TIMEOUT_S)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        self.rank = offset + rank
        self.world_size = world_size
        self.device = device
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            self.group: Any = dist.ProcessGroupNCCL(store, self.rank, world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, self.rank, world_size, timeout)
        self.backend = backend

    def receive(
        self,
        names: list[str],
        dtype_names: list[str],
        shapes: list[list[int]],
        packed_buffer_bytes: int | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the trainer broadcasts, in order, on the CPU.

        Packed (`packed_buffer_bytes` set): the trainer concatenates the
        tensors' bytes in order and broadcasts a uint8 buffer each time the
        running total passes the buffer size (the tensor that passes it
        included), then one for the rest.
        """
        on = self.device if self.backend == "nccl" else torch.device("cpu")
        specs = [
            (name, tuple(shape), parse_dtype(dtype_name))
            for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True)
        ]
        if packed_buffer_bytes is None:
            received = []
            for name, shape, dtype in specs:
                tensor = torch.empty(shape, dtype=dtype, device=on)
                self._broadcast(tensor)
                received.append((name, tensor.cpu()))
            return received
        received, chunk, size = [], [], 0
        for index, (name, shape, dtype) in enumerate(specs):
            chunk.append((name, shape, dtype))
            size += math.prod(shape) * dtype.itemsize
            if size > packed_buffer_bytes or index == len(specs) - 1:
                buffer = torch.empty(size, dtype=torch.uint8, device=on)
                self._broadcast(buffer)
                offset = 0
                for part_name, part_shape, part_dtype in chunk:
                    nbytes = math.prod(part_shape) * part_dtype.itemsize
                    part = buffer[offset : offset + nbytes].cpu().clone()
                    received.append((part_name, part.view(part_dtype).reshape(part_shape)))
                    offset += nbytes
                chunk, size = [], 0
        return received

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()


def _reachable(host: str, port: int) -> None:
    """WeightUpdateError now, rather than a store retrying until its time limit,
    when nothing listens at the trainer's address."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=10):
            pass
    except OSError as e:
        raise WeightUpdateError(
            f"the trainer's store at {host}:{port} is not reachable ({e}); "
            "start the trainer's TCPStore (is_master=True) first"
        ) from None


def check_update_info(update_info: dict[str, Any]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtype_names, shapes) of a wire update, checked for form."""
    names = update_info.get("names")
    dtype_names = update_info.get("dtype_names")
    shapes = update_info.get("shapes")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not names:
        raise WeightUpdateError("update_info.names must be a non-empty list of tensor names")
    if not isinstance(dtype_names, list) or len(dtype_names) != len(names):
        raise WeightUpdateError("update_info.dtype_names must give one dtype per name")
    if not isinstance(shapes, list) or len(shapes) != len(names):
        raise WeightUpdateError("update_info.shapes must give one shape per name")
    for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
        if not isinstance(dtype_name, str):
            raise WeightUpdateError(f"{name}: dtype must be a string")
        parse_dtype(dtype_name)
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise WeightUpdateError(f"{name}: shape must be a list of sizes")
    if len(set(names)) != len(names):
        raise WeightUpdateError("update_info.names lists a tensor twice")
    return names, dtype_names, shapes


def packed_buffer_bytes(update_info: dict[str, Any]) -> int | None:
    """The packed transfer's buffer size (vLLM's default 1 GiB), or None when not packed."""
    if not update_info.get("packed"):
        return None
    size = update_info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_BYTES)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise WeightUpdateError("update_info.packed_buffer_size_bytes must be a positive integer")
    return size


def read_safetensors(path: str, names: list[str] | None) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file, or of every *.safetensors in a directory."""
    from safetensors.torch import load_file

    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")
        )
        if not files:
            raise WeightUpdateError(f"{path} holds no .safetensors files")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise WeightUpdateError(f"{path} is not a file or directory on the engine's host")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except Exception as e:  # noqa: BLE001 - a bad file is the caller's
            raise WeightUpdateError(f"{file}: not a readable safetensors file: {e}") from None
    if names is not None:
        missing = [n for n in names if n not in tensors]
        if missing:
            raise WeightUpdateError(f"{path} has no tensor {missing[0]}")
        return [(n, tensors[n]) for n in names]
    return list(tensors.items())


def check_against_model(
    pairs: Iterable[tuple[str, torch.Tensor]],
    shapes: dict[str, tuple[int, ...]],
    tied_head: bool,
) -> None:
    """WeightUpdateError naming the first tensor the model does not have as sent."""
    count = 0
    for name, tensor in pairs:
        count += 1
        if name not in shapes:
            if tied_head and name == "lm_head.weight":
                raise WeightUpdateError(
                    "lm_head.weight: this model ties its LM head to the embedding; "
                    "send model.embed_tokens.weight"
                )
            raise WeightUpdateError(f"{name}: the model has no such tensor")
        if tuple(tensor.shape) != shapes[name]:
            raise WeightUpdateError(
                f"{name}: shape {list(tensor.shape)} does not match the model's "
                f"{list(shapes[name])}"
            )
        if not tensor.is_floating_point():
            raise WeightUpdateError(f"{name}: dtype {tensor.dtype} is not a floating type")
    if count == 0:
        raise WeightUpdateError("the update holds no tensors")


def checksum(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's bytes, as laid out contiguously in its own dtype."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()
