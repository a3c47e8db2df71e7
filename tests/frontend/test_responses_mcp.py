"""MCP tool servers in /v1/responses: a real MCP server of the test's own, over
streamable HTTP and over stdio, called by the model through the API server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest

from pagoda.frontend.api.mcp_tools import parse_tool_server
from tests.frontend.conftest import MODEL_NAME, Server
from tests.frontend.servers import REPO, Processes, api_argv, free_port, wait_healthy

CALC = str(REPO / "tests" / "frontend" / "mcp_calc.py")
ASK = "What is 2 + 3? Use the add tool."
FORCE_ADD = {"type": "mcp", "server_label": "calc", "name": "add"}


def test_parse_tool_server() -> None:
    assert parse_tool_server("http://127.0.0.1:9/mcp").url == "http://127.0.0.1:9/mcp"
    labelled = parse_tool_server("calc=https://h:1/mcp?x=1")
    assert (labelled.label, labelled.url) == ("calc", "https://h:1/mcp?x=1")
    local = parse_tool_server("c=stdio:python srv.py --flag=1")
    assert local.label == "c" and local.command == ("python", "srv.py", "--flag=1")
    assert parse_tool_server("stdio:python srv.py").label == ""
    for bad in ("ftp://h/x", "stdio:", "just-a-name"):
        with pytest.raises(ValueError):
            parse_tool_server(bad)


@pytest.fixture(scope="module")
def mcp_api(server: Server) -> Iterator[tuple[str, psutil.Process]]:
    """A second API server on the shared engine, with an HTTP and a stdio MCP server."""
    procs = Processes()
    mcp_port = free_port()
    procs.start([sys.executable, CALC, "http", str(mcp_port)], "mcp")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the MCP server answers (any status) when it is up
        try:
            httpx.get(f"http://127.0.0.1:{mcp_port}/mcp", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    port = free_port()
    api = procs.start(
        api_argv(
            server.address,
            port,
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--tool-server",
            f"http://127.0.0.1:{mcp_port}/mcp",
            "--tool-server",
            f"local=stdio:{sys.executable} {CALC} stdio",
        ),
        "api-mcp",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs)
        yield base, psutil.Process(api.pid)
    finally:
        procs.stop()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def _check_calls(output: list[Any]) -> list[Any]:
    kinds = [item.type for item in output]
    assert kinds[0] == "mcp_list_tools"
    listed = {t.name for t in output[0].tools}
    assert listed == {"add", "fail"}
    calls = [item for item in output if item.type == "mcp_call"]
    assert calls and calls[0].name == "add" and calls[0].server_label == "calc"
    args = json.loads(calls[0].arguments)
    assert calls[0].error is None and calls[0].output == str(args["a"] + args["b"])
    assert len(calls) <= 8  # bounded even if the model keeps calling
    return calls


@pytest.mark.slow
def test_forced_mcp_call_runs_on_the_server(mcp_api: tuple[str, psutil.Process]) -> None:
    base, _ = mcp_api
    r = _client(base).responses.create(
        model=MODEL_NAME,
        input=ASK,
        tools=[{"type": "mcp", "server_label": "calc", "require_approval": "never"}],
        tool_choice=FORCE_ADD,  # type: ignore[arg-type]
        max_output_tokens=60,
        temperature=0,
    )
    calls = _check_calls(r.output)
    assert r.status in ("completed", "incomplete")
    if r.output[-1].type == "message":
        assert r.output_text
    assert r.usage and r.usage.input_tokens > 0
    assert len(calls) >= 1


@pytest.mark.slow
def test_streamed_mcp_events(mcp_api: tuple[str, psutil.Process]) -> None:
    base, _ = mcp_api
    events = list(
        _client(base).responses.create(
            model=MODEL_NAME,
            input=ASK,
            tools=[{"type": "mcp", "server_label": "calc", "require_approval": "never"}],
            tool_choice=FORCE_ADD,  # type: ignore[arg-type]
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for expected in (
        "response.mcp_list_tools.in_progress",
        "response.mcp_list_tools.completed",
        "response.mcp_call.in_progress",
        "response.mcp_call_arguments.done",
        "response.mcp_call.completed",
    ):
        assert expected in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    _check_calls(final.output)
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")


@pytest.mark.slow
def test_failing_tool_is_reported_and_the_stdio_session_closes(
    mcp_api: tuple[str, psutil.Process],
) -> None:
    base, api = mcp_api
    c = _client(base)
    r = c.responses.create(
        model=MODEL_NAME,
        input="Call the fail tool.",
        tools=[{"type": "mcp", "server_label": "local", "allowed_tools": ["fail"]}],
        tool_choice={"type": "mcp", "server_label": "local", "name": "fail"},  # type: ignore[arg-type]
        max_output_tokens=40,
        temperature=0,
    )
    assert [t.name for t in r.output[0].tools] == ["fail"]  # type: ignore[union-attr]
    call = r.output[1]
    assert call.type == "mcp_call" and call.server_label == "local"
    assert call.error is not None and call.output is None
    # The model sees the error and answers; the tool session (a stdio child) is gone.
    with pytest.raises(openai.BadRequestError):  # fails after the session opened
        c.responses.create(
            model=MODEL_NAME,
            input="x",
            tools=[{"type": "mcp", "server_label": "local"}],
            tool_choice={"type": "mcp", "server_label": "local", "name": "nope"},  # type: ignore[arg-type]
        )
    body = {
        "model": MODEL_NAME,
        "input": "Write a very long story.",
        "tools": [{"type": "mcp", "server_label": "local"}],
        "tool_choice": "none",
        "max_output_tokens": 400,
        "stream": True,
    }
    with httpx.stream("POST", base + "/v1/responses", json=body, timeout=60) as stream:
        for line in stream.iter_lines():
            if "output_text.delta" in line:
                break  # the client goes away mid-answer
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _tool_children(api):
        time.sleep(0.2)
    assert _tool_children(api) == []


def _tool_children(api: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in api.children(recursive=True):
        try:
            if CALC in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "tools",
    [
        [{"type": "mcp", "server_label": "elsewhere"}],
        [{"type": "mcp", "server_label": "calc", "require_approval": "always"}],
        [{"type": "mcp", "server_label": "calc"}, {"type": "mcp", "server_label": "local"}],
        [{"type": "mcp", "server_label": "calc", "allowed_tools": "add"}],
    ],
)
def test_bad_mcp_tools_are_400(mcp_api: tuple[str, psutil.Process], tools: list[Any]) -> None:
    base, _ = mcp_api
    r = httpx.post(
        base + "/v1/responses", json={"model": MODEL_NAME, "input": "x", "tools": tools}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


@pytest.mark.slow
def test_unreachable_tool_server_stops_startup(server: Server) -> None:
    argv = api_argv(server.address, free_port(), "--tool-server", "http://127.0.0.1:9/mcp")
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "MCP tool server http://127.0.0.1:9/mcp failed" in done.stdout + done.stderr
