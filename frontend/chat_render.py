"""A conversation rendered to prompt text through the chat template.

The one path from OpenAI-style messages to a prompt, taken by the server's
chat route (and the routes translated onto it) and by the offline `LLM.chat`,
so both render a conversation the same way:

- list-of-parts content is flattened to its text parts, joined by newlines
  (chat templates expect a string; other part types are refused);
- an assistant's tool-call `arguments`, a JSON string on the wire, become
  the object chat templates expect;
- only role, content, name, tool_calls and tool_call_id reach the template,
  with a missing content as "";
- `tools` go to the template as given.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda.frontend.tokenizer import Tokenizer

# What a message passes to the chat template besides role and content.
_PASSED_KEYS = ("name", "tool_calls", "tool_call_id")


class ChatMessageError(ValueError):
    """A message the chat template cannot take; `param` names it (messages.2.content)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates expect it (see the module docstring).

    The caller's messages are left as they are.
    """
    rendered = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, list):
            content = _flatten(content, f"messages.{i}.content")
        elif content is not None and not isinstance(content, str):
            raise ChatMessageError("content must be a string or a list of parts", f"messages.{i}")
        entry: dict[str, Any] = {"role": msg.get("role"), "content": content or ""}
        for key in _PASSED_KEYS:
            if msg.get(key) is not None:
                entry[key] = copy.deepcopy(msg[key])
        for call in entry.get("tool_calls") or []:
            _parse_arguments(call)
        rendered.append(entry)
    return rendered


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text; ChatMessageError or ChatTemplateError (both ValueErrors) say why not."""
    return tokenizer.apply_chat_template(
        template_messages(messages),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        chat_template=chat_template,
        **(chat_template_kwargs or {}),
    )


def _flatten(parts: list[Any], param: str) -> str:
    texts = []
    for part in parts:
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise ChatMessageError("only text content parts are supported", param)
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_arguments(call: Any) -> None:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass  # the template gets the string as it came
