"""One request's state inside the engine: its tokens, KV blocks and progress."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .request import GenerationRequest


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request: GenerationRequest
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int  # the request's seed, or one the engine drew
    eos_token_ids: frozenset[int] = frozenset()
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_prefix: int = 0  # of those, tokens taken from the prefix cache
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    first_scheduled_at: float | None = None
    first_token_at: float | None = None  # when the first generated token came out (TTFT = this - arrival)

    @classmethod
    def from_request(cls, request: GenerationRequest, seed: int, eos_token_ids: frozenset[int]) -> "Sequence":
        ids = list(request.prompt_token_ids)
        return cls(request, ids, len(ids), seed, eos_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def append(self, token: int, max_model_len: int) -> None:
        """Add a sampled token and decide whether the sequence is finished."""
        self.record(len(self.token_ids), token, max_model_len)

    def record(self, index: int, token: int, max_model_len: int) -> None:
        """Put a sampled token at `index` (appending, or filling the placeholder an overlapped step
        left there) and decide whether the sequence is finished; a finished sequence drops any
        placeholder after it."""
        if index == len(self.token_ids):
            self.token_ids.append(token)
        else:
            self.token_ids[index] = token
        sp = self.request.sampling
        if not sp.ignore_eos and token in self.eos_token_ids:
            self.finish_reason = "stop"
        elif token in sp.stop_token_ids:
            self.finish_reason = "stop"
        elif self.reaches_length(index, max_model_len):
            self.finish_reason = "length"
        if self.finish_reason:
            self.status = SequenceStatus.FINISHED
            del self.token_ids[index + 1:]

    def reaches_length(self, index: int, max_model_len: int) -> bool:
        """A token at `index` is the last one max_tokens or the context allows."""
        return index + 1 - self.num_prompt_tokens >= self.request.sampling.max_tokens or index + 1 >= max_model_len
