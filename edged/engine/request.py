"""What the server hands the engine, and what comes back each step."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None: the engine draws one (the request is then not reproducible)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def deterministic(self) -> bool:
        """Greedy or seeded: the same request always yields the same tokens (result-cacheable)."""
        return self.temperature == 0 or self.seed is not None


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    tier: str = "default"
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class StepOutput:
    """New tokens of one sequence from one engine step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
