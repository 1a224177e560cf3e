"""The flight recorder of a rank's local view (producer.flight_recorder) and how the run API
feeds it (producer.client.GradientProducer in ``local_view="recorder"`` mode)."""

from __future__ import annotations

import numpy as np
import pytest

from producer import GradientProducer, summarize
from producer.flight_recorder import Dump, FlightRecorder, LocalEntry
from producer.transport.encoding import LocalRecord, encode_within, local_summary
from schemas.wire import LocalSummary, decode_message
from tests.producer import UNREACHABLE


def entry(step: int, norm: float = 1.0, *, layers: int = 1, nonfinite: int = 0,
          max_abs: float | None = None) -> LocalEntry:
    """An entry of ``layers`` layers whose local total norm is ``norm``."""
    sq = np.full(layers, norm * norm / layers)
    return LocalEntry(step, 100.0 + step, np.arange(layers, dtype=np.int64),
                      np.full(layers, 8, np.int64), np.sqrt(sq) * 2, sq,
                      np.full(layers, norm / 4 if max_abs is None else max_abs),
                      np.full(layers, nonfinite, np.int64))


def steps_of(dumps: tuple[Dump, ...]) -> list[tuple[str, int, list[int]]]:
    return [(d.trigger, d.trigger_step, [e.step for e in d.entries]) for d in dumps]


def test_steady_state_sends_nothing_and_the_ring_keeps_the_last_k() -> None:
    rec = FlightRecorder(steps=5)
    for step in range(50):
        rec.update(entry(step, 1.0 + 0.1 * np.sin(step)))
        assert rec.get() == ()
    assert len(rec) == 5 and rec.nbytes == 5 * 48


def test_nonfinite_sends_the_last_k_once_then_only_new_entries() -> None:
    rec = FlightRecorder(steps=4)
    for step in range(10):
        rec.update(entry(step))
    rec.update(entry(10, nonfinite=3))
    assert steps_of(rec.get()) == [("nonfinite", 10, [7, 8, 9, 10])]
    rec.update(entry(11, nonfinite=1))  # still NaN: only the new entry
    assert steps_of(rec.get()) == [("nonfinite", 11, [11])]
    rec.update(entry(12))  # finite again, below the spike: nothing
    assert rec.get() == ()


def test_exploding_fires_above_the_threshold_only() -> None:
    rec = FlightRecorder(steps=8, exploding_threshold=5.0)
    rec.update(entry(0, max_abs=5.0))  # at the threshold: not above
    assert rec.get() == ()
    rec.update(entry(1, max_abs=5.5))
    assert steps_of(rec.get()) == [("exploding", 1, [0, 1])]


def test_norm_spike_against_the_median_of_the_window() -> None:
    rec = FlightRecorder(steps=16, spike_factor=10.0, min_window=4)
    for step, norm in enumerate([1.0, 1.0, 1.0]):
        rec.update(entry(step, norm))
    rec.update(entry(3, 100.0))  # only 3 previous norms: no spike yet
    assert rec.get() == ()
    # window 1, 1, 1, 100: the median is 1, so 10.5 > 10 x 1 is a spike although the mean
    # (25.75) would have hidden it
    rec.update(entry(4, 10.5))
    assert steps_of(rec.get()) == [("norm_spike", 4, [0, 1, 2, 3, 4])]
    rec.update(entry(5, 9.0))  # median of 1, 1, 1, 100, 10.5 is 1: 9 < 10 x 1
    assert rec.get() == ()


def test_trigger_priority_and_a_spike_on_several_layers() -> None:
    rec = FlightRecorder(steps=8, exploding_threshold=1.0)
    for step in range(4):
        rec.update(entry(step, layers=3))
    # NaN, above the threshold and a spike at once: named nonfinite
    rec.update(entry(4, 1000.0, layers=3, nonfinite=1, max_abs=2.0))
    ((trigger, _, _),) = steps_of(rec.get())
    assert trigger == "nonfinite"
    assert entry(0, 2.0, layers=3).total_norm == pytest.approx(2.0)


def test_byte_bound_drops_the_oldest_but_keeps_the_newest() -> None:
    rec = FlightRecorder(steps=100, max_bytes=3 * 48 * 10)  # three 10-layer entries
    for step in range(10):
        rec.update(entry(step, layers=10))
    assert len(rec) == 3 and rec.nbytes == 3 * 480
    rec.update(entry(10, layers=100))  # alone over the bound: kept alone
    assert len(rec) == 1 and rec.nbytes == 4800
    rec.update(entry(11, layers=10, nonfinite=1))
    assert steps_of(rec.get()) == [("nonfinite", 11, [11])]


def test_sampled_baseline_sends_the_newest_entry_alone() -> None:
    rec = FlightRecorder(steps=8, sample_every=5)
    sent = []
    for step in range(1, 16):
        rec.update(entry(step))
        sent += steps_of(rec.get())
    assert sent == [("sample", 5, [5]), ("sample", 10, [10]), ("sample", 15, [15])]
    rec.update(entry(16, nonfinite=1))  # the samples were sent: not again
    assert steps_of(rec.get()) == [("nonfinite", 16, [9, 11, 12, 13, 14, 16])]


def test_parameters_are_checked() -> None:
    with pytest.raises(ValueError):
        FlightRecorder(steps=0)
    with pytest.raises(ValueError):
        FlightRecorder(spike_factor=1.0)


def test_entry_from_summaries_keeps_the_watched_layers_as_copies() -> None:
    g = {"a": np.array([1.0, -2.0], np.float32), "b": np.array([np.nan, 3.0], np.float32)}
    local = summarize(g)
    e = LocalEntry.from_summaries(7, 1.5, local, {"b": 4})
    assert e is not None and e.layer_indices.tolist() == [4] and e.nonfinite.tolist() == [1]
    assert e.sum_sq.tolist() == [9.0] and e.max_abs.tolist() == [3.0]
    assert not np.shares_memory(e.sum_sq, local.sum_sq)
    assert LocalEntry.from_summaries(7, 1.5, local, {"c": 0}) is None
    with pytest.raises(ValueError, match="sum_abs"):
        LocalEntry.from_summaries(7, 1.5, local.norms_only(), {"a": 0})


def test_local_summary_message_and_its_split() -> None:
    e = entry(3, 2.0, layers=40, nonfinite=1)
    msg = local_summary(LocalRecord(e, "nonfinite", 5), run_id="r", rank=1, world_size=2)
    assert isinstance(decode_message(msg.model_dump_json()), LocalSummary)
    assert (msg.step, msg.trigger, msg.trigger_step) == (3, "nonfinite", 5)
    whole = encode_within(msg, "binary", None).values
    assert len(whole) == 1
    values, dropped = encode_within(msg, "binary", len(whole[0]) // 3)
    parts = [decode_message(v) for v in values]
    assert len(parts) > 3 and dropped == []
    assert sorted(i for p in parts for i in p.local_layer_indices) == list(range(40))
    assert {(p.step, p.rank, p.trigger, p.trigger_step) for p in parts} == {(3, 1, "nonfinite", 5)}


def test_producer_routes_the_local_view_to_the_recorder() -> None:
    """``recorder`` mode: quiet steps queue no LocalSummary, a NaN queues the buffer (before
    the step's summary); ``every_step``: ``record_local`` queues one per step, and
    ``record_step``'s local view rides inside the StepSummary."""
    g = {"w": np.ones(4, np.float32)}
    gp = GradientProducer("r", rank=0, world_size=2, bootstrap_servers=UNREACHABLE,
                          local_view_steps=4)
    gp.start_run({"w": 4})
    for step in range(6):
        gp.record_step(step, g, replicated=True, local_gradients=g)
    assert gp.stats().local_summaries == 0
    gp.record_local(6, summarize({"w": np.array([1, np.inf, 0, 0], np.float32)}))
    assert gp.stats().local_summaries == 4  # steps 3, 4, 5, 6
    assert gp.stats().recorded == 6  # record_local sends no StepSummary
    with pytest.raises(ValueError, match="unknown layer"):
        gp.record_local(7, summarize({"nope": np.ones(2, np.float32)}))
    with pytest.raises(ValueError, match="sum_abs"):
        gp.record_local(7, summarize(g).norms_only())
    gp.close(timeout=0)

    every = GradientProducer("r", bootstrap_servers=UNREACHABLE, local_view="every_step")
    every.start_run({"w": 4})
    every.record_local(0, summarize(g))
    every.record_local(1, summarize(g))
    every.record_step(2, g, local_gradients=g)
    assert every.stats().local_summaries == 2
    every.close(timeout=0)
