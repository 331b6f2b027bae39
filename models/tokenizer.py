"""The tokenizer every model gets: a thin wrapper over Rust `tokenizers`, and incremental detokenizing."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import tokenizers

_REPLACEMENT = "\ufffd"


class Tokenizer:
    """Text <-> token ids, plus the special ids generation needs."""

    def __init__(self, backend: tokenizers.Tokenizer, bos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))

    @classmethod
    def from_file(cls, path: str | Path, bos_token_id: int | None = None,
                  eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)), bos_token_id, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text; special tokens written in the text (e.g. from a chat template) are matched."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json (what an HF model directory carries)."""
        self.backend.save(str(path))

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, one stream each.

    Each step decodes only a short window: from `prefix` (a token boundary where text was already
    complete) to the end, and subtracts the text of prefix..read that was already emitted. Decoding
    from the same start keeps decoders that strip a leading space (SentencePiece) consistent. Text
    ending in U+FFFD is held back: the rest of a multi-byte character is in a later token.
    """

    __slots__ = ("_ids", "_prefix", "_read", "_skip", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def add(self, ids: int | Iterable[int]) -> str:
        """Feed new token ids; returns the text they completed (maybe empty)."""
        if isinstance(ids, int):
            self._ids.append(ids)
        else:
            self._ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever was held back, incomplete characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        window = self._ids[self._prefix:]
        done = decode(window[:self._read - self._prefix], self._skip) if self._read > self._prefix else ""
        text = decode(window, self._skip)
        if len(text) <= len(done) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]
