"""LLM.generate(..., lora_request=LoRARequest(name, id, path)) as in vLLM, against HF + PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagoda import LLM, LoRARequest, SamplingParams
from tests.conftest import TINY_VOCAB_SIZE, build_lora_adapter, build_tiny_model
from tests.engine_core.hf_reference import hf_greedy


def add_word_tokenizer(directory: Path, vocab_size: int = TINY_VOCAB_SIZE) -> None:
    """A word-level tokenizer over a tiny vocabulary: "w5 w17" → [5, 17]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(directory)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-sdk")
    base = build_tiny_model("llama", root / "base")
    add_word_tokenizer(base)
    adapter = build_lora_adapter(base, root / "a", 8, 16, ["q_proj", "v_proj", "gate_proj"])
    return {"base": base, "a": adapter}


def test_llm_generate_with_lora_request(tiny: dict[str, Path]) -> None:
    from peft import PeftModel

    llm = LLM(
        str(tiny["base"]),
        dtype="float32",
        device="cpu",
        num_threads=1,
        kv_cache_memory_bytes=4 << 20,
        enable_lora=True,
        max_lora_rank=8,
    )
    prompts = ["w1 w2 w3 w4", "w10 w20 w30"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    lora = LoRARequest("a", 1, str(tiny["a"]))
    with_lora = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=lora)]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(tiny["base"], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tiny["a"]).eval()
    token_ids = [[int(w[1:]) for w in p.split()] for p in prompts]
    assert with_lora == hf_greedy(peft_model, token_ids, 6)  # type: ignore[arg-type]
    assert with_lora != plain
    assert [d["lora_name"] for d in llm.list_loras()] == ["a"]
