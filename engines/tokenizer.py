"""Whisper's tokenizer: the shipped tokenizer.json through the `tokenizers` library, plus the
special tokens and suppression lists the decoding rules need."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer


@dataclass(frozen=True)
class WhisperTokenizer:
    tokenizer: Tokenizer
    multilingual: bool
    lang_ids: tuple[int, ...]
    suppress_ids: tuple[int, ...]  # non-speech symbols and task tokens, from the model's config
    suppress_ids_begin: tuple[int, ...]  # a transcript never starts with a bare space or end-of-text

    @classmethod
    def load(cls, folder: Path, config: dict, n_vocab: int) -> "WhisperTokenizer":
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # English-only models have a 51864-token vocabulary; multilingual ones one more.
        return cls(
            tok,
            multilingual=n_vocab >= 51865,
            lang_ids=tuple(config.get("lang_ids", ())),
            suppress_ids=tuple(config.get("suppress_ids", ())),
            suppress_ids_begin=tuple(config.get("suppress_ids_begin", ())),
        )

    def special(self, token: str) -> int:
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise KeyError(f"tokenizer has no special token {token}")
        return found

    @cached_property
    def eot(self) -> int:
        return self.special("<|endoftext|>")

    @cached_property
    def sot(self) -> int:
        return self.special("<|startoftranscript|>")

    @cached_property
    def sot_prev(self) -> int:
        return self.special("<|startofprev|>")

    @cached_property
    def no_speech(self) -> int:
        return self.special("<|nocaptions|>")

    @cached_property
    def languages(self) -> dict[str, int]:
        """Language code -> token id, e.g. {"en": 50259, "zh": 50260} (multilingual models only)."""
        if not self.multilingual:
            return {}
        return {self.tokenizer.id_to_token(i).strip("<|>"): i for i in self.lang_ids}

    def task_prefix(self, language: str | None) -> list[int]:
        """The tokens after <|startoftranscript|>: language and task (multilingual), no timestamps."""
        tail = [self.special("<|notimestamps|>")]
        if not self.multilingual:
            return tail
        if language not in self.languages:
            raise ValueError(f"unknown language {language!r}")
        return [self.languages[language], self.special("<|transcribe|>"), *tail]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of the ordinary tokens (every id below end-of-text); specials are dropped."""
        return self.tokenizer.decode([i for i in ids if i < self.eot], skip_special_tokens=False)
