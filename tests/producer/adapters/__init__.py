"""Tests of the framework adapters; ``FakeProducer`` records what a tap hands to a producer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from producer.summary import LayerSummaries


@dataclass
class FakeSettings:
    """The selection fields of ``ProducerSettings`` a tap honours."""

    every_n_steps: int = 1
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    mode: str = "full"


@dataclass
class FakeProducer:
    """Records start_run / record_summaries / finish_run / close calls (no Kafka)."""

    rank: int = 0
    world_size: int = 1
    settings: FakeSettings = field(default_factory=FakeSettings)
    layer_numel: dict[str, int] | None = None
    start_kwargs: dict[str, Any] = field(default_factory=dict)
    steps: list[tuple[int, LayerSummaries]] = field(default_factory=list)
    scalars: list[tuple[int, dict[str, object], Any]] = field(default_factory=list)
    finished: int = 0
    closed: int = 0

    def start_run(self, layer_numel: Mapping[str, int], **kwargs: Any) -> None:
        assert self.layer_numel is None, "start_run called twice"
        self.layer_numel = dict(layer_numel)
        self.start_kwargs = kwargs

    def record_summaries(self, step: int, summaries: LayerSummaries, *,
                         scalars: Mapping[str, object] | None = None,
                         rank_scalars: Any = None) -> None:
        assert self.layer_numel is not None, "record_summaries before start_run"
        assert set(summaries.names) <= set(self.layer_numel)
        self.steps.append((step, summaries))
        self.scalars.append((step, dict(scalars or {}), rank_scalars))

    def finish_run(self, timeout: float | None = None) -> bool:
        self.finished += 1
        return True

    def close(self, timeout: float | None = None) -> None:
        self.closed += 1
