"""LoRA on the engine's CUDA path (Triton kernels in the runner), greedy vs HF + PEFT.

Without CUDA the runner is switched to its Triton path by hand and the
kernels run in Triton's interpreter: the adapters' deltas (the Triton LoRA
kernel, kernels/triton_ops/lora.py) must land on the same projections there
as on the CPU path, in a batch that mixes the base model with an adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch

pytest.importorskip("triton")

from transformers import AutoModelForCausalLM  # noqa: E402

from pagoda.engine_core.config import EngineConfig  # noqa: E402
from pagoda.engine_core.core.engine import EngineCore  # noqa: E402
from pagoda.engine_core.worker.model_runner import ModelRunner  # noqa: E402
from pagoda.protocol.messages import AddRequest, LoRARequest  # noqa: E402
from tests.conftest import build_lora_adapter  # noqa: E402
from tests.engine_core.helpers import (  # noqa: E402
    NUM_THREADS,
    greedy_params,
    random_prompts,
    run_to_completion,
)
from tests.engine_core.hf_reference import hf_greedy  # noqa: E402
from tests.kernels.triton.helpers import use_triton_backend  # noqa: E402

MAX_NEW_TOKENS = 5
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_triton_runner_lora_matches_hf_peft(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import PeftModel

    from pagoda.kernels.triton_ops import lora as triton_lora

    calls: list[int] = []
    kernel = triton_lora.add_lora

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_lora, "add_lora", counted)  # the deltas go through the kernel

    torch.set_num_threads(NUM_THREADS)
    base = tiny_models["llama"]
    adapter = build_lora_adapter(base, tmp_path / "a", 4, 8, MODULES, seed=5)
    engine = EngineCore(
        EngineConfig(
            model=str(base),
            dtype="float32",
            device="cuda" if torch.cuda.is_available() else "cpu",
            kv_cache_memory_bytes=8 << 20,
            num_threads=NUM_THREADS,
            enable_lora=True,
            max_lora_rank=4,
            lora_modules=(("a", str(adapter)),),
        )
    )
    runner = cast(ModelRunner, engine.executor.worker.runner)
    use_triton_backend(runner)
    prompts = random_prompts(9, 2, 999, 4, 20)
    requests = [
        AddRequest("base", prompts[0], greedy_params(MAX_NEW_TOKENS), 0.0),
        AddRequest(
            "lora", prompts[1], greedy_params(MAX_NEW_TOKENS), 0.0, lora_request=LoRARequest("a")
        ),
    ]
    run = run_to_completion(engine, requests)
    assert calls, "the Triton path did not run the Triton LoRA kernel"
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert run.records["base"].token_ids == hf_greedy(hf, prompts[:1], MAX_NEW_TOKENS)[0]
    peft_model = PeftModel.from_pretrained(hf, adapter).eval()
    expected = hf_greedy(peft_model, prompts[1:], MAX_NEW_TOKENS)[0]  # type: ignore[arg-type]
    assert run.records["lora"].token_ids == expected
