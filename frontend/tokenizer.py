"""Tokenizer: encode, decode and render chat templates without torch.

Wraps transformers' fast tokenizer (backed by the `tokenizers` library)
loaded from a directory with tokenizer.json; the engine tells the frontend
where that directory is in its Ready message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream


class ChatTemplateError(ValueError):
    """The chat template could not render these messages."""


def _template_text(chat_template: str) -> str:
    """--chat-template's value: a file's path, or the template itself."""
    try:
        return Path(chat_template).read_text()
    except (OSError, ValueError):  # not a file (a template is no valid file name)
        return chat_template


class Tokenizer:
    """A model's tokenizer and chat template."""

    def __init__(self, path: str, chat_template: str | None = None) -> None:
        from transformers import PreTrainedTokenizerFast

        self.path = path
        self._tok = PreTrainedTokenizerFast.from_pretrained(path)
        if chat_template is not None:
            self._tok.chat_template = _template_text(chat_template)
        self.backend = self._tok.backend_tokenizer
        # Some tokenizer.json files (BERT exports) pad or cut every encoding to
        # a fixed length; a prompt is exactly its own tokens.
        self.backend.no_padding()
        self.backend.no_truncation()
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.bos_token_id: int | None = self._tok.bos_token_id
        self.all_special_ids: set[int] = set(self._tok.all_special_ids)
        self.vocab_size = len(self._tok)
        self._token_text: dict[int, str] = {}

    @property
    def chat_template(self) -> str | None:
        return self._tok.chat_template

    def encode(
        self, text: str, add_special_tokens: bool = True, max_length: int | None = None
    ) -> list[int]:
        """Token ids; with max_length, cut on the tokenizer's side, special tokens kept."""
        if max_length is None:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        try:
            ids = self._tok(
                text, add_special_tokens=add_special_tokens, truncation=True, max_length=max_length
            )["input_ids"]
        finally:
            # transformers leaves the truncation it set on the shared backend.
            self.backend.no_truncation()
            self.backend.no_padding()
        return list(ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs); cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.backend.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [self.backend.id_to_token(t) or "" for t in token_ids]

    def decode_stream(self, skip_special_tokens: bool) -> DecodeStream:
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render messages to the prompt text."""
        if self._tok.chat_template is None and chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template; pass --chat-template or use /v1/completions"
            )
        try:
            rendered = self._tok.apply_chat_template(
                messages,
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=False,
                **template_kwargs,
            )
        except Exception as e:  # noqa: BLE001 - jinja and transformers raise many types
            raise ChatTemplateError(f"the chat template could not render the messages: {e}") from e
        if not isinstance(rendered, str):
            raise ChatTemplateError("the chat template did not render to text")
        return rendered
