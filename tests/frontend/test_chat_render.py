"""LLM.chat renders a conversation exactly as the server's chat route does:
text content parts flattened, tool-call arguments parsed from JSON, tools
passed to the template."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.openai_models import ChatCompletionRequest
from pagoda.frontend.api.serving_chat import ChatServer
from tests.conftest import build_tiny_model
from tests.frontend.test_lora_sdk import add_word_tokenizer

# Shows what reached it: the content as text, each call's parsed `city`, the tools.
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %} call {{ c.function.name }}"
    " city={{ c.function.arguments.city }}{% endfor %} | {% endfor %}"
    "{% for t in tools or [] %}tool {{ t.function.name }} | {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": [{"type": "text", "text": "w1"}, {"type": "text", "text": "w2"}]},
    {"role": "user", "content": "w3"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": json.dumps({"city": "w4"})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "w5"},
]
EXPECTED = (
    "system: w1\nw2 | user: w3 | assistant:  call weather city=w4 | tool: w5 | "
    "tool weather | assistant:"
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    directory: Path = build_tiny_model("llama", tmp_path_factory.mktemp("chat-render") / "m")
    add_word_tokenizer(directory)
    return LLM(
        str(directory),
        chat_template=TEMPLATE,
        dtype="float32",
        device="cpu",
        num_threads=1,
        kv_cache_memory_bytes=4 << 20,
    )


def server_render(llm: LLM, body: dict[str, Any]) -> str:
    """The chat route's rendering, on the LLM's tokenizer."""
    engine = SimpleNamespace(tokenizer=llm.tokenizer)
    chat = ChatServer(engine, ["m"], tool_parser="hermes")  # type: ignore[arg-type]
    return chat.render(ChatCompletionRequest.model_validate(body))


def test_llm_chat_renders_like_the_server(llm: LLM) -> None:
    conversation = copy.deepcopy(CONVERSATION)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    [out] = llm.chat(conversation, params, use_tqdm=False, tools=TOOLS)
    assert out.prompt == EXPECTED
    assert server_render(llm, {"messages": CONVERSATION, "tools": TOOLS}) == EXPECTED
    assert conversation == CONVERSATION  # the caller's messages are left as they were


def test_non_text_parts_refused_alike(llm: LLM) -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat(image, use_tqdm=False)
    with pytest.raises(APIError) as refused:
        server_render(llm, {"messages": image})
    assert refused.value.status == 400 and refused.value.param == "messages.0.content"
