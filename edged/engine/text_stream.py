"""Per-request text assembly on the event loop: incremental detokenization and stop strings.

Text that could still become a stop string is held back until it cannot, so a client never sees
part of a stop sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TextPiece:
    text: str
    stopped: bool  # a stop string was found: the text ends just before it


@dataclass
class StopStringFilter:
    stops: list[str]
    _pending: str = ""
    _done: bool = False
    _hold: int = field(init=False)

    def __post_init__(self) -> None:
        self.stops = [s for s in self.stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def push(self, text: str, final: bool = False) -> TextPiece:
        if self._done:
            return TextPiece("", True)
        self._pending += text
        if not self.stops:
            out, self._pending = self._pending, ""
            return TextPiece(out, False)
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._done = True
            out, self._pending = self._pending[:min(hits)], ""
            return TextPiece(out, True)
        keep = 0 if final else self._hold
        cut = max(0, len(self._pending) - keep)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return TextPiece(out, False)
