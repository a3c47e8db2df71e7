"""Whisper's special tokens and decoder prompts, read from the model's tokenizer.

The decoder prompt of one 30 s window, as faster-whisper builds it (the
reference the engine's tokens are compared with):

    [<|startofprev|> prompt-text-tokens]        only with a prompt
    <|startoftranscript|>
    <|xx|> <|transcribe|> or <|translate|>      multilingual models only
    <|notimestamps|>

English-only models (`*.en`, a vocabulary of 51,864 tokens; multilingual ones
have 51,865 or more, the rule OpenAI's whisper uses) take no language or task
token: they were trained to transcribe English and nothing else, so they
cannot translate. The prompt text is encoded as " " + text.strip() and, as in
Whisper, only its last 223 tokens (half the decoder's 448 positions, less
one) are kept.

Whisper's non-speech tokens (music notes, brackets, speaker dashes: the
list its `suppress_tokens=[-1]` names) never come out, as in Whisper and
faster-whisper by default: without that, silence reads "[BLANK_AUDIO]" and
noise "(wind howling)". The list is the model's own (`suppress_ids` in a
CTranslate2 config.json, `suppress_tokens` in a Hugging Face config.json or
generation_config.json), applied as a logit bias of -100 at every step, far
below any logit Whisper produces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagoda.frontend.tokenizer import Tokenizer

MULTILINGUAL_VOCAB_SIZE = 51_865
MAX_PROMPT_TOKENS = 448 // 2 - 1
TIMESTAMP_SECONDS = 0.02
SUPPRESS_BIAS = -100.0  # the lowest logit bias SamplingParams takes

# Whisper's languages: code → the name OpenAI's API reports in verbose_json.
LANGUAGES = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian",
    "ko": "korean", "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish",
    "pl": "polish", "ca": "catalan", "nl": "dutch", "ar": "arabic", "sv": "swedish",
    "it": "italian", "id": "indonesian", "hi": "hindi", "fi": "finnish", "vi": "vietnamese",
    "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay", "cs": "czech",
    "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian",
    "la": "latin", "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak",
    "te": "telugu", "fa": "persian", "lv": "latvian", "bn": "bengali", "sr": "serbian",
    "az": "azerbaijani", "sl": "slovenian", "kn": "kannada", "et": "estonian",
    "mk": "macedonian", "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian",
    "ne": "nepali", "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian",
    "sw": "swahili", "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala",
    "km": "khmer", "sn": "shona", "yo": "yoruba", "so": "somali", "af": "afrikaans",
    "oc": "occitan", "ka": "georgian", "be": "belarusian", "tg": "tajik", "sd": "sindhi",
    "gu": "gujarati", "am": "amharic", "yi": "yiddish", "lo": "lao", "uz": "uzbek",
    "fo": "faroese", "ht": "haitian creole", "ps": "pashto", "tk": "turkmen", "nn": "nynorsk",
    "mt": "maltese", "sa": "sanskrit", "lb": "luxembourgish", "my": "myanmar", "bo": "tibetan",
    "tl": "tagalog", "mg": "malagasy", "as": "assamese", "tt": "tatar", "haw": "hawaiian",
    "ln": "lingala", "ha": "hausa", "ba": "bashkir", "jw": "javanese", "su": "sundanese",
    "yue": "cantonese",
}  # fmt: skip


class WhisperTokenError(ValueError):
    """A request this Whisper model cannot serve (a language, translation); the
    message says why. `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class WhisperTokens:
    """The special token ids of one Whisper model and the languages it knows."""

    end_of_text: int
    start_of_transcript: int
    start_of_prev: int
    no_timestamps: int
    transcribe: int | None  # None on an English-only model
    translate: int | None
    language_ids: dict[str, int]  # empty on an English-only model
    multilingual: bool
    suppress_ids: tuple[int, ...] = ()
    no_speech: int | None = None  # <|nocaptions|> (<|nospeech|> in newer vocabularies)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> WhisperTokens:
        """Read the ids from `tokenizer`; `vocab_size` is the model's (its config's)."""

        def token_id(token: str) -> int:
            found = tokenizer.backend.token_to_id(token)
            if found is None:
                raise ValueError(f"the tokenizer has no {token} token: is this a Whisper model?")
            return int(found)

        multilingual = vocab_size >= MULTILINGUAL_VOCAB_SIZE
        languages: dict[str, int] = {}
        if multilingual:
            for code in LANGUAGES:
                found = tokenizer.backend.token_to_id(f"<|{code}|>")
                if found is not None:
                    languages[code] = int(found)
        return cls(
            end_of_text=token_id("<|endoftext|>"),
            start_of_transcript=token_id("<|startoftranscript|>"),
            start_of_prev=token_id("<|startofprev|>"),
            no_timestamps=token_id("<|notimestamps|>"),
            transcribe=token_id("<|transcribe|>") if multilingual else None,
            translate=token_id("<|translate|>") if multilingual else None,
            language_ids=languages,
            multilingual=multilingual,
            suppress_ids=read_suppress_ids(Path(tokenizer.path)),
            no_speech=next(
                (
                    int(found)
                    for token in ("<|nocaptions|>", "<|nospeech|>")
                    if (found := tokenizer.backend.token_to_id(token)) is not None
                ),
                None,
            ),
        )

    def suppress_bias(self) -> dict[int, float]:
        """The logit bias that keeps the non-speech tokens out."""
        return {token_id: SUPPRESS_BIAS for token_id in self.suppress_ids}

    def check_language(self, language: str | None) -> str:
        """The language code to decode in: `language` when the model knows it."""
        if language is None:
            # Language detection needs an encoder pass of its own; as vLLM, assume English.
            return "en"
        code = language.strip().lower()
        if not self.multilingual:
            if code == "en":
                return code
            raise WhisperTokenError(
                "language",
                f"this model is English-only: it transcribes English ('en'), not {language!r}",
            )
        if code not in self.language_ids:
            known = ", ".join(sorted(self.language_ids))
            raise WhisperTokenError(
                "language",
                f"unknown language {language[:20]!r}: use an ISO-639-1 code Whisper knows"
                f" ({known})",
            )
        return code

    def check_task(self, task: str) -> None:
        if task == "translate" and not self.multilingual:
            raise WhisperTokenError(
                "model",
                "translation needs a multilingual Whisper model: this one is English-only "
                "(trained to transcribe English, it has no translate task)",
            )

    def decoder_prompt(self, task: str, language: str, prompt_ids: list[int]) -> list[int]:
        """The decoder prompt of one window; `prompt_ids` are the prompt text's tokens."""
        ids: list[int] = []
        if prompt_ids:
            ids += [self.start_of_prev, *prompt_ids[-MAX_PROMPT_TOKENS:]]
        ids.append(self.start_of_transcript)
        if self.multilingual:
            task_id = self.translate if task == "translate" else self.transcribe
            assert task_id is not None  # a multilingual model has both task tokens
            ids += [self.language_ids[language], task_id]
        ids.append(self.no_timestamps)
        return ids

    def no_speech_prompt(self, decoder_prompt: list[int]) -> list[int]:
        """`decoder_prompt` up to <|startoftranscript|>: the position after it is
        where Whisper reads the probability of no speech."""
        return decoder_prompt[: decoder_prompt.index(self.start_of_transcript) + 1]

    def encode_prompt(self, tokenizer: Tokenizer, text: str | None) -> list[int]:
        """The prompt text's tokens, as Whisper encodes previous text (a leading space)."""
        if text is None or not text.strip():
            return []
        return tokenizer.encode(" " + text.strip(), add_special_tokens=False)


def read_suppress_ids(model_dir: Path) -> tuple[int, ...]:
    """The model's non-speech token ids, from its config files; none found: ()."""
    for name, key in (
        ("config.json", "suppress_ids"),  # CTranslate2
        ("config.json", "suppress_tokens"),  # Hugging Face
        ("generation_config.json", "suppress_tokens"),
    ):
        try:
            config = json.loads((model_dir / name).read_text())
        except (OSError, ValueError):
            continue
        ids = config.get(key) if isinstance(config, dict) else None
        if isinstance(ids, list) and all(isinstance(i, int) and i >= 0 for i in ids):
            return tuple(ids)
    return ()
