"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the grouped expert op
against the per-token definition, and greedy tokens against transformers
(float32) on tiny random-weight checkpoints, at one rank and at two
tensor-parallel ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.model_config import load_model_config
from pagoda.engine_core.models.moe import fused_moe, moe_reference, route
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.engine_core.helpers import NUM_THREADS, random_prompts, run_to_completion
from tests.engine_core.hf_reference import hf_greedy

VOCAB = 512


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_match_the_per_token_definition(
    dtype: torch.dtype, renormalize: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, top_k = 37, 64, 48, 8, 2
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    router = torch.randn(experts, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / 8).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / 8).to(dtype)
    weights, ids = route(x, router, top_k, renormalize)
    got = fused_moe(x, w13, w2, weights, ids).float()
    want = moe_reference(x, router, w13, w2, top_k, renormalize).float()
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    assert (got - want).abs().max().item() < tolerance * max(want.abs().max().item(), 1)
    if renormalize:
        assert torch.allclose(weights.sum(-1), torch.ones(tokens))


def build(kind: str, directory: Path) -> Path:
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if kind == "qwen3_moe":
        # The middle layer dense (mlp_only_layers), the others sparse.
        config = Qwen3MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    elif kind == "olmoe":
        config = OlmoeConfig(
            **common, intermediate_size=32, num_experts=6, eos_token_id=1, pad_token_id=0
        )
    else:
        config = MixtralConfig(**common, intermediate_size=32, num_local_experts=6)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # larger weights than the init's, so tokens differ per prompt
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {kind: build(kind, root / kind) for kind in ("qwen3_moe", "mixtral", "olmoe")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize(("tp", "ep"), [(1, False), (2, False), (2, True)])
def test_greedy_tokens_match_transformers(
    moe_models: dict[str, Path], kind: str, tp: int, ep: bool
) -> None:
    """One rank; two ranks each with half of every expert; two ranks each with
    half of the experts whole (expert parallelism)."""
    path = moe_models[kind]
    config = load_model_config(str(path))
    assert config.moe is not None
    if kind == "qwen3_moe":
        assert config.moe.sparse_layers == (0, 2) and config.moe.renormalize
    prompts = random_prompts(5, 4, VOCAB, 4, 40)
    engine = EngineCore(
        EngineConfig(
            model=str(path),
            dtype="float32",
            kv_cache_memory_bytes=4 << 20,
            max_num_batched_tokens=32,  # prompts are chunked
            num_threads=NUM_THREADS,
            tensor_parallel_size=tp,
            enable_expert_parallel=ep,
        )
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
        adds = [AddRequest(f"m{i}", p, params, 0.0) for i, p in enumerate(prompts)]
        records = run_to_completion(engine, adds).records
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = hf_greedy(hf, prompts, 10)
    assert len({tuple(t) for t in expected}) > 1  # the prompts lead different ways
    for i, tokens in enumerate(expected):
        assert records[f"m{i}"].token_ids == tokens, i


def test_lora_on_experts_is_refused_clearly(moe_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="mixture-of-experts"):
        EngineCore(
            EngineConfig(
                model=str(moe_models["mixtral"]),
                dtype="float32",
                kv_cache_memory_bytes=4 << 20,
                num_threads=NUM_THREADS,
                enable_lora=True,
            )
        )


def test_expert_parallel_needs_experts_that_divide(moe_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="6 experts do not divide by --tensor-parallel-size 4"):
        EngineCore(
            EngineConfig(
                model=str(moe_models["mixtral"]),
                dtype="float32",
                tensor_parallel_size=4,
                enable_expert_parallel=True,
            )
        )


@pytest.mark.slow
def test_expert_parallel_logprobs_match_one_rank(moe_models: dict[str, Path]) -> None:
    prompts = random_prompts(9, 3, VOCAB, 4, 30)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    runs = {}
    for tp, ep in ((1, False), (2, True)):
        engine = EngineCore(
            EngineConfig(
                model=str(moe_models["qwen3_moe"]),
                dtype="float32",
                kv_cache_memory_bytes=4 << 20,
                num_threads=NUM_THREADS,
                tensor_parallel_size=tp,
                enable_expert_parallel=ep,
            )
        )
        try:
            adds = [AddRequest(f"l{i}", p, params, 0.0) for i, p in enumerate(prompts)]
            runs[tp] = run_to_completion(engine, adds).records
        finally:
            engine.shutdown()
    for request_id, one in runs[1].items():
        two = runs[2][request_id]
        assert two.token_ids == one.token_ids
        for a, b in zip(one.logprobs, two.logprobs, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.mark.slow
def test_olmoe_matches_transformers_and_refuses_tensor_parallelism(
    moe_models: dict[str, Path],
) -> None:
    """OLMoE: q/k normalized over all heads, top-k weights not renormalized."""
    path = moe_models["olmoe"]
    config = load_model_config(str(path))
    assert config.qk_norm_whole and config.moe is not None and not config.moe.renormalize
    prompts = random_prompts(6, 3, VOCAB, 4, 30)
    engine = EngineCore(
        EngineConfig(
            model=str(path),
            dtype="float32",
            kv_cache_memory_bytes=4 << 20,
            max_num_batched_tokens=32,
            num_threads=NUM_THREADS,
        )
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        adds = [AddRequest(f"o{i}", p, params, 0.0) for i, p in enumerate(prompts)]
        records = run_to_completion(engine, adds).records
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for i, tokens in enumerate(hf_greedy(hf, prompts, 10)):
        assert records[f"o{i}"].token_ids == tokens, i
    with pytest.raises(ValueError, match="OLMoE normalizes q and k over all heads"):
        EngineCore(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2))
