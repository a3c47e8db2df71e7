"""A small MCP server for the tests: `python mcp_calc.py stdio` or `... http PORT`."""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("calc")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


@server.tool()
def fail(reason: str) -> str:
    """Always fails, with the given reason."""
    raise ValueError(f"failed on purpose: {reason}")


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
