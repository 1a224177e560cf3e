"""Wire contract: every validator rejects what it must, with a reason naming the field."""

import json
import re

import numpy as np
import pytest
from pydantic import ValidationError

from schemas.wire import (
    MAX_MESSAGE_BYTES,
    RunStarted,
    StepSummary,
    WireError,
    decode_message,
    encode_message,
)


def _summary(**over):
    base = dict(
        run_id="r", step=3, rank=1, world_size=2, wall_time=1.5, layer_indices=[0, 1],
        numel=[4, 8], sum_abs=[1.0, 2.0], sum_sq=[0.5, 1.0], max_abs=[0.5, 0.7],
        nonfinite=[0, 1],
    )
    base.update(over)
    return base


def _raw(**over) -> bytes:
    d = _summary(**over)
    d.setdefault("type", "step_summary")
    d.setdefault("schema_version", "1.0")
    return json.dumps(d).encode()


def test_round_trip():
    msg = StepSummary(**_summary())
    assert decode_message(encode_message(msg)) == msg


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"step": -1}, "step"),
        ({"rank": 2}, "rank 2 must be < world_size 2"),
        ({"numel": [4]}, "numel has 1 entries"),
        ({"sum_abs": [1.0, -2.0]}, "sum_abs"),
        ({"numel": [0, 8]}, "numel"),
        ({"nonfinite": [5, 0]}, "nonfinite[0]=5 exceeds numel[0]=4"),
        ({"layer_indices": [1, 1]}, "unique"),
        ({"schema_version": "2.0"}, "unsupported schema major version 2"),
        ({"schema_version": "one"}, "MAJOR.MINOR"),
        ({"world_size": 0}, "world_size"),
        ({"run_id": ""}, "run_id"),
    ],
)
def test_invalid_fields_are_named(override, field):
    with pytest.raises(WireError) as err:
        decode_message(_raw(**override))
    assert field in err.value.reason


def test_nan_statistic_rejected():
    raw = _raw().replace(b'"sum_sq": [0.5, 1.0]', b'"sum_sq": [NaN, 1.0]')
    with pytest.raises(WireError) as err:
        decode_message(raw)
    assert "sum_sq" in err.value.reason


def test_malformed_json_and_unknown_type():
    with pytest.raises(WireError, match="Invalid JSON"):
        decode_message(b'{"type": "step_summary", ')
    with pytest.raises(WireError):
        decode_message(b'{"type": "something_else", "schema_version": "1.0"}')
    with pytest.raises(WireError, match="empty"):
        decode_message(None)


def test_newer_minor_version_with_extra_fields_still_parses():
    d = json.loads(_raw())
    d["schema_version"] = "1.7"
    d["exponent_histogram"] = [[1, 2], [3, 4]]
    msg = decode_message(json.dumps(d).encode())
    assert isinstance(msg, StepSummary) and msg.schema_version == "1.7"


def test_oversized_message_refused_before_parsing():
    with pytest.raises(WireError, match="exceeds"):
        decode_message(b" " * (MAX_MESSAGE_BYTES + 1))


def test_run_started_validators():
    ok = dict(run_id="r", world_size=2, layer_names=["a", "b"], numel=[1, 2], start_time=1.0)
    assert RunStarted(**ok).vanishing_threshold == 1e-7
    with pytest.raises(ValueError, match="numel has 1 entries"):
        RunStarted(**{**ok, "numel": [1]})
    with pytest.raises(ValueError, match="unique"):
        RunStarted(**{**ok, "layer_names": ["a", "a"]})
    with pytest.raises(ValueError, match="vanishing_threshold must be below"):
        RunStarted(**ok, vanishing_threshold=10.0, exploding_threshold=1.0)


def test_arbitrary_layer_names_survive():
    names = ['a,b', 'quote"d', "new\nline", "ünï©ødé 层"]
    msg = RunStarted(run_id="r", world_size=1, layer_names=names, numel=[1] * 4,
                     start_time=0.0)
    assert decode_message(encode_message(msg)).layer_names == names


def _with_hist(**over):
    d = json.loads(_raw())
    d.update(exp_hist_offsets=[0, 2, 3], exp_hist_columns=[0, 40, 41], exp_hist_counts=[1, 3, 7],
             weight_sum_sq=[2.0, 3.0], update_sum_sq=[0.1, 0.2])
    d.update(over)
    return json.dumps(d).encode()


def test_schema_1_1_richer_statistics_validate():
    msg = decode_message(_with_hist())
    assert msg.exp_hist_counts == [1, 3, 7] and msg.weight_sum_sq == [2.0, 3.0]
    assert decode_message(encode_message(msg)) == msg
    old = decode_message(_raw(schema_version="1.0"))
    assert old.exp_hist_offsets is None and old.weight_sum_sq is None


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"exp_hist_counts": [1, 3, 6]}, "layer 1 sum to 6, expected numel - nonfinite = 7"),
        ({"exp_hist_columns": [40, 0, 41]}, "strictly ascending"),
        ({"exp_hist_columns": [0, 40, 999]}, "exp_hist_columns"),
        ({"exp_hist_offsets": [0, 3]}, "exp_hist_offsets must have 3 entries"),
        ({"exp_hist_counts": None}, "go together"),
        ({"weight_sum_sq": [1.0]}, "weight_sum_sq has 1 entries"),
        ({"update_sum_sq": [1.0, -1.0]}, "update_sum_sq"),
    ],
)
def test_schema_1_1_bad_richer_statistics(override, reason):
    with pytest.raises(WireError) as err:
        decode_message(_with_hist(**override))
    assert reason in err.value.reason


def test_schema_1_2_norms_mode_message_parses_without_abs_statistics():
    msg = decode_message(_raw(schema_version="1.2", sum_abs=None, max_abs=None))
    assert isinstance(msg, StepSummary)
    assert not msg.has_abs and msg.sum_abs is None and msg.max_abs is None
    d = _summary(schema_version="1.2")
    del d["sum_abs"], d["max_abs"]
    assert not decode_message(json.dumps({**d, "type": "step_summary"})).has_abs


@pytest.mark.parametrize("missing", ["sum_abs", "max_abs"])
def test_abs_statistics_go_together(missing):
    with pytest.raises(WireError, match="go together"):
        decode_message(_raw(schema_version="1.2", **{missing: None}))


def _weights(**over):
    d = dict(
        weight_sum_sq=[1.0, 2.0], weight_sum=[0.5, -1.0], weight_sum_cube=[0.1, -0.2],
        weight_sum_quad=[0.3, 0.4], weight_min=[-1.0, -2.0], weight_max=[1.0, 0.5],
        weight_nonfinite=[0, 2], weight_exp_hist_offsets=[0, 2, 3],
        weight_exp_hist_columns=[0, 130, 134], weight_exp_hist_counts=[1, 3, 6],
    )
    d.update(over)
    return d


def test_weight_distribution_validates():
    msg = decode_message(_raw(schema_version="1.2", **_weights()))
    assert msg.has_weight_distribution and msg.weight_nonfinite == [0, 2]


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"weight_sum": None}, "goes together"),
        ({"weight_exp_hist_offsets": None, "weight_exp_hist_columns": None,
          "weight_exp_hist_counts": None}, "goes together"),
        ({"weight_min": [2.0, -2.0]}, "weight_min must be <= weight_max"),
        ({"weight_exp_hist_counts": [1, 3, 7]}, "weight_exp_hist_counts of layer 1 sum to 7"),
        ({"weight_sum_quad": [-1.0, 0.0]}, "weight_sum_quad"),
        ({"weight_sum": [float("nan"), 0.0]}, "weight_sum"),
    ],
)
def test_bad_weight_distribution(override, reason):
    raw = json.loads(_raw(schema_version="1.2", **_weights()))
    raw.update(override)
    with pytest.raises(WireError, match=reason):
        decode_message(json.dumps(raw))


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"shard_index": [0, 0]}, "go together"),
        ({"shard_index": [0], "shard_count": [1]}, "one per layer_indices"),
        ({"shard_index": [1, 0], "shard_count": [1, 1]}, "shard_index"),
        ({"shard_index": [0, 0], "shard_count": [3, 1]}, "world_size"),
        ({"local_layer_indices": [0]}, "local view goes together"),
        ({"local_layer_indices": [0, 0], "local_numel": [1, 1], "local_sum_abs": [0, 0],
          "local_sum_sq": [0, 0], "local_max_abs": [0, 0], "local_nonfinite": [0, 0]},
         "unique"),
        ({"local_layer_indices": [0], "local_numel": [1], "local_sum_abs": [0.0],
          "local_sum_sq": [0.0], "local_max_abs": [0.0], "local_nonfinite": [2]},
         "local_nonfinite exceeds"),
    ],
)
def test_layout_and_local_view_are_checked(override, reason):
    with pytest.raises(WireError, match=reason):
        decode_message(_raw(**override))


def test_layout_and_local_view_round_trip():
    msg = StepSummary(**_summary(
        shard_index=[0, 1], shard_count=[1, 2], local_layer_indices=[1], local_numel=[8],
        local_sum_abs=[3.0], local_sum_sq=[2.0], local_max_abs=[1.0], local_nonfinite=[0]))
    again = decode_message(encode_message(msg))
    assert again == msg and again.has_local


# -- binary form (safetensors container) and parts (schema 1.4) ---------------------------

from schemas.wire import (  # noqa: E402
    BINARY_MAGIC,
    MergedFrame,
    decode_frame_message,
    encode_binary,
    split_step_summary,
    to_display,
)


def _binary(**over) -> bytes:
    """A binary StepSummary whose arrays are written as given (bypassing the model)."""
    import numpy as np

    d = _summary(**over)
    arrays = {k: v for k, v in d.items() if isinstance(v, list)}
    scalars = {k: v for k, v in d.items() if not isinstance(v, list)}
    scalars.update(type="step_summary", schema_version="1.4")
    header, bufs, off = {}, [], 0
    for k, v in arrays.items():
        floats = any(isinstance(x, float) for x in v)
        b = np.asarray(v, "<f8" if floats else "<i8").tobytes()
        header[k] = {"dtype": "F64" if floats else "I64", "shape": [len(v)],
                     "data_offsets": [off, off + len(b)]}
        bufs.append(b)
        off += len(b)
    header["__metadata__"] = {"gradstream": json.dumps(scalars)}
    text = json.dumps(header).encode()
    return BINARY_MAGIC + b"T" + len(text).to_bytes(8, "little") + text + b"".join(bufs)


def test_binary_round_trip_equals_json():
    msg = StepSummary(**_summary(shard_index=[0, 1], shard_count=[2, 2],
                                 part_index=1, part_count=3))
    raw = encode_message(msg, "binary")
    assert raw.startswith(BINARY_MAGIC + b"T")
    assert (len(raw) - raw.index(b"}", 12) - 1) % 8 < 8
    assert decode_message(raw) == msg == decode_message(encode_message(msg))


def test_binary_is_smaller_than_json_for_many_layers():
    import numpy as np

    n = 1000
    rng = np.random.default_rng(0)
    msg = StepSummary(**_summary(
        layer_indices=list(range(n)), numel=rng.integers(1, 10**7, n).tolist(),
        sum_abs=rng.random(n).tolist(), sum_sq=rng.random(n).tolist(),
        max_abs=rng.random(n).tolist(), nonfinite=[0] * n))
    assert len(encode_binary(msg)) < 0.8 * len(encode_message(msg))
    assert decode_message(encode_binary(msg)) == msg


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"sum_abs": [1.0, float("nan")]}, "sum_abs.1: must be >= 0 (+inf allowed, not NaN)"),
        ({"sum_sq": [-1.0, 1.0]}, "sum_sq.0: must be >= 0 (+inf allowed, not NaN)"),
        ({"sum_sq": [1.0, -float("inf")]}, "sum_sq.1: must be >= 0 (+inf allowed, not NaN)"),
        ({"max_abs": [1.0, float("inf")]}, "max_abs.1: must be finite and >= 0"),
        ({"numel": [4, 0]}, "numel.1: must be > 0"),
        ({"numel": [4]}, "numel has 1 entries"),
        ({"layer_indices": [1, 1]}, "layer_indices must be unique"),
        ({"nonfinite": [0, 9]}, "nonfinite[1]=9 exceeds numel[1]=8"),
        ({"rank": 5}, "rank 5 must be < world_size 2"),
        ({"step": -1}, "step"),
        ({"part_index": 2, "part_count": 2}, "part_index 2 must be < part_count 2"),
        ({"part_index": 0}, "part_index and part_count go together"),
        ({"layer_indices": []}, "layer_indices: List should have at least 1 item"),
        ({"schema_version": "2.0"}, "unsupported schema major version 2"),
    ],
)
def test_binary_is_validated_like_json(override, reason):
    raw = _binary(**override)
    if "schema_version" in override:  # _binary sets 1.4: patch the metadata
        raw = raw.replace(b'\\"schema_version\\": \\"1.4\\"', b'\\"schema_version\\": \\"2.0\\"')
    with pytest.raises(WireError, match=re.escape(reason)):
        decode_message(raw)


@pytest.mark.parametrize("fmt", ["binary", "json"])
def test_overflowed_sums_travel_as_inf(fmt: str) -> None:
    """A float64 sum that overflowed is +inf on the wire (schema 1.6), as the reference
    implementation's f64 sums are, never the largest double; NaN stays refused."""
    inf = float("inf")
    msg = StepSummary(**_summary(sum_abs=[1.0, inf], sum_sq=[inf, 2.0],
                                 local_layer_indices=[0], local_numel=[4],
                                 local_sum_abs=[inf], local_sum_sq=[inf],
                                 local_max_abs=[1.0], local_nonfinite=[0]))
    raw = encode_message(msg, fmt)
    back = decode_message(raw)
    assert back == msg and back.sum_sq[0] == inf and back.local_sum_sq == [inf]
    with pytest.raises(ValidationError):
        StepSummary(**_summary(sum_sq=[float("nan"), 2.0]))


def test_unknown_encoding_and_malformed_binary_are_refused():
    with pytest.raises(WireError, match="unknown wire encoding"):
        decode_message(BINARY_MAGIC + b"Z" + b"\x00" * 20)
    good = _binary()
    with pytest.raises(WireError, match="undecodable binary message"):
        decode_message(good[:-5])  # buffers cut short
    with pytest.raises(WireError, match="undecodable binary message"):
        decode_message(good[:10])
    with pytest.raises(WireError, match="not accepted here"):
        decode_frame_message(good)  # a StepSummary on the frames topic


def test_merged_frame_binary_round_trip():
    frame = MergedFrame(**_summary(rank=0, ranks_seen=[0, 1], local_ranks=[0, 1],
                                   local_layer_indices=[0, 0], local_numel=[4, 4],
                                   local_sum_abs=[1.0, 1.0], local_sum_sq=[1.0, 1.0],
                                   local_max_abs=[1.0, 1.0], local_nonfinite=[0, 0]))
    raw = encode_message(frame, "binary")
    assert decode_frame_message(raw) == frame
    with pytest.raises(WireError, match="local_layer_indices must be unique"):
        bad = frame.model_copy(update={"local_ranks": [1, 1]})
        decode_frame_message(encode_binary(bad))


def test_to_display_shows_binary_as_json_without_validating():
    shown = to_display(_binary(sum_abs=[1.0, float("nan")]))
    assert shown["sum_abs"] == [1.0, "NaN"] and shown["run_id"] == "r"
    json.dumps(shown, allow_nan=False)
    assert to_display(b'{"a": 1}') == {"a": 1}
    assert to_display(b"\xff\xfe") is None


def test_split_keeps_every_layer_once_with_histograms_and_local_rows():
    msg = StepSummary(**_summary(
        layer_indices=[5, 2, 7], numel=[4, 8, 2], sum_abs=[1.0, 2.0, 3.0],
        sum_sq=[1.0, 1.0, 1.0], max_abs=[0.5, 0.7, 0.9], nonfinite=[0, 1, 0], nan=[0, 1, 0],
        exp_hist_offsets=[0, 1, 3, 4], exp_hist_columns=[3, 1, 4, 0],
        exp_hist_counts=[4, 3, 4, 2],
        local_layer_indices=[7, 9, 5], local_numel=[1, 1, 1], local_sum_abs=[1.0] * 3,
        local_sum_sq=[1.0] * 3, local_max_abs=[1.0] * 3, local_nonfinite=[0] * 3,
    ))
    parts = split_step_summary(msg, [(0, 1), (1, 3)])
    decoded = [decode_message(encode_binary(p)) for p in parts]
    assert [p.part_index for p in decoded] == [0, 1]
    assert all(p.part_count == 2 for p in decoded)
    # a binary-decoded message holds read-only NumPy arrays (StepSummary, "Holding the
    # arrays")
    assert isinstance(decoded[1].layer_indices, np.ndarray)
    assert not decoded[1].layer_indices.flags.writeable
    assert decoded[0].layer_indices.tolist() == [5]
    assert decoded[1].layer_indices.tolist() == [2, 7]
    assert decoded[0].nan.tolist() == [0] and decoded[1].nan.tolist() == [1, 0]
    assert decoded[1].exp_hist_offsets.tolist() == [0, 2, 3]
    assert decoded[1].exp_hist_columns.tolist() == [1, 4, 0]
    # layer 7 goes with part 1; 5 and the unknown layer 9 with part 0
    assert sorted(decoded[0].local_layer_indices.tolist()) == [5, 9]
    assert decoded[1].local_layer_indices.tolist() == [7]


def test_binary_decoded_message_equals_its_json_twin_and_reencodes():
    """A binary-decoded StepSummary (NumPy arrays) equals the same message validated from
    JSON (lists), re-encodes to JSON with the same values, and a different value makes
    them unequal."""
    msg = StepSummary(**_summary(layer_indices=[3, 1], numel=[4, 8], sum_abs=[1.0, 2.0],
                                 sum_sq=[1.0, 3.0], max_abs=[0.5, 0.7], nonfinite=[0, 1]))
    binary = decode_message(encode_binary(msg))
    assert isinstance(binary.sum_sq, np.ndarray) and binary.sum_sq.dtype == np.float64
    assert binary == msg and msg == binary
    again = decode_message(encode_message(binary))
    assert isinstance(again.sum_sq, list) and again == msg
    other = StepSummary(**_summary(layer_indices=[3, 1], numel=[4, 8], sum_abs=[1.0, 2.0],
                                   sum_sq=[1.0, 3.5], max_abs=[0.5, 0.7], nonfinite=[0, 1]))
    assert binary != other


@pytest.mark.parametrize("fmt", ["binary", "json"])
def test_nan_count_travels_and_older_messages_leave_it_unknown(fmt: str) -> None:
    """Schema 1.7: ``nan`` counts the NaN among the non-finite elements, in both forms; a
    message without it (an older producer) parses with ``nan`` None (the split unknown);
    a count above ``nonfinite`` or misaligned is refused, naming the field."""
    msg = StepSummary(**_summary(nonfinite=[3, 1], nan=[2, 0]))
    back = decode_message(encode_message(msg, fmt))
    assert back == msg and list(np.asarray(back.nan)) == [2, 0]
    older = decode_message(_raw(nonfinite=[3, 1]))  # a 1.0 JSON message: no nan
    assert older.nan is None
    plain = decode_message(encode_message(StepSummary(**_summary()), fmt))
    assert plain.nan is None
    with pytest.raises(ValidationError, match=r"nan\[1\]=2 exceeds nonfinite\[1\]=1"):
        StepSummary(**_summary(nan=[0, 2]))
    with pytest.raises(ValidationError, match="nan has 1 entries"):
        StepSummary(**_summary(nan=[0]))
    with pytest.raises(WireError, match="nan"):
        decode_message(_raw(nan=[-1, 0]))


def test_merged_frame_carries_the_nan_count() -> None:
    frame = MergedFrame(**_summary(rank=0, ranks_seen=[0, 1], nonfinite=[2, 1], nan=[1, 1]))
    for fmt in ("binary", "json"):
        assert decode_frame_message(encode_message(frame, fmt)).nan is not None
        assert decode_frame_message(encode_message(frame, fmt)) == frame


# -- in-band reduced summaries (schema 1.9) -------------------------------------------------

def _reduced(**fields):
    base = dict(run_id="r", step=0, rank=1, world_size=4, wall_time=1.0, layer_indices=[0],
                numel=[3], sum_sq=[1.0], nonfinite=[0])
    return StepSummary(**{**base, **fields})


@pytest.mark.parametrize("wire_format", ["json", "binary"])
def test_reduced_summary_round_trips(wire_format):
    from schemas.wire import decode_message, encode_message

    msg = _reduced(reduced_ranks=[0, 2, 3, 4], replica_divergence=[0, 3, 1])
    back = decode_message(encode_message(msg, wire_format))
    assert back == msg and back.reporting_ranks() == [0, 1, 3]


@pytest.mark.parametrize("fields,error", [
    ({"reduced_ranks": [0]}, "pairs"),
    ({"reduced_ranks": [2, 1]}, "ascending"),
    ({"reduced_ranks": [0, 2, 1, 4]}, "ascending"),
    ({"reduced_ranks": [0, 5]}, "within world_size"),
    ({"reduced_ranks": [2, 4]}, "sending rank 1"),
    ({"replica_divergence": [0, 1, 2]}, "goes with reduced_ranks"),
    ({"reduced_ranks": [0, 4], "replica_divergence": [0, 1]}, "3 integers"),
    ({"reduced_ranks": [0, 4], "replica_divergence": [0, 9, 1]}, "rank >= world_size"),
])
def test_reduced_summary_rules(fields, error):
    with pytest.raises(ValueError, match=error):
        _reduced(**fields)


# -- LocalSummary: a flight recorder's local view (schema 1.10) ---------------------------


def _local(**over):
    base = dict(
        type="local_summary", schema_version="1.10", run_id="r", step=3, rank=1,
        world_size=2, wall_time=1.5, trigger="nonfinite", trigger_step=5,
        local_layer_indices=[0, 2], local_numel=[4, 8], local_sum_abs=[1.0, float("inf")],
        local_sum_sq=[0.5, 1.0], local_max_abs=[0.5, 0.7], local_nonfinite=[0, 8],
    )
    base.update(over)
    return base


def test_local_summary_round_trip_through_both_decoders():
    from schemas.wire import LocalSummary, decode_frame_message

    msg = LocalSummary(**_local())
    raw = encode_message(msg, "binary")  # rare messages: always JSON
    assert raw.startswith(b"{") and b"Infinity" in raw
    for decode in (decode_message, decode_frame_message):
        again = decode(raw)
        assert isinstance(again, LocalSummary) and again == msg


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"rank": 2}, "rank 2 must be < world_size 2"),
        ({"trigger_step": 2}, "trigger_step 2 must be >= step 3"),
        ({"trigger": "whenever"}, "trigger"),
        ({"local_layer_indices": []}, "local_layer_indices"),
        ({"local_numel": [4]}, "local_numel has 1 entries"),
        ({"local_layer_indices": [2, 2]}, "unique"),
        ({"local_nonfinite": [5, 0]}, "local_nonfinite exceeds"),
        ({"local_max_abs": [float("inf"), 0.0]}, "local_max_abs"),
        ({"local_sum_sq": [-1.0, 0.0]}, "local_sum_sq"),
        ({"local_numel": [0, 8]}, "local_numel"),
        ({"schema_version": "2.0"}, "major version"),
    ],
)
def test_local_summary_is_checked(override, reason):
    with pytest.raises(WireError, match=reason):
        decode_message(json.dumps(_local(**override)))
