"""LoRA adapters under tensor parallelism: each rank serves its part of them.

The column-parallel q, k, v, gate and up keep all of A and their rows of B,
the row-parallel o and down their columns of A and all of B (partial sums
added by the all-reduce). Checked piece by piece against the whole delta,
then end to end: a batch mixing two adapters and the base model gives at
two ranks the tokens of one rank (logprobs within 1e-4) and of transformers
with the adapter merged by PEFT, with 2 KV heads (split) and with 1
(replicated on both ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.core.lora_manager import LoRAError
from pagoda.engine_core.model_config import load_model_config
from pagoda.engine_core.worker.lora import LoRALoadError, load_adapter, whole_model_config
from pagoda.engine_core.worker.parallel import TensorParallel, rank_config
from pagoda.protocol.messages import AddRequest, LoRARequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.conftest import build_lora_adapter, build_tiny_model
from tests.engine_core.helpers import NUM_THREADS, random_prompts, run_to_completion
from tests.engine_core.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Path]]:
    """KV heads (2 or 1) -> a tiny Llama with them and its adapters: "a" on every
    module (r 8), "b" on q, v and down (r 4, rsLoRA), "big" (r 16), "embed"."""
    root = tmp_path_factory.mktemp("lora_tp")
    setups = {}
    for kv_heads in (2, 1):
        d = root / f"kv{kv_heads}"
        base = build_tiny_model("llama", d / "base", num_kv_heads=kv_heads)
        setups[kv_heads] = {
            "base": base,
            "a": build_lora_adapter(base, d / "a", 8, 16, ALL_MODULES, seed=1),
            "b": build_lora_adapter(
                base, d / "b", 4, 8, ["q_proj", "v_proj", "down_proj"], use_rslora=True, seed=2
            ),
            "big": build_lora_adapter(base, d / "big", 16, 16, ["q_proj"], seed=3),
            "embed": build_lora_adapter(base, d / "embed", 4, 8, ["embed_tokens"], seed=4),
        }
    return setups


@pytest.mark.parametrize(("kv_heads", "size"), [(2, 2), (1, 2), (2, 4)])
def test_rank_parts_add_up_to_the_whole_delta(
    setups: dict[int, dict[str, Path]], kv_heads: int, size: int
) -> None:
    """Every rank's delta, gathered (column-parallel) or summed (row-parallel),
    is the whole adapter's, on random inputs."""
    setup = setups[kv_heads]
    mc = load_model_config(str(setup["base"]))
    whole = load_adapter(str(setup["a"]), mc, 8)
    tps = [TensorParallel(rank, size) for rank in range(size)]
    # What the ranks' stacks check adapters against: the whole model, read again.
    assert [whole_model_config(rank_config(mc, tp), tp) for tp in tps] == [mc] * size
    parts = [load_adapter(str(setup["a"]), mc, 8, tp) for tp in tps]
    assert [p.shard for p in parts] == [(rank, size) for rank in range(size)]
    generator = torch.Generator().manual_seed(0)
    for (layer, module), (a, b) in whole.weights.items():
        x = torch.randn(5, a.shape[1], generator=generator)  # [tokens, in]
        expected = (x @ a.T) @ b.T  # [tokens, out]
        deltas = []  # each rank's [tokens, its out]
        for rank, part in enumerate(parts):
            a_part, b_part = part.weights[(layer, module)]
            x_part = x
            if module in ("o_proj", "down_proj"):  # row-parallel: the rank's slice of the input
                x_part = x[:, TensorParallel(rank, size).split(x.shape[1])]
            deltas.append((x_part @ a_part.T) @ b_part.T)
        if module in ("o_proj", "down_proj"):  # partial sums, as the all-reduce adds them
            torch.testing.assert_close(sum(deltas), expected, rtol=1e-5, atol=1e-5)
        elif module in ("k_proj", "v_proj"):  # the rank's KV heads, maybe replicated
            for rank, delta in enumerate(deltas):
                heads = TensorParallel(rank, size).kv_heads(mc.num_kv_heads)
                rows = slice(heads.start * mc.head_dim, heads.stop * mc.head_dim)
                torch.testing.assert_close(delta, expected[:, rows], rtol=1e-5, atol=1e-5)
        else:  # column-parallel: the ranks' rows side by side
            torch.testing.assert_close(torch.cat(deltas, 1), expected, rtol=1e-5, atol=1e-5)


def test_rank_parts_keep_the_whole_models_errors(setups: dict[int, dict[str, Path]]) -> None:
    """Rank over --max-lora-rank, an adapter for the model with the other KV
    head count (one KV head per rank either way), LoRA on the embedding:
    refused at a rank as at one."""
    tp = TensorParallel(1, 2)
    for kv_heads, other in ((2, 1), (1, 2)):
        mc = load_model_config(str(setups[kv_heads]["base"]))
        with pytest.raises(LoRALoadError, match="max_lora_rank 8"):
            load_adapter(str(setups[kv_heads]["big"]), mc, 8, tp)
        with pytest.raises(LoRALoadError, match=r"[kv]_proj has A .* this model needs"):
            load_adapter(str(setups[other]["a"]), mc, 8, tp)
        with pytest.raises(LoRALoadError, match="unsupported adapter weight"):
            load_adapter(str(setups[kv_heads]["embed"]), mc, 8, tp)


def lora_engine(setup: dict[str, Path], size: int, stages: int = 1) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(setup["base"]),
            dtype="float32",
            kv_cache_memory_bytes=4 << 20,
            max_num_batched_tokens=32,  # prompts are chunked
            num_threads=NUM_THREADS,
            distributed_executor_backend="mp" if size * stages > 1 else "uni",
            tensor_parallel_size=size,
            pipeline_parallel_size=stages,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            lora_modules=(("a", str(setup["a"])), ("b", str(setup["b"]))),
        )
    )


LORAS = [None, "a", "b", "a", None, "b"]
PROMPTS = random_prompts(12, len(LORAS), 999, 5, 40)


def lora_requests() -> list[AddRequest]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    return [
        AddRequest(f"r{i}", prompt, params, 0.0, lora_request=LoRARequest(lora) if lora else None)
        for i, (prompt, lora) in enumerate(zip(PROMPTS, LORAS, strict=True))
    ]


def hf_peft_merged_greedy(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list:
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    return hf_greedy(model, prompts, MAX_TOKENS)


@pytest.mark.parametrize(("kv_heads", "tp", "pp"), [(2, 2, 1), (1, 2, 1), (2, 1, 2)])
def test_two_ranks_give_the_single_rank_tokens_with_adapters(
    setups: dict[int, dict[str, Path]], kv_heads: int, tp: int, pp: int
) -> None:
    """Two tensor-parallel ranks (each its part of every adapter), or two
    pipeline stages (each its layers' adapter weights)."""
    setup = setups[kv_heads]
    runs = {}
    for size, stages in ((1, 1), (tp, pp)):
        engine = lora_engine(setup, size, stages)
        try:
            runs[size * stages] = run_to_completion(engine, lora_requests()).records
        finally:
            engine.shutdown()
    hf = {
        lora: hf_peft_merged_greedy(setup["base"], setup[lora] if lora else None, PROMPTS)
        for lora in (None, "a", "b")
    }
    for i, lora in enumerate(LORAS):
        one, two = runs[1][f"r{i}"], runs[2][f"r{i}"]
        assert two.token_ids == one.token_ids == hf[lora][i], (i, lora)
        if lora is not None:  # the adapter changes what the model says
            assert two.token_ids != hf[None][i], (i, lora)
        for a, b in zip(one.logprobs, two.logprobs, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_two_ranks_refuse_bad_adapters_as_one_does(setups: dict[int, dict[str, Path]]) -> None:
    engine = lora_engine(setups[2], 2)
    try:
        with pytest.raises(LoRAError, match="max_lora_rank 8") as e:
            engine.add_lora("big", str(setups[2]["big"]))
        assert e.value.kind == "invalid"
        with pytest.raises(LoRAError) as e:
            engine.add_lora("other", str(setups[1]["a"]))  # the 1-KV-head model's
        assert e.value.kind == "invalid"
        with pytest.raises(LoRAError) as e:
            engine.add_lora("missing", "/nonexistent/adapter")
        assert e.value.kind == "not_found"
    finally:
        engine.shutdown()
