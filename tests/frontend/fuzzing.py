"""Schemathesis fuzzing of the served OpenAPI schema, shared by the test and scripts/fuzz.py.

Every route of /openapi.json but the engine-control ones (sleep, wake-up,
profiling, prefix-cache reset: they change the server's state for everyone)
gets generated requests; none may answer 5xx, and every error body must be in
its route's own shape. Generated token budgets are clamped (max_tokens ≤ 8,
n ≤ 2, at most 2 prompts or batch items; inside `sampling_params` for
/inference/v1/generate) so a run costs seconds per route on a CPU, not
minutes: the fuzzer explores the shape of requests, not long generations.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

# State-changing admin routes: fuzzing them would put the engine to sleep.
EXCLUDED = re.compile(r"^/(sleep|wake[-_]up|reset[-_]prefix[-_]cache|(start|stop)[-_]profile)$")
_BUDGET_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")


def clamp(body: Any, model: str | None = None, path: str = "") -> Any:
    """Keep generated token budgets small (see the module docstring).

    A generated `model` is a random string, and a 404 ends the request before
    anything else is looked at: it is replaced by the served name so that the
    rest of the body is explored (the unknown-model 404 has its own tests).
    """
    if isinstance(body, dict):
        if model is not None and "model" in body:
            body["model"] = model
        # Many prompts or batch items multiply the cost without new code paths.
        for name in ("prompt", "requests", "items"):
            if isinstance(body.get(name), list) and len(body[name]) > 2:
                body[name] = body[name][:2]
        if isinstance(body.get("requests"), list):
            for item in body["requests"]:
                clamp(item, model, "/v1/chat/completions")
        # /inference/v1/generate: the budget is in vLLM's SamplingParams (and
        # unknown names are a 400 in its bodies, so nothing is added at the top).
        if isinstance(body.get("sampling_params"), dict):
            clamp(body["sampling_params"])
        # An absent budget means "up to the context length": seconds per request.
        budget = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        if (
            path != "/v1/messages"
            and not path.startswith("/inference/")
            and not any(body.get(f) is not None for f in _BUDGET_FIELDS[:3])
        ):
            body[budget] = 8
        # Integral floats (924.0) count too: the routes accept them as ints.
        for name in _BUDGET_FIELDS:
            value = body.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                body[name] = type(value)(max(-1, min(value, 8)))
        n = body.get("n")
        if isinstance(n, int | float) and not isinstance(n, bool):
            body["n"] = type(n)(min(n, 2))
    return body


def shape_problem(path: str, status: int, content: bytes) -> str | None:
    """Why an answer breaks the rules (None when it keeps them)."""
    if status >= 500:
        return f"{status}: {content[:300]!r}"
    if status < 400:
        return None
    try:
        body = json.loads(content)
    except ValueError:
        return f"{status} with a non-JSON body: {content[:200]!r}"
    if path.startswith("/v1/messages"):
        ok = isinstance(body, dict) and body.get("type") == "error" and "error" in body
    else:
        err = body.get("error") if isinstance(body, dict) else None
        ok = isinstance(err, dict) and isinstance(err.get("message"), str)
    return None if ok else f"{status} in the wrong error shape: {content[:200]!r}"


@dataclass
class RouteResult:
    route: str
    examples: int = 0
    server_errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def operations(base_url: str) -> list[Any]:
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    return [op for op in ops if not EXCLUDED.match(op.path)]


def fuzz_operation(
    base_url: str, op: Any, max_examples: int, model: str | None, timeout: float = 30.0
) -> RouteResult:
    """Send `max_examples` generated requests to one operation; collect what came back."""
    result = RouteResult(f"{op.method.upper()} {op.path}")
    client = httpx.Client(base_url=base_url, timeout=timeout)

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    @given(case=op.as_strategy())
    def run(case: Any) -> None:
        body = clamp(case.body, model, op.path) if isinstance(case.body, dict) else case.body
        kwargs: dict[str, Any] = {"params": case.query, "headers": case.headers}
        if body is not None and not isinstance(body, schemathesis.core.NotSet):
            kwargs["json"] = body
        result.examples += 1
        try:
            response = client.request(case.method, case.formatted_path, **kwargs)
        except httpx.TimeoutException:
            # The whole body: the interesting field may be anywhere in it.
            result.problems.append(f"{json.dumps(body, default=str)} -> no answer in {timeout} s")
            return
        result.statuses[response.status_code] = result.statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            result.server_errors += 1
        problem = shape_problem(op.path, response.status_code, response.content)
        if problem is not None:
            result.problems.append(f"{json.dumps(body, default=str)} -> {problem}")

    start = time.monotonic()
    try:
        run()
    finally:
        client.close()
    result.seconds = time.monotonic() - start
    return result


def fuzz_all(
    base_url: str,
    max_examples: int,
    report: Callable[[RouteResult], None] | None = None,
    routes: list[str] | None = None,
) -> list[RouteResult]:
    results = []
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    for op in operations(base_url):
        if routes and op.path not in routes:
            continue
        res = fuzz_operation(base_url, op, max_examples, model)
        results.append(res)
        if report is not None:
            report(res)
    return results
