"""The engine's CUDA path (Triton kernels in the ModelRunner) end to end, greedy vs HF.

Without CUDA the runner is switched to its Triton path by hand and the
kernels run in Triton's interpreter on the CPU: the same code the CUDA
branch runs, except the device. A small token budget chunks the prompts and
a shared prefix hits the prefix cache, so prefill starts mid-sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from transformers import AutoModelForCausalLM  # noqa: E402

from pagoda.engine_core.attention import triton_backend as triton_attention  # noqa: E402
from pagoda.engine_core.config import EngineConfig  # noqa: E402
from pagoda.engine_core.core.engine import EngineCore  # noqa: E402
from pagoda.engine_core.worker.cuda_graphs import DecodeGraphs  # noqa: E402
from pagoda.protocol.messages import AddRequest  # noqa: E402
from tests.engine_core.helpers import (  # noqa: E402
    NUM_THREADS,
    greedy_params,
    random_prompts,
    run_to_completion,
)
from tests.engine_core.hf_reference import hf_greedy  # noqa: E402
from tests.kernels.triton.helpers import use_triton_backend  # noqa: E402

MAX_NEW_TOKENS = 6


@pytest.mark.parametrize("kind", ["llama3_rope", "qwen3"])
def test_triton_runner_greedy_matches_hf(
    tiny_models: dict[str, Path], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(NUM_THREADS)
    calls = []
    kernel_path = triton_attention.triton_paged_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[-2])
        return kernel_path(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "triton_paged_attention", counting)
    engine = EngineCore(
        EngineConfig(
            model=str(tiny_models[kind]),
            dtype="float32",
            device="cuda" if torch.cuda.is_available() else "cpu",
            block_size=16,
            max_num_batched_tokens=24,
            kv_cache_memory_bytes=8 << 20,
            num_threads=NUM_THREADS,
        )
    )
    runner = engine.executor.worker.runner
    use_triton_backend(runner)
    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_models[kind]), dtype=torch.float32)
    hf_model.eval()
    vocab = hf_model.config.vocab_size
    prefix = random_prompts(5, 1, vocab, 32, 32)[0]  # two full blocks, then cached
    prompts = [prefix + p for p in random_prompts(6, 2, vocab, 1, 9)] + random_prompts(
        7, 2, vocab, 1, 40
    )
    first = run_to_completion(
        engine, [AddRequest("warm", prompts[0], greedy_params(MAX_NEW_TOKENS), 0.0)]
    )
    requests = [
        AddRequest(f"r{i}", p, greedy_params(MAX_NEW_TOKENS), 0.0)
        for i, p in enumerate(prompts[1:])
    ]
    run = run_to_completion(engine, requests)
    expected = hf_greedy(hf_model, prompts, MAX_NEW_TOKENS)
    assert first.records["warm"].token_ids == expected[0]
    for i, tokens in enumerate(expected[1:]):
        assert run.records[f"r{i}"].token_ids == tokens, f"prompt {i}"
    assert run.records["r0"].num_cached_tokens >= 32  # the prefix came from the cache
    assert max(sum(p.num_scheduled_tokens.values()) for p in run.plans) <= 24
    # Every layer of every step went through the Triton attention, chunks included.
    num_steps = len(first.plans) + len(run.plans)
    assert len(calls) == 2 * num_steps
    assert any(m.num_decode_tokens and m.num_prefill_tokens for m in calls)


class _EagerReplay:
    """Stands in for a captured graph on the CPU: runs the same forward into the output."""

    def __init__(self, graphs: DecodeGraphs, n: int) -> None:
        self.graphs, self.n = graphs, n

    def replay(self) -> None:
        self.graphs.outputs[self.n].copy_(self.graphs._forward(self.n))


def test_decode_graph_padding_matches_hf(tiny_models: dict[str, Path]) -> None:
    """The CUDA-graph decode path's static buffers and padding rows (slot -1, one-token
    contexts) leave real rows exact; replay is emulated, as the CPU has no CUDA graphs."""
    torch.set_num_threads(NUM_THREADS)
    engine = EngineCore(
        EngineConfig(
            model=str(tiny_models["llama"]),
            dtype="float32",
            device="cpu",
            block_size=16,
            max_num_seqs=4,  # sizes 1, 2 and 4: a batch of 3 is padded to 4
            kv_cache_memory_bytes=8 << 20,
            num_threads=NUM_THREADS,
        )
    )
    runner = engine.executor.worker.runner
    use_triton_backend(runner)
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 4, 4, runner.device)
    assert graphs.sizes == [1, 2, 4]
    for n in graphs.sizes:
        graphs.outputs[n] = torch.empty(n, runner.model.config.hidden_size)
        graphs.graphs[n] = _EagerReplay(graphs, n)  # type: ignore[assignment]
    runner.graphs = graphs
    replays: list[int] = []
    run_graph = graphs.run

    def counting_run(*args: Any) -> torch.Tensor | None:
        out = run_graph(*args)
        replays.append(-1 if out is None else len(args[0]))
        return out

    graphs.run = counting_run  # type: ignore[method-assign]
    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32)
    hf_model.eval()
    prompts = random_prompts(11, 3, hf_model.config.vocab_size, 2, 20)
    # Different lengths: decode steps of 3 (padded to 4), then 2, then 1 sequences.
    run = run_to_completion(
        engine,
        [
            AddRequest(f"r{i}", p, greedy_params(MAX_NEW_TOKENS + 2 * i), 0.0)
            for i, p in enumerate(prompts)
        ],
    )
    expected = [hf_greedy(hf_model, [p], MAX_NEW_TOKENS + 2 * i)[0] for i, p in enumerate(prompts)]
    for i, tokens in enumerate(expected):
        assert run.records[f"r{i}"].token_ids == tokens, f"prompt {i}"
    assert {1, 2, 3} <= set(replays)
