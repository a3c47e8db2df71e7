"""TokenHistory: the token ids of the requests whose sampling is penalized.

Repetition, frequency and presence penalties read every prompt and output
token of their request at every step. Rebuilding those lists as tensors per
step costs more than the model's step at large batches, so each penalized
request keeps a row of one int32 array (prompt first, then each sampled
token appended in place) that the penalty kernel reads directly.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenHistory:
    """One row of token ids per penalized request; rows and width grow on demand."""

    def __init__(self, num_rows: int = 8, width: int = 1024) -> None:
        self._ids = np.zeros((num_rows, width), dtype=np.int32)  # [rows, width]
        self.prompt_lens = [0] * num_rows
        self.lens = [0] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    def add(self, token_ids: list[int], num_prompt_tokens: int) -> int:
        """A row holding token_ids (the prompt's first); returns its slot."""
        if not self._free:
            self._grow(rows=2 * self._ids.shape[0])
        slot = self._free.pop()
        self._fit(len(token_ids))
        self._ids[slot, : len(token_ids)] = token_ids
        self.prompt_lens[slot] = num_prompt_tokens
        self.lens[slot] = len(token_ids)
        return slot

    def append(self, slot: int, token_id: int) -> None:
        n = self.lens[slot]
        self._fit(n + 1)
        self._ids[slot, n] = token_id
        self.lens[slot] = n + 1

    def release(self, slot: int) -> None:
        self.lens[slot] = self.prompt_lens[slot] = 0
        self._free.append(slot)

    def clear(self) -> None:
        num_rows = self._ids.shape[0]
        self.prompt_lens = [0] * num_rows
        self.lens = [0] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    def token_ids(self, slot: int) -> list[int]:
        return self._ids[slot, : self.lens[slot]].tolist()

    @property
    def num_used(self) -> int:
        return self._ids.shape[0] - len(self._free)

    def tensor(self) -> torch.Tensor:
        """The rows as an int32 tensor [rows, width] sharing this memory."""
        return torch.from_numpy(self._ids)

    def _fit(self, length: int) -> None:
        width = self._ids.shape[1]
        if length > width:
            while width < length:
                width *= 2
            self._grow(width=width)

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old = self._ids
        new_rows, new_width = rows or old.shape[0], width or old.shape[1]
        self._ids = np.zeros((new_rows, new_width), dtype=np.int32)
        self._ids[: old.shape[0], : old.shape[1]] = old
        extra = new_rows - old.shape[0]
        self.prompt_lens += [0] * extra
        self.lens += [0] * extra
        self._free = list(range(new_rows - 1, old.shape[0] - 1, -1)) + self._free
