"""A tokenizer of one token per character, for tests of text assembly (stop strings, coalescing)."""
from __future__ import annotations


class CharTokenizer:
    """One token per character (id = code point), with the incremental detokenizer's API."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def detokenizer(self):
        class Detok:
            def add(self, ids: list[int]) -> str:
                return "".join(chr(i) for i in ids)

            def flush(self) -> str:
                return ""

        return Detok()
