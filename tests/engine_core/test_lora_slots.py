"""LoRASlots: LRU eviction of unused adapters, pins, use counts. Pure python."""

from __future__ import annotations

import pytest

from pagoda.engine_core.core.lora_slots import LoRASlots


def test_lru_eviction_skips_used_and_pinned() -> None:
    slots = LoRASlots(2)
    assert slots.acquire("a") == 1
    assert slots.acquire("b") == 2
    assert slots.take_pending_loads() == [(1, "a"), (2, "b")]
    assert not slots.can_acquire("c")  # both in use
    slots.release("a")
    slots.release("b")
    slots.acquire("a")  # a is now the most recently used
    slots.release("a")
    assert slots.acquire("c") == 2  # b was the least recently used
    assert slots.take_pending_loads() == [(2, "c")]
    assert "b" not in slots.slot_of
    slots.release("c")
    slots.pin("c")
    slots.acquire("d")  # evicts a, not the pinned c
    assert set(slots.slot_of) == {"c", "d"}
    slots.check_invariants()


def test_all_slots_pinned_refuses_another_pin() -> None:
    slots = LoRASlots(1)
    slots.pin("a")
    assert not slots.can_acquire("b")
    assert slots.can_acquire("a")
    with pytest.raises(ValueError, match="pinned"):
        slots.pin("b")
    slots.remove("a")
    assert slots.can_acquire("b")
    slots.check_invariants()


def test_lora_module_flags_round_trip() -> None:
    import argparse

    from pagoda.engine_core.args import (
        add_engine_args,
        engine_args_to_argv,
        engine_config_from_args,
    )

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = [
        "--enable-lora",
        "--max-loras",
        "3",
        "--lora-modules",
        "a=/x/a",
        "--lora-modules",
        '{"name": "b", "path": "/x/b=c"}',
    ]
    config = engine_config_from_args(parser.parse_args(argv))
    assert config.lora_modules == (("a", "/x/a"), ("b", "/x/b=c"))
    assert config.max_loras == 3 and config.enable_lora
    again = engine_config_from_args(parser.parse_args(engine_args_to_argv(parser.parse_args(argv))))
    assert again == config
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "no-path"])
