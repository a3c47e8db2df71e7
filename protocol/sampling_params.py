"""SamplingParams: how one request is sampled, with vLLM's field names.

A msgspec Struct so that it travels to the engine core as it is. `validate()`
raises ValueError naming the field for any out-of-range value; the frontend
calls it at the edge, before anything reaches the engine.
"""

from __future__ import annotations

import msgspec

_INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 1024
MAX_GRAMMAR_SPEC_CHARS = 64_000
MAX_CHOICES = 256


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One output constraint (vLLM's `structured_outputs`): exactly one kind is set.

    `json` is a JSON schema serialized as text, so that it hashes and caches as
    one key; the engine compiles it (and the others) with xgrammar.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style) text
    json_object: bool = False
    # Free whitespace in JSON output; compact JSON by default keeps small
    # models from wandering into endless newlines.
    any_whitespace: bool = False

    @property
    def kind(self) -> str:
        kinds = self.kinds()
        return kinds[0] if kinds else ""

    def kinds(self) -> list[str]:
        set_kinds = [
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None
        ]
        if self.json_object:
            set_kinds.append("json_object")
        return set_kinds

    def validate(self) -> None:
        kinds = self.kinds()
        _check(
            len(kinds) == 1,
            "structured_outputs",
            "structured_outputs needs exactly one of json, regex, choice, grammar, "
            f"json_object; got {kinds or 'none'}",
        )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check(bool(value.strip()), "structured_outputs", f"{name} must not be empty")
                _check(
                    len(value) <= MAX_GRAMMAR_SPEC_CHARS,
                    "structured_outputs",
                    f"{name} is longer than {MAX_GRAMMAR_SPEC_CHARS} characters",
                )
        if self.choice is not None:
            _check(
                0 < len(self.choice) <= MAX_CHOICES,
                "structured_outputs",
                f"choice needs 1 to {MAX_CHOICES} options",
            )
            _check(all(self.choice), "structured_outputs", "choice options must not be empty")
            _check(
                sum(map(len, self.choice)) <= MAX_GRAMMAR_SPEC_CHARS,
                "structured_outputs",
                "choice options are too long",
            )


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling and stopping controls for one request (vLLM-compatible)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Also return these tokens' full-vocabulary log-probabilities at each
    # sampled position, whatever was sampled (generative scoring reads them).
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field that is out of range."""
        _check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(self.n <= 128, "n", f"n must be at most 128, got {self.n}")
        _check(
            0.0 <= self.temperature <= 100.0,
            "temperature",
            f"temperature must be in [0, 100], got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            self.top_k >= 0, "top_k", f"top_k must be -1 (disable) or at least 1, got {self.top_k}"
        )
        _check(self.top_k <= _INT64_MAX, "top_k", "top_k must fit in a signed 64-bit integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
        )
        if self.seed is not None:
            _check(
                -_INT64_MAX - 1 <= self.seed <= _INT64_MAX,
                "seed",
                "seed must fit in a signed 64-bit integer",
            )
        if self.max_tokens is not None:
            _check(
                self.max_tokens >= 1,
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens}",
            )
        _check(
            self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                "min_tokens must be less than or equal to max_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(
                    0 <= value <= MAX_LOGPROBS,
                    name,
                    f"{name} must be in [0, {MAX_LOGPROBS}], got {value}",
                )
        if self.logprob_token_ids is not None:
            _check(
                0 < len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS,
                "logprob_token_ids",
                f"logprob_token_ids needs 1 to {MAX_LOGPROB_TOKEN_IDS} token ids",
            )
            _check(
                all(t >= 0 for t in self.logprob_token_ids),
                "logprob_token_ids",
                "logprob_token_ids must not be negative",
            )
            if vocab_size is not None:
                _check(
                    all(t < vocab_size for t in self.logprob_token_ids),
                    "logprob_token_ids",
                    f"logprob_token_ids must be in [0, {vocab_size})",
                )
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        _check(len(self.stop) <= 64, "stop", "at most 64 stop strings are allowed")
        _check(all(self.stop), "stop", "stop strings must not be empty")
        _check(len(self.stop_token_ids) <= 1024, "stop_token_ids", "too many stop_token_ids")
        if vocab_size is not None:
            _check(
                all(0 <= t < vocab_size for t in self.stop_token_ids),
                "stop_token_ids",
                f"stop_token_ids must be in [0, {vocab_size})",
            )
        if self.logit_bias:
            _check(len(self.logit_bias) <= 4096, "logit_bias", "too many logit_bias entries")
            for token_id, bias in self.logit_bias.items():
                if vocab_size is not None:
                    _check(
                        0 <= token_id < vocab_size,
                        "logit_bias",
                        f"logit_bias token id {token_id} is out of range [0, {vocab_size})",
                    )
                _check(
                    -100.0 <= bias <= 100.0,
                    "logit_bias",
                    f"logit_bias values must be in [-100, 100], got {bias}",
                )


class SamplingParamsError(ValueError):
    """A ValueError that remembers which field was wrong."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
