"""The Responses API's request body and its translation to a chat request.

A Responses request is a chat request in another shape: `instructions` is a
system message, `input` items are messages, function calls and their
outputs, flat function tools become chat tools and `text.format` becomes
`response_format`. Translating once lets /v1/responses share the chat
route's checks, template rendering, tool parsing and structured output.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.openai_models import ChatCompletionRequest

MAX_INPUT_ITEMS = 4096


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's fields; unknown ones are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    max_tool_calls: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    # vLLM's sampling extensions, as on chat
    seed: int | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    priority: int = 0


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as chat messages (without instructions)."""
    if isinstance(req.input, str):
        if not req.input and req.previous_response_id is None:
            raise APIError(400, "input must not be empty", "input")
        return [{"role": "user", "content": req.input}]
    if len(req.input) > MAX_INPUT_ITEMS:
        raise APIError(400, f"at most {MAX_INPUT_ITEMS} input items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        messages.extend(_item_messages(item, f"input.{i}", messages))
    if not messages and req.previous_response_id is None:
        raise APIError(400, "input must not be empty", "input")
    return messages


def _item_messages(
    item: dict[str, Any], where: str, so_far: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(
                400, "a message's role must be user, assistant, system or developer", where
            )
        return [{"role": role, "content": _content_text(item.get("content"), where)}]
    if kind == "function_call":
        call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
        if not all(isinstance(v, str) for v in (call_id, name, arguments)):
            raise APIError(400, "a function_call needs string call_id, name and arguments", where)
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        last = so_far[-1] if so_far else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)  # parallel calls share one assistant turn
            return []
        return [{"role": "assistant", "content": "", "tool_calls": [call]}]
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str):
            raise APIError(400, "a function_call_output needs a string call_id", where)
        if not isinstance(output, str):
            output = _content_text(output, where) if isinstance(output, list) else None
        if output is None:
            raise APIError(400, "a function_call_output's output must be a string", where)
        return [{"role": "tool", "tool_call_id": call_id, "content": output}]
    if kind == "reasoning":
        return []  # nothing of it is rendered back into the prompt
    raise APIError(
        400,
        f"input item type {kind!r} is not supported "
        "(message, function_call, function_call_output, reasoning)",
        where,
    )


def _content_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of text parts", where)
    texts = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") not in ("input_text", "output_text", "text")
            or not isinstance(part.get("text"), str)
        ):
            raise APIError(400, "only text content parts are supported", where)
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools → chat tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise APIError(400, f"tool type {kind!r} is not supported here", f"tools.{i}")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "mcp":
        if isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        return "required"
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(
                400, 'a named tool_choice is {"type": "function", "name": ...}', "tool_choice"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` → chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format.type must be text, json_object or json_schema", "text")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def to_chat_request(
    req: ResponsesRequest,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
) -> ChatCompletionRequest:
    """The chat request this Responses request means.

    `conversation` is the earlier turns (from previous_response_id) and this
    request's input; instructions are not part of it, as a previous response's
    instructions are not carried over (OpenAI's rule). `tools` and
    `tool_choice`, when given, replace the request's own (chat-shaped: the
    server adds MCP tools as functions and relaxes the choice after a round).
    """
    messages = list(conversation)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    extra = {k: v for k, v in (req.model_extra or {}).items() if k in _PASSED_THROUGH}
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": tools if tools is not None else chat_tools(req.tools),
        "tool_choice": tool_choice
        if tool_choice is not None
        else chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "response_format": response_format(req.text),
        "seed": req.seed,
        "top_k": req.top_k,
        "repetition_penalty": req.repetition_penalty,
        "priority": req.priority,
        **extra,
    }
    return ChatCompletionRequest.model_validate(body)


# vLLM extensions a Responses request may carry straight through to chat.
_PASSED_THROUGH = (
    "min_p",
    "min_tokens",
    "stop",
    "ignore_eos",
    "chat_template",
    "chat_template_kwargs",
)


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as chat messages: for the next round and for previous_response_id.

    Text and the calls after it form one assistant turn; the results of MCP
    calls (run by the server) follow it as tool messages.
    """
    messages: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for item in output:
        kind = item["type"]
        if kind == "message":
            messages += results
            results = []
            text = "".join(p.get("text", "") for p in item["content"])
            messages.append({"role": "assistant", "content": text})
        elif kind in ("function_call", "mcp_call"):
            call_id = item.get("call_id") or item["id"]
            fn = {"name": item["name"], "arguments": item["arguments"]}
            call = {"id": call_id, "type": "function", "function": fn}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if kind == "mcp_call":
                output_text = item["output"]
                if output_text is None:
                    output_text = "error: " + json.dumps(item.get("error"))
                results.append({"role": "tool", "tool_call_id": call_id, "content": output_text})
    return messages + results
