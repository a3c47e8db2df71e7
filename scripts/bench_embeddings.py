"""Offline embedding throughput: Pagoda's LLM.embed against HF BertModel + mean pooling.

    PYTHONPATH=. python scripts/bench_embeddings.py --model DIR [--num-prompts 512]

Same prompts for both (random words, 8-120 tokens); HF runs padded batches of
`--hf-batch` sequences. Prints prompts/s and tokens/s for each.
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=2)
    ns = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    from pagoda.frontend.llm import LLM

    torch.set_num_threads(ns.num_threads)
    rng = random.Random(0)
    words = "the a cat dog market river cloud runs quickly over under bright data model".split()
    texts = [
        " ".join(rng.choice(words) for _ in range(rng.randint(6, 118)))
        for _ in range(ns.num_prompts)
    ]
    llm = LLM(ns.model, num_threads=ns.num_threads)
    llm.embed(texts[:8], use_tqdm=False)  # warm up
    start = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    pagoda_s = time.perf_counter() - start
    num_tokens = sum(len(o.prompt_token_ids) for o in outs)

    tokenizer = AutoTokenizer.from_pretrained(ns.model)
    model = AutoModel.from_pretrained(ns.model, dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), ns.hf_batch):
            enc = tokenizer(texts[i : i + ns.hf_batch], padding=True, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"][..., None].float()
            F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    hf_s = time.perf_counter() - start
    for name, secs in (("pagoda LLM.embed", pagoda_s), ("HF BertModel", hf_s)):
        print(
            f"{name:18s} {ns.num_prompts} prompts, {num_tokens} tokens: {secs:.2f} s, "
            f"{ns.num_prompts / secs:.0f} prompts/s, {num_tokens / secs:.0f} tokens/s"
        )


if __name__ == "__main__":
    main()
