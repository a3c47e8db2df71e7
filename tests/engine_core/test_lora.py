"""Multi-LoRA in the engine: HF + PEFT parity, mixed batches, prefix cache, slots.

A tiny random Llama and random PEFT adapters (non-zero B) built with peft.
Greedy output with an adapter must equal HF + PEFT in float32 token for
token; a batch mixing the base model and two adapters must give each
request what it gets alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.core.lora_manager import LoRAError
from pagoda.protocol.messages import AddRequest, LoRARequest
from tests.conftest import build_lora_adapter, build_tiny_model
from tests.engine_core.helpers import NUM_THREADS, greedy_params, random_prompts, run_to_completion
from tests.engine_core.hf_reference import hf_greedy

MAX_TOKENS = 8
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama and three adapters: all modules r8; q/v/down r4 rsLoRA; rank 16."""
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model("llama", root / "base")
    return {
        "base": base,
        "a": build_lora_adapter(base, root / "a", 8, 16, ALL_MODULES, seed=1),
        "b": build_lora_adapter(
            base, root / "b", 4, 8, ["q_proj", "v_proj", "down_proj"], use_rslora=True, seed=2
        ),
        "c": build_lora_adapter(base, root / "c", 8, 8, ["o_proj", "up_proj"], seed=3),
        "big": build_lora_adapter(base, root / "big", 16, 16, ["q_proj"], seed=4),
    }


def make_engine(setup: dict[str, Path], max_loras: int = 2, **overrides: object) -> EngineCore:
    settings: dict[str, object] = dict(
        model=str(setup["base"]),
        dtype="float32",
        device="cpu",
        num_threads=NUM_THREADS,
        kv_cache_memory_bytes=4 << 20,
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=8,
        lora_modules=(("a", str(setup["a"])), ("b", str(setup["b"]))),
    )
    settings.update(overrides)
    return EngineCore(EngineConfig(**settings))  # type: ignore[arg-type]


def add(request_id: str, prompt: list[int], lora: str | None) -> AddRequest:
    return AddRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=greedy_params(MAX_TOKENS),
        arrival_time=0.0,
        lora_request=LoRARequest(lora) if lora is not None else None,
    )


def hf_peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)  # type: ignore[assignment]
    model.eval()
    return hf_greedy(model, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def engine(lora_setup: dict[str, Path]) -> EngineCore:
    return make_engine(lora_setup)


PROMPTS = random_prompts(11, 3, 999, 5, 40)


def test_greedy_matches_hf_peft(engine: EngineCore, lora_setup: dict[str, Path]) -> None:
    outputs: dict[str | None, list[list[int]]] = {}
    for lora in (None, "a", "b"):
        requests = [add(f"{lora}-{i}", p, lora) for i, p in enumerate(PROMPTS)]
        run = run_to_completion(engine, requests)
        outputs[lora] = [run.records[r.request_id].token_ids for r in requests]
        adapter = lora_setup[lora] if lora is not None else None
        assert outputs[lora] == hf_peft_greedy(lora_setup["base"], adapter, PROMPTS), lora
    assert outputs["a"] != outputs[None] and outputs["b"] != outputs[None]
    assert outputs["a"] != outputs["b"]


@pytest.mark.parametrize(("max_loras", "num_blocks"), [(1, None), (2, None), (2, 8)])
def test_mixed_batch_equals_alone(
    lora_setup: dict[str, Path], max_loras: int, num_blocks: int | None
) -> None:
    overrides: dict[str, object] = {"enable_prefix_caching": False}
    if num_blocks is not None:  # a KV cache so small that requests get preempted
        overrides.update(block_size=8, kv_cache_memory_bytes=num_blocks * 2 * 2 * 8 * 2 * 16 * 4)
    engine = make_engine(lora_setup, max_loras=max_loras, **overrides)
    prompts = random_prompts(5, 6, 999, 3, 30)
    loras = [None, "a", "b", "a", None, "b"]
    requests = [
        add(f"r{i}", p, lora) for i, (p, lora) in enumerate(zip(prompts, loras, strict=True))
    ]
    alone = {r.request_id: run_to_completion(engine, [r]).records[r.request_id] for r in requests}
    mixed = run_to_completion(engine, requests)
    for r in requests:
        assert mixed.records[r.request_id].token_ids == alone[r.request_id].token_ids
    # Never more adapters in one step than there are slots.
    slots_in_plan: dict[str, int] = {}
    for plan in mixed.plans:
        for new in plan.new_requests:
            slots_in_plan[new.request_id] = new.lora_slot
        used = {slots_in_plan[r] for r in plan.num_scheduled_tokens} - {0}
        assert len(used) <= max_loras
    if num_blocks is not None:
        assert engine.scheduler.num_preemptions > 0
        assert engine.lora is not None and not engine.lora.slots.num_users
    elif max_loras == 2:  # all three models shared a step
        assert any(
            {slots_in_plan[r] for r in plan.num_scheduled_tokens} == {0, 1, 2}
            for plan in mixed.plans
        )


def test_prefix_cache_is_keyed_by_adapter(engine: EngineCore) -> None:
    prompt = random_prompts(3, 1, 999, 70, 70)[0]

    def cached(request_id: str, lora: str | None) -> int:
        run = run_to_completion(engine, [add(request_id, prompt, lora)])
        return run.records[request_id].num_cached_tokens

    engine.reset_prefix_cache()
    assert cached("p-a1", "a") == 0
    assert cached("p-a2", "a") == 64  # the same adapter shares full blocks
    assert cached("p-b", "b") == 0  # another adapter never does
    assert cached("p-base", None) == 0
    assert cached("p-base2", None) == 64


def test_add_remove_errors(engine: EngineCore, lora_setup: dict[str, Path]) -> None:
    with pytest.raises(LoRAError) as e:
        engine.add_lora("x", "/nonexistent/adapter")
    assert e.value.kind == "not_found"
    with pytest.raises(LoRAError, match="max_lora_rank 8") as e:
        engine.add_lora("big", str(lora_setup["big"]))
    assert e.value.kind == "invalid"
    with pytest.raises(LoRAError, match="already") as e:
        engine.add_lora("a", str(lora_setup["c"]))
    assert e.value.kind == "invalid"
    with pytest.raises(LoRAError) as e:
        engine.remove_lora("nope")
    assert e.value.kind == "not_found"
    delta = engine.add_request(add("unknown", [1, 2, 3], "nope"))
    assert delta is not None and delta.error is not None and "cannot be found" in delta.error
    assert not engine.has_work()


def test_eviction_pinning_and_reload(lora_setup: dict[str, Path]) -> None:
    engine = make_engine(lora_setup, max_loras=2)
    engine.add_lora("c", str(lora_setup["c"]))
    prompt = [5, 6, 7, 8]
    alone = {
        name: run_to_completion(engine, [add(f"first-{name}", prompt, name)])
        .records[f"first-{name}"]
        .token_ids
        for name in ("a", "b", "c")
    }

    def slots() -> dict[str, int]:
        return {d["lora_name"]: d["slot"] for d in engine.list_loras()}

    assert slots()["a"] == 0 and slots()["b"] and slots()["c"]  # a was evicted (LRU)
    engine.pin_lora("a")  # loads a now, evicting b (the least recently used)
    assert slots()["a"] and slots()["b"] == 0
    for name in ("b", "c", "b"):  # b and c take turns in the one unpinned slot
        run = run_to_completion(engine, [add(f"again-{name}", prompt, name)])
        assert run.records[f"again-{name}"].token_ids == alone[name]
        assert slots()["a"], "a pinned adapter was evicted"
    # Pinning the last slot is refused while a queued request needs another adapter.
    assert engine.add_request(add("queued-c", prompt, "c")) is None
    with pytest.raises(LoRAError, match="every LoRA slot") as e:
        engine.pin_lora("b")
    assert e.value.kind == "busy"
    with pytest.raises(LoRAError) as e:
        engine.remove_lora("c")  # in use by the queued request
    assert e.value.kind == "busy"
    engine.abort_requests(["queued-c"])
    # With every slot pinned, an unpinned adapter's request is refused up front.
    engine.pin_lora("b")
    delta = engine.add_request(add("refused", prompt, "c"))
    assert delta is not None and delta.error is not None and "pinned" in delta.error
    # A removed adapter's name can be loaded again with other weights.
    engine.remove_lora("c")
    engine.add_lora("c", str(lora_setup["a"]))
    assert engine.list_loras()[-1]["lora_path"] == str(lora_setup["a"])
    engine.check_invariants()


def test_request_loads_adapter_by_path(engine: EngineCore, lora_setup: dict[str, Path]) -> None:
    request = add("by-path", [9, 8, 7], None)
    request.lora_request = LoRARequest("c-by-path", 7, str(lora_setup["c"]))
    run = run_to_completion(engine, [request])
    assert len(run.records["by-path"].token_ids) == MAX_TOKENS
    entry = next(d for d in engine.list_loras() if d["lora_name"] == "c-by-path")
    assert entry["lora_int_id"] == 7
    engine.remove_lora("c-by-path")
