"""A step's inputs as host lists, before they become tensors or staged graph inputs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepInputs:
    ids: list[int] = field(default_factory=list)  # PLACEHOLDER where the token is still on the device
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # KV slot of each token
    cu_seqlens: list[int] = field(default_factory=lambda: [0])  # token offsets of each sequence
    context_lens: list[int] = field(default_factory=list)  # per sequence, after this step
    tables: list[list[int]] = field(default_factory=list)  # block table of each sequence
    sample_rows: list[int] = field(default_factory=list)  # token rows whose logits are sampled
    fill_rows: list[int] = field(default_factory=list)  # token rows that hold a placeholder
    fill_from: list[int] = field(default_factory=list)  # ... and the in-flight step's row that has it

    @property
    def fills_in_order(self) -> bool:
        """Each placeholder row j takes row j of the in-flight step (a steady decode batch)."""
        return self.fill_rows == self.fill_from == list(range(len(self.fill_rows)))
