"""Reading Prometheus text (what /metrics serves) in tests."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset of label items): value} for every sample in the exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def families(text: str) -> set[str]:
    """The metric family names in the exposition (counters without their _total suffix)."""
    return {family.name for family in text_string_to_metric_families(text)}


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The first sample called `name` whose labels include `labels`; None when there is none."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return sample.value
    return None


def metric_sum(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of every sample called `name` whose labels include `labels` (0 when there is none)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total
