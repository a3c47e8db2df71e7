"""The engine's control calls, declared once: every place that sends, routes,
allows or answers a `UtilityCall` reads this table.

    engine_core/server.py         answers each by name (EngineCore's method of
                                  that name; `ping` and `echo` itself), after
                                  `bind` checked its arguments
    frontend/engine_client.py     InprocClient answers the same way in process;
                                  AsyncMPClient takes each call's timeout
    frontend/dp_client.py         sends each to every engine, folds the answers
    frontend/api/serving_admin.py POST /collective_rpc allows those with admin_rpc

Under data parallel every control call goes to every engine core: the
engines must stay alike (the same adapters, all asleep or all awake).
`combine` says how their answers fold into one:

    "first"  the first engine's answer (they agree; stop_profile's trace path
             stands for the others, which write theirs beside it)
    "sum"    a dict of statistics: its integer fields summed, each engine's
             own dict under "engines"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec


class Param(msgspec.Struct, frozen=True):
    """One argument of a control call; `shape` is a type msgspec checks values against."""

    name: str
    shape: object
    required: bool = False


class ControlCall(msgspec.Struct, frozen=True):
    """One control call: its arguments, who may send it, how DP folds its answers."""

    name: str
    params: tuple[Param, ...] = ()
    variadic: bool = False  # takes any arguments, passed through as they came
    admin_rpc: bool = False  # POST /collective_rpc may send it
    combine: Literal["first", "sum"] = "first"
    timeout_s: float = 30.0  # how long a caller waits by default
    # Answered by the engine-core server itself, not by an EngineCore method.
    on_server: bool = False
    # Reads or changes whether the engine sleeps: the API server notes the answer.
    sleep_state: bool = False

    def bind(
        self, args: Sequence[object], kwargs: Mapping[str, object]
    ) -> tuple[list[object], dict[str, object]]:
        """The arguments to call with: each checked against its shape, positional
        ones given their names. ValueError says what is wrong."""
        if self.variadic:
            return list(args), dict(kwargs)
        if len(args) > len(self.params):
            raise ValueError(
                f"{self.name} takes at most {len(self.params)} arguments, got {len(args)}"
            )
        names = {p.name for p in self.params}
        for key in kwargs:
            if key not in names:
                raise ValueError(f"{self.name} has no argument {key!r}")
        bound: dict[str, object] = {}
        for i, param in enumerate(self.params):
            if i < len(args):
                if param.name in kwargs:
                    raise ValueError(f"{self.name} got {param.name!r} twice")
                value = args[i]
            elif param.name in kwargs:
                value = kwargs[param.name]
            elif param.required:
                raise ValueError(f"{self.name} needs {param.name!r}")
            else:
                continue  # the method's default
            try:
                bound[param.name] = msgspec.convert(value, param.shape)
            except msgspec.ValidationError as e:
                raise ValueError(f"{self.name}: bad {param.name!r}: {e}") from None
        return [], bound


_CALLS = (
    ControlCall("reset_prefix_cache", admin_rpc=True),
    ControlCall("get_stats", admin_rpc=True, combine="sum"),
    ControlCall("check_invariants", admin_rpc=True),
    ControlCall("start_profile"),
    ControlCall("stop_profile", timeout_s=120.0),
    ControlCall("sleep", (Param("level", int),), admin_rpc=True, timeout_s=300.0, sleep_state=True),
    ControlCall(
        "wake_up",
        (Param("tags", list[str] | None),),
        admin_rpc=True,
        timeout_s=300.0,
        sleep_state=True,
    ),
    ControlCall("is_sleeping", admin_rpc=True, sleep_state=True),
    ControlCall(
        "add_lora",
        (
            Param("lora_name", str, required=True),
            Param("lora_path", str, required=True),
            Param("lora_int_id", int),
        ),
        timeout_s=120.0,
    ),
    ControlCall("remove_lora", (Param("lora_name", str, required=True),)),
    ControlCall("pin_lora", (Param("lora_name", str, required=True),)),
    ControlCall("list_loras"),
    # RL training (engine_core/core/training.py).
    ControlCall("pause", (Param("mode", str), Param("clear_cache", bool))),
    ControlCall("resume"),
    ControlCall("is_paused"),
    ControlCall("pause_state", combine="sum"),
    ControlCall(
        "init_weight_transfer_engine",
        (Param("init_info", dict[str, object], required=True),),
        timeout_s=600.0,
    ),
    ControlCall(
        "update_weights", (Param("update_info", dict[str, object], required=True),), timeout_s=900.0
    ),
    ControlCall("start_weight_update"),
    ControlCall("finish_weight_update", (Param("weight_version", int | str | None),)),
    ControlCall("weight_info"),
    ControlCall("get_world_size"),
    ControlCall(
        "weight_checker",
        (Param("action", str), Param("baseline", dict[str, str] | None)),
        timeout_s=300.0,
    ),
    ControlCall("ping", admin_rpc=True, timeout_s=2.0, on_server=True),
    ControlCall("echo", variadic=True, admin_rpc=True, on_server=True),
)

# Every control call by name.
CONTROL_CALLS: dict[str, ControlCall] = {call.name: call for call in _CALLS}
# What POST /collective_rpc may send; anything else is a 400 there.
ADMIN_RPC_CALLS = frozenset(call.name for call in _CALLS if call.admin_rpc)
DEFAULT_TIMEOUT_S = 30.0


def timeout_of(method: str) -> float:
    """How long a caller waits for `method` by default."""
    call = CONTROL_CALLS.get(method)
    return call.timeout_s if call is not None else DEFAULT_TIMEOUT_S
