"""MCP tool servers (`--tool-server`) for /v1/responses.

An operator names the Model Context Protocol servers an API server may use;
a request picks among them with `{"type": "mcp", "server_label": ...}`
tools. Clients never make the API server connect anywhere else.

    --tool-server http://127.0.0.1:8001/mcp          streamable HTTP
    --tool-server calc=http://127.0.0.1:8001/mcp     ... with a label
    --tool-server calc=stdio:python calc_server.py   a local command over stdio

Each request that uses MCP opens its own session to each server it names
(`McpSession`, an async context manager), lists the tools, runs the calls
the model makes and closes the sessions when the request ends: success,
error or a client that went away.
"""

from __future__ import annotations

import json
import shlex
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from pagoda.frontend.api.errors import APIError

# A tool call or listing that takes longer fails the call, not the request.
MCP_TIMEOUT_SECONDS = 60.0
MAX_OUTPUT_CHARS = 64 << 10


@dataclass(frozen=True)
class ToolServer:
    """One configured MCP server: where it is, and the label requests use."""

    label: str  # "" until resolve() names it after the server
    url: str | None = None  # streamable HTTP
    command: tuple[str, ...] = ()  # stdio

    def target(self) -> Any:
        """What mcp.Client connects to."""
        if self.url is not None:
            return self.url
        from mcp import StdioServerParameters

        return StdioServerParameters(command=self.command[0], args=list(self.command[1:]))


def parse_tool_server(spec: str) -> ToolServer:
    """`[label=]URL` or `[label=]stdio:COMMAND ARGS` (ValueError when malformed)."""
    label, sep, rest = spec.partition("=")
    if not sep or "://" in label or label.startswith("stdio:"):
        label, rest = "", spec
    rest = rest.strip()
    if rest.startswith("stdio:"):
        command = tuple(shlex.split(rest[len("stdio:") :]))
        if not command:
            raise ValueError(f"--tool-server {spec!r}: stdio: needs a command")
        return ToolServer(label, command=command)
    parsed = urlparse(rest)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--tool-server {spec!r}: expected http(s)://host:port/path or stdio:CMD")
    return ToolServer(label, url=rest)


@dataclass(frozen=True)
class McpRequest:
    """What one `{"type": "mcp"}` tool of a request asks for."""

    server: ToolServer
    allowed_tools: tuple[str, ...] | None = None


def mcp_requests(
    tools: list[dict[str, Any]] | None, servers: dict[str, ToolServer]
) -> tuple[list[dict[str, Any]], list[McpRequest]]:
    """Split a request's tools into function tools and checked MCP requests."""
    functions: list[dict[str, Any]] = []
    wanted: list[McpRequest] = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "mcp":
            functions.append(tool)
            continue
        label = tool.get("server_label")
        if label not in servers:
            known = ", ".join(sorted(servers)) or "none (start the server with --tool-server)"
            raise APIError(
                400, f"unknown MCP server_label {label!r}; configured: {known}", f"tools.{i}"
            )
        if tool.get("require_approval") not in (None, "never"):
            raise APIError(
                400, 'only require_approval "never" is supported', f"tools.{i}.require_approval"
            )
        allowed = tool.get("allowed_tools")
        if isinstance(allowed, dict):
            allowed = allowed.get("tool_names")
        if allowed is not None and (
            not isinstance(allowed, list) or not all(isinstance(n, str) for n in allowed)
        ):
            raise APIError(400, "allowed_tools must be a list of names", f"tools.{i}.allowed_tools")
        wanted.append(McpRequest(servers[label], tuple(allowed) if allowed is not None else None))
    return functions, wanted


@dataclass
class McpSession:
    """The MCP sessions of one request: open them, list tools, run calls, close."""

    requests: list[McpRequest]
    owner: dict[str, tuple[str, Any]] = field(default_factory=dict)  # tool -> (label, client)
    functions: list[dict[str, Any]] = field(default_factory=list)  # as chat tools
    listings: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)
    _stack: AsyncExitStack = field(default_factory=AsyncExitStack)

    async def __aenter__(self) -> McpSession:
        from mcp import Client

        try:
            for request in self.requests:
                server = request.server
                client = await self._stack.enter_async_context(
                    Client(server.target(), read_timeout_seconds=MCP_TIMEOUT_SECONDS)
                )
                listed = await client.list_tools()
                tools = []
                for tool in listed.tools:
                    if request.allowed_tools is not None and tool.name not in request.allowed_tools:
                        continue
                    if tool.name in self.owner:
                        raise APIError(
                            400, f"MCP tool {tool.name!r} is offered by two servers", "tools"
                        )
                    self.owner[tool.name] = (server.label, client)
                    entry = {
                        "name": tool.name,
                        "description": tool.description or "",
                        "input_schema": tool.input_schema,
                    }
                    tools.append(entry)
                    self.functions.append(
                        {
                            "type": "function",
                            "function": {
                                "name": tool.name,
                                "description": tool.description or "",
                                "parameters": tool.input_schema,
                            },
                        }
                    )
                self.listings.append((server.label, tools))
        except APIError:
            await self._stack.aclose()
            raise
        except Exception as e:  # noqa: BLE001 - the tool server is a dependency that failed
            await self._stack.aclose()
            raise APIError(
                424, f"MCP server could not be reached or listed: {type(e).__name__}: {e}"[:500]
            ) from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def label_of(self, name: str) -> str | None:
        entry = self.owner.get(name)
        return entry[0] if entry else None

    async def call(self, name: str, arguments: str) -> tuple[str | None, dict[str, Any] | None]:
        """(output, None) or (None, error) in OpenAI's mcp_call shapes."""
        _label, client = self.owner[name]
        try:
            args = json.loads(arguments or "{}")
        except ValueError:
            return None, {"type": "mcp_protocol_error", "code": -32602, "message": "bad arguments"}
        if not isinstance(args, dict):
            args = {}
        try:
            result = await client.call_tool(name, args)
        except Exception as e:  # noqa: BLE001 - a failed call is reported to the model
            message = f"{type(e).__name__}: {e}"[:2000]
            return None, {"type": "mcp_protocol_error", "code": -32603, "message": message}
        text = "\n".join(
            getattr(block, "text", "") or json.dumps(block.model_dump(mode="json"))
            for block in result.content
        )[:MAX_OUTPUT_CHARS]
        if result.is_error:
            return None, {"type": "mcp_tool_execution_error", "content": text}
        return text, None


async def resolve(servers: list[ToolServer]) -> dict[str, ToolServer]:
    """Connect to each configured server once at start-up: label -> server.

    A server given without a label is named by the name it reports. Raises
    ValueError when one cannot be reached or two share a label.
    """
    from mcp import Client

    named: dict[str, ToolServer] = {}
    for server in servers:
        try:
            async with Client(server.target(), read_timeout_seconds=MCP_TIMEOUT_SECONDS) as client:
                await client.list_tools()
                reported = client.server_info.name if client.server_info else ""
        except Exception as e:  # noqa: BLE001 - said once, at start-up
            where = server.url or " ".join(server.command)
            raise ValueError(f"MCP tool server {where} failed: {type(e).__name__}: {e}") from e
        label = server.label or reported or urlparse(server.url or "").hostname or "mcp"
        if label in named:
            raise ValueError(f"two MCP tool servers are labelled {label!r}")
        named[label] = ToolServer(label, server.url, server.command)
    return named
