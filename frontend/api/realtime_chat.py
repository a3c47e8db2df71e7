"""Text conversations in a realtime session on a generate model (OpenAI Realtime's
text events).

    conversation.item.create {item: message}  →  conversation.item.created / .added
    conversation.item.delete {item_id}        →  conversation.item.deleted
    response.create {response: {instructions, temperature, max_output_tokens}}
        →  response.created, response.output_item.added, response.content_part.added,
           response.text.delta + response.output_text.delta (each piece of text),
           response.text.done + response.output_text.done, response.content_part.done,
           response.output_item.done, response.done {response: {status, output, usage}}
    response.cancel                           →  response.done with status "cancelled"

The conversation is the session's list of message items; a response renders
it with the model's chat template (as /v1/chat/completions does) and streams
one engine request. Its answer joins the conversation as an assistant item.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from pagoda.frontend.api.common import lora_for
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.chat_render import render_chat
from pagoda.frontend.realtime import EventError
from pagoda.protocol.sampling_params import SamplingParams

Send = Callable[[str, dict[str, Any]], Awaitable[None]]
ROLES = ("user", "system", "assistant", "developer")
TEXT_PARTS = ("input_text", "text", "output_text")
DEFAULT_TEMPERATURE = 0.8  # OpenAI Realtime's default


def item_id() -> str:
    return f"item_{uuid.uuid4().hex[:24]}"


def message_item(item: Any) -> dict[str, Any]:
    """A checked message item with text content, an id and status "completed"."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        raise EventError("item must be a message: {type: 'message', role, content}")
    role = item.get("role")
    if role not in ROLES:
        raise EventError(f"item.role must be one of {list(ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    if not isinstance(content, list) or not content:
        raise EventError("item.content must be a non-empty list of text parts")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            raise EventError(f"content parts must be text ({', '.join(TEXT_PARTS)})")
        if not isinstance(part.get("text"), str):
            raise EventError("a text part needs a string `text`")
        parts.append({"type": part["type"], "text": part["text"]})
    given_id = item.get("id")
    if given_id is not None and not isinstance(given_id, str):
        raise EventError("item.id must be a string")
    return {
        "id": given_id or item_id(),
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": role,
        "content": parts,
    }


def item_text(item: dict[str, Any]) -> str:
    return "".join(part["text"] for part in item["content"])


class Conversation:
    """A session's message items and its one running response."""

    def __init__(
        self,
        engine: AsyncLLM,
        model: Callable[[], str],
        send: Send,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self.engine = engine
        self.model = model  # the session's current model name
        self.send = send
        self.spawn = spawn  # runs a task whose failure the session reports
        self.items: list[dict[str, Any]] = []
        self.instructions: str | None = None
        self.temperature: float | None = None
        self.max_output_tokens: int | None = None
        self.task: asyncio.Task[None] | None = None
        self.response_id: str | None = None

    @property
    def responding(self) -> bool:
        return self.task is not None and not self.task.done()

    def configure(self, session: dict[str, Any]) -> None:
        """session.update's response settings: instructions, temperature, max tokens."""
        if "instructions" in session:
            self.instructions = _optional_str(session["instructions"], "instructions")
        if "temperature" in session:
            self.temperature = _temperature(session["temperature"])
        for key in ("max_response_output_tokens", "max_output_tokens"):
            if key in session:
                self.max_output_tokens = _max_tokens(session[key], key)

    async def create_item(self, event: dict[str, Any]) -> None:
        item = message_item(event.get("item"))
        if any(existing["id"] == item["id"] for existing in self.items):
            raise EventError(f"an item with id {item['id']!r} exists already")
        previous = self.items[-1]["id"] if self.items else None
        self.items.append(item)
        for kind in ("conversation.item.created", "conversation.item.added"):
            await self.send(kind, {"previous_item_id": previous, "item": item})

    async def delete_item(self, event: dict[str, Any]) -> None:
        wanted = event.get("item_id")
        kept = [item for item in self.items if item["id"] != wanted]
        if len(kept) == len(self.items):
            raise EventError(f"no item with id {wanted!r}", "item_not_found")
        self.items = kept
        await self.send("conversation.item.deleted", {"item_id": wanted})

    def create_response(self, event: dict[str, Any]) -> None:
        if self.responding:
            raise EventError(
                "a response is in progress; wait for response.done or send response.cancel",
                "conversation_already_has_active_response",
            )
        options = event.get("response") or {}
        if not isinstance(options, dict):
            raise EventError("response must be an object")
        instructions = self.instructions
        if "instructions" in options:
            instructions = _optional_str(options["instructions"], "instructions")
        temperature = self.temperature
        if "temperature" in options:
            temperature = _temperature(options["temperature"])
        max_tokens = self.max_output_tokens
        for key in ("max_output_tokens", "max_response_output_tokens"):
            if key in options:
                max_tokens = _max_tokens(options[key], key)
        messages = [{"role": "system", "content": instructions}] if instructions else []
        messages += [
            {"role": "system" if i["role"] == "developer" else i["role"], "content": item_text(i)}
            for i in self.items
        ]
        if not messages:
            raise EventError("the conversation is empty: create an item first")
        try:
            prompt = render_chat(self.engine.tokenizer, messages, add_generation_prompt=True)
        except ValueError as e:
            raise EventError(f"the conversation cannot be rendered: {str(e)[:300]}") from None
        params = SamplingParams(
            temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
            max_tokens=max_tokens,
        )
        self.response_id = f"resp_{uuid.uuid4().hex[:24]}"
        self.task = self.spawn(self._respond(self.response_id, prompt, params))

    async def cancel(self) -> bool:
        """Stop the running response (its engine request is aborted); whether one ran."""
        if not self.responding:
            return False
        assert self.task is not None  # responding
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        return True

    async def _respond(self, response_id: str, prompt: str, params: SamplingParams) -> None:
        prompt_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
        item = {
            "id": item_id(),
            "object": "realtime.item",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        where = {"response_id": response_id, "item_id": item["id"], "output_index": 0}
        part_where = {**where, "content_index": 0}
        response: dict[str, Any] = {
            "id": response_id,
            "object": "realtime.response",
            "status": "in_progress",
            "status_details": None,
            "output": [],
            "usage": None,
        }
        await self.send("response.created", {"response": response})
        await self.send(
            "response.output_item.added",
            {"response_id": response_id, "output_index": 0, "item": item},
        )
        await self.send("response.content_part.added", {**part_where, "part": _part("")})
        text = ""
        num_completion = 0
        finish: str | None = None
        status = "cancelled"
        details: dict[str, Any] | None = {"type": "cancelled", "reason": "client_cancelled"}
        stream = self.engine.generate_tokens(
            prompt,
            prompt_ids,
            params,
            response_id,
            lora_request=lora_for(self.engine, self.model()),
        )
        try:
            async for out in stream:
                sample = out.outputs[0]
                num_completion += len(sample.token_ids)
                finish = sample.finish_reason or finish
                if sample.text:
                    text += sample.text
                    for kind in ("response.text.delta", "response.output_text.delta"):
                        await self.send(kind, {**part_where, "delta": sample.text})
            status, details = "completed", None
            if finish == "length":
                status = "incomplete"
                details = {"type": "incomplete", "reason": "max_output_tokens"}
        except Exception as e:
            status, details = "failed", {"type": "failed", "error": {"message": str(e)[:300]}}
            raise
        finally:
            await asyncio.shield(
                self._done(response, item, where, text, status, details, prompt_ids, num_completion)
            )

    async def _done(
        self,
        response: dict[str, Any],
        item: dict[str, Any],
        where: dict[str, Any],
        text: str,
        status: str,
        details: dict[str, Any] | None,
        prompt_ids: list[int],
        num_completion: int,
    ) -> None:
        """The closing events of a response, also when it was cancelled."""
        part_where = {**where, "content_index": 0}
        for kind in ("response.text.done", "response.output_text.done"):
            await self.send(kind, {**part_where, "text": text})
        await self.send("response.content_part.done", {**part_where, "part": _part(text)})
        item = {
            **item,
            "status": "completed" if status == "completed" else "incomplete",
            "content": [_part(text)],
        }
        await self.send(
            "response.output_item.done",
            {"response_id": response["id"], "output_index": 0, "item": item},
        )
        self.items.append({**item, "status": "completed"})
        usage = {
            "total_tokens": len(prompt_ids) + num_completion,
            "input_tokens": len(prompt_ids),
            "output_tokens": num_completion,
        }
        done = {**response, "status": status, "status_details": details}
        await self.send("response.done", {"response": {**done, "output": [item], "usage": usage}})


def _part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EventError(f"{name} must be a string")
    return value or None


def _temperature(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 2:
        raise EventError("temperature must be a number from 0 to 2")
    return float(value)


def _max_tokens(value: Any, name: str) -> int | None:
    if value is None or value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EventError(f"{name} must be a positive integer or 'inf'")
    return value
