"""The control-call table (protocol/control.py) against the code that answers it."""

from __future__ import annotations

import inspect

import pytest

from pagoda.engine_core.core.engine_utilities import EngineUtilities
from pagoda.engine_core.core.training import TrainingControls
from pagoda.protocol.control import ADMIN_RPC_CALLS, CONTROL_CALLS


@pytest.mark.parametrize("name", sorted(n for n, c in CONTROL_CALLS.items() if not c.on_server))
def test_each_engine_call_matches_its_method(name: str) -> None:
    """The declared arguments are the method's, in order, required where it has no default."""
    call = CONTROL_CALLS[name]
    method = getattr(EngineUtilities, name, None) or getattr(TrainingControls, name)
    signature = inspect.signature(method)
    params = [p for p in signature.parameters.values() if p.name != "self"]
    assert [p.name for p in params] == [p.name for p in call.params]
    for declared, actual in zip(call.params, params, strict=True):
        assert declared.required == (actual.default is inspect.Parameter.empty)


def test_bind_names_and_checks_arguments() -> None:
    assert CONTROL_CALLS["sleep"].bind([2], {}) == ([], {"level": 2})
    assert CONTROL_CALLS["wake_up"].bind([], {"tags": ["weights"]}) == ([], {"tags": ["weights"]})
    assert CONTROL_CALLS["echo"].bind([1, "x"], {"k": 2}) == ([1, "x"], {"k": 2})
    for name, args, kwargs, needle in [
        ("get_stats", [], {"bogus": 1}, "bogus"),
        ("get_stats", [1], {}, "at most 0"),
        ("sleep", ["1"], {}, "level"),
        ("sleep", [True], {}, "level"),
        ("sleep", [1], {"level": 1}, "twice"),
        ("add_lora", ["a"], {}, "lora_path"),
        ("wake_up", [["weights", 3]], {}, "tags"),
    ]:
        with pytest.raises(ValueError, match=needle):
            CONTROL_CALLS[name].bind(args, kwargs)


def test_profiling_and_lora_admin_are_not_admin_rpc() -> None:
    assert "start_profile" not in ADMIN_RPC_CALLS and "add_lora" not in ADMIN_RPC_CALLS
    assert {"sleep", "wake_up", "get_stats", "ping", "echo"} <= ADMIN_RPC_CALLS
