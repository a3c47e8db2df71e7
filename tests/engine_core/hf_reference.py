"""Reference outputs from HF transformers, the implementation nobody here wrote."""

from __future__ import annotations

from typing import cast

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel


@torch.inference_mode()
def hf_greedy(
    model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 1
) -> list[list[int]]:
    """`generate(do_sample=False)` token ids, never stopping early.

    batch_size 1 runs each prompt alone, unpadded (the safest reference);
    larger batches are left-padded with an explicit attention mask, which
    costs a few 1e-5 in the logits and saves most of the time on big models.
    """
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
    )
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        input_ids = torch.zeros((len(chunk), width), dtype=torch.long)  # [batch, width]
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, prompt in enumerate(chunk):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[i, width - len(prompt) :] = 1
        sequences = cast(GenerationMixin, model).generate(
            input_ids, attention_mask=attention_mask, generation_config=config
        )
        for row in sequences[:, width:].tolist():
            assert len(row) == max_new_tokens, "HF generate stopped early"
            outputs.append(row)
    return outputs


@torch.inference_mode()
def hf_logprobs(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """float32 log_softmax of one unpadded forward pass → [len(token_ids), vocab].

    Row p is the distribution of the token at position p + 1.
    """
    logits = model(torch.tensor([token_ids])).logits[0]  # [len, vocab]
    return torch.log_softmax(logits.float(), dim=-1)
