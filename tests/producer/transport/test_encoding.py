"""Message encoding (producer.transport.encoding): a recorded step as a StepSummary, and a
message as record values within the size limit."""

from __future__ import annotations

import numpy as np

from producer.summary import summarize
from producer.transport.encoding import StepRecord, encode_within, step_summary
from schemas.wire import RunStarted, decode_message


def _record(layers: int, histogram: bool = False) -> StepRecord:
    grads = {f"l{i}": np.full(4, i + 1.0, np.float32) for i in range(layers)}
    return StepRecord(3, 1.0, np.arange(layers, dtype=np.int64),
                      summarize(grads, histogram=histogram), None)


def test_step_summary_carries_the_record_and_the_histogram_in_csr_form() -> None:
    record = _record(3, histogram=True)
    message = step_summary(record, run_id="r", rank=0, world_size=1,
                           layer_index={f"l{i}": i for i in range(3)})
    assert message.step == 3 and message.layer_indices == [0, 1, 2]
    assert message.sum_sq == [4.0, 16.0, 36.0]
    assert message.exp_hist_offsets == [0, 1, 2, 3] and message.exp_hist_counts == [4, 4, 4]
    assert message.nan is None  # all finite: the NaN count is not sent


def test_within_the_limit_one_value_and_other_messages_never_split() -> None:
    message = step_summary(_record(5), run_id="r", rank=0, world_size=1,
                           layer_index={f"l{i}": i for i in range(5)})
    values, oversized = encode_within(message, "binary", 1 << 20)
    assert len(values) == 1 and oversized == []
    assert [int(i) for i in decode_message(values[0]).layer_indices] == list(range(5))
    start = RunStarted(run_id="r", rank=0, world_size=1, layer_names=["a"], numel=[1],
                       vanishing_threshold=1e-7, exploding_threshold=1e3, host="h",
                       start_time=0.0)
    assert len(encode_within(start, "binary", 10).values) == 1


def test_split_parts_cover_every_layer_once_and_too_large_layers_are_named() -> None:
    message = step_summary(_record(200), run_id="r", rank=0, world_size=1,
                           layer_index={f"l{i}": i for i in range(200)})
    values, oversized = encode_within(message, "json", 3000)
    parts = [decode_message(v) for v in values]
    assert len(parts) > 1 and all(len(v) <= 3000 for v in values) and oversized == []
    assert sorted(i for p in parts for i in p.layer_indices) == list(range(200))
    values, oversized = encode_within(message, "json", 100)
    assert values == [] and sorted(oversized) == list(range(200))
