"""A trainer for the weight-update tests: rank 0 of its own torch.distributed group.

    python trainer.py MODEL_DIR OUT_DIR PORT WORLD_SIZE [--seed S] [--packed BYTES]

It loads the model with transformers, perturbs every parameter, saves the
perturbed model to OUT_DIR (the reference), writes OUT_DIR/update.json (the
`update_info` to send and the tensors' sha256), then does what a trainer
does: a TCPStore as master and a gloo group of its own (no default process
group), and broadcasts every parameter in `names` order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM


def sha256(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("port", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--packed", type=int, default=0, help="send packed buffers of about this many bytes"
    )
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    out = Path(args.out)
    model.save_pretrained(out)
    params = list(model.named_parameters())
    update_info = {
        "names": [name for name, _ in params],
        "dtype_names": [str(p.dtype).removeprefix("torch.") for _, p in params],
        "shapes": [list(p.shape) for _, p in params],
        "packed": bool(args.packed),
    }
    if args.packed:
        update_info["packed_buffer_size_bytes"] = args.packed
    checksums = {name: sha256(p) for name, p in params}
    (out / "update.json").write_text(
        json.dumps({"update_info": update_info, "checksums": checksums})
    )
    store = dist.TCPStore(
        "127.0.0.1", args.port, args.world_size, is_master=True, timeout=timedelta(seconds=120)
    )
    group = dist.ProcessGroupGloo(store, 0, args.world_size, timedelta(seconds=120))
    if not args.packed:
        for _, param in params:
            group.broadcast(param.detach().contiguous(), 0).wait()
        return
    # Packed: the tensors' bytes in order, a buffer each time the total passes the size.
    pending: list[torch.Tensor] = []
    size = 0
    for index, (_, param) in enumerate(params):
        flat = param.detach().contiguous().reshape(-1).view(torch.uint8)
        pending.append(flat)
        size += flat.numel()
        if size > args.packed or index == len(params) - 1:
            group.broadcast(torch.cat(pending), 0).wait()
            pending, size = [], 0


if __name__ == "__main__":
    main()
