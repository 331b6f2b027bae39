"""The tokenizer every model gets: a thin wrapper over Rust `tokenizers`, and incremental detokenizing.

Two ways to encode text: `encode` matches special tokens written in the text (for markup the server
itself wrote, such as a chat template's `<|im_start|>`), `encode_plain` never does (for anything a
client wrote: `<|im_start|>` in a message is seven ordinary tokens, not a control token).
"""
from __future__ import annotations

import functools
import re
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

    def __getstate__(self) -> dict:
        # Sent to worker processes: cached helpers are rebuilt there (a pickled tokenizers.Tokenizer
        # loses runtime flags such as encode_special_tokens, which _plain_backend depends on).
        return {k: self.__dict__[k] for k in ("backend", "bos_token_id", "eos_token_ids")}

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

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of text in which special-token strings are ordinary text (client-written text)."""
        return self._plain_backend.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        # A copy, so that the flag never changes under a concurrent `encode` of the original.
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @functools.cached_property
    def _specials(self) -> dict[str, tuple[int, bool, bool]]:
        """The special tokens (control tokens such as <|im_start|>): text -> (id, lstrip, rstrip)."""
        return {t.content: (i, t.lstrip, t.rstrip)
                for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def special_token_pattern(self) -> re.Pattern[str] | None:
        """Matches any special token's text (longest first); None when the tokenizer has none."""
        names = sorted(self._specials, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, names))) if names else None

    def encode_markup(self, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """Token ids of text given as (piece, is_markup) pairs: special tokens are matched in markup
        pieces only. The tokenizer itself splits text at special tokens before anything else, so
        text without client-written special tokens encodes exactly as `encode` would."""
        ids: list[int] = []
        pending: list[str] = []  # plain text since the last special token
        strip_left = False  # the last special token swallows the whitespace after it (rstrip)

        def flush(strip_right: bool) -> None:
            text = "".join(pending)
            text = text.lstrip() if strip_left else text
            text = text.rstrip() if strip_right else text
            if text:
                ids.extend(self.encode_plain(text))
            pending.clear()

        pattern = self.special_token_pattern
        for text, markup in pieces:
            pos = 0
            for m in pattern.finditer(text) if markup and pattern is not None else ():
                token_id, lstrip, rstrip = self._specials[m.group()]
                pending.append(text[pos:m.start()])
                flush(lstrip)
                ids.append(token_id)
                strip_left, pos = rstrip, m.end()
            pending.append(text[pos:])
        flush(False)
        return ids

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
