"""The prompts `pagoda bench` sends: random token ids, or a ShareGPT-style JSON file.

Random prompts are token ids, so no tokenizer is needed and every server
sees exactly the same tokens. A ShareGPT file is a JSON list of
conversations (`{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}`); each conversation's first turn is a
prompt and its second the reply whose length sets the request's output length.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# The low ids of the default model's vocabulary are its special tokens.
FIRST_PLAIN_TOKEN_ID = 100


@dataclass
class BenchRequest:
    """One request of a run: its prompt and how many tokens to ask for."""

    prompt: str | list[int]
    output_len: int
    # A ShareGPT reply: its token count becomes output_len when none is given.
    reply: str | None = None


def random_token_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` token ids drawn uniformly above the special tokens."""
    if vocab_size <= FIRST_PLAIN_TOKEN_ID:
        raise ValueError(f"vocab size must exceed {FIRST_PLAIN_TOKEN_ID}, got {vocab_size}")
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(length)] for _ in range(num)
    ]


def random_requests(
    num: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    prompts = random_token_prompts(num, input_len, vocab_size, seed)
    return [BenchRequest(prompt, output_len) for prompt in prompts]


def sharegpt_requests(
    path: str | Path, num: int, seed: int, output_len: int | None
) -> list[BenchRequest]:
    """`num` conversations drawn (seeded) from a ShareGPT-style JSON file.

    With `output_len` None each request's output length is its reply's token
    count, which the caller fills in (`BenchRequest.reply`).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read dataset {path}: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs: list[tuple[str, str]] = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if isinstance(prompt, str) and isinstance(reply, str) and prompt and reply:
            pairs.append((prompt, reply))
    if not pairs:
        raise ValueError(f"{path}: no conversation with a prompt and a reply")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    # Fewer conversations than prompts asked for: go round again.
    chosen = [pairs[i % len(pairs)] for i in range(num)]
    return [BenchRequest(prompt, output_len or 0, reply) for prompt, reply in chosen]
