"""The binary decode path of schemas.wire: a header layout seen before is not parsed again,
the arrays' element rules are checked by one reduction per dtype, and the message is
built without pydantic's per-field work; every result and every refusal is the one of the
per-array path that parses the whole header (the per-array path is taken for arrays with
gaps between them or of another dtype)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from schemas import wire
from schemas.wire import (
    BINARY_MAGIC,
    MergedFrame,
    StepSummary,
    WireError,
    decode_frame_message,
    decode_message,
    encode_binary,
    read_binary_container,
)


def _fields(**over: object) -> dict[str, object]:
    base: dict[str, object] = dict(
        run_id="r", step=3, rank=1, world_size=2, wall_time=1.5, layer_indices=[0, 1, 2],
        numel=[4, 8, 2], sum_abs=[1.0, 2.0, 0.5], sum_sq=[0.5, 1.0, 0.25],
        max_abs=[0.5, 0.7, 0.3], nonfinite=[0, 1, 0],
    )
    base.update(over)
    return base


def _raw(**over: object) -> bytes:
    """A compact binary StepSummary (``encode_binary``) of fields not validated first."""
    return encode_binary(StepSummary.model_construct(**_fields(**over)))


def _repack(raw: bytes, gap: int = 0, dtypes: dict[str, str] | None = None,
            after_metadata: str = "") -> bytes:
    """``raw``'s container written again: ``gap`` zero bytes after every array, the arrays
    named in ``dtypes`` in another dtype (``"I32"``, ``"F32"``), and ``after_metadata``
    (JSON members, e.g. ``',"x":{...}'``) after the metadata member."""
    scalars, arrays = read_binary_container(raw)
    casts = {"I32": "<i4", "F32": "<f4", "I64": "<i8", "F64": "<f8"}
    header, buffers, offset = {}, [], 0
    for name, values in arrays.items():
        code = (dtypes or {}).get(name, "F64" if values.dtype.kind == "f" else "I64")
        data = values.astype(casts[code]).tobytes()
        header[name] = {"dtype": code, "shape": [len(values)],
                        "data_offsets": [offset, offset + len(data)]}
        buffers.append(data + b"\0" * gap)
        offset += len(data) + gap
    text = json.dumps(header, separators=(",", ":"))[:-1]
    meta = json.dumps({"gradstream": json.dumps(scalars, separators=(",", ":"))},
                      separators=(",", ":"))
    text = (text + ',"__metadata__":' + meta + after_metadata + "}").encode()
    return BINARY_MAGIC + b"T" + len(text).to_bytes(8, "little") + text + b"".join(buffers)


def _reason(raw: bytes) -> str:
    with pytest.raises(WireError) as err:
        decode_message(raw)
    return err.value.reason


def test_a_layout_seen_before_decodes_each_message_with_its_own_metadata() -> None:
    """Two messages of one shape share the header bytes before the metadata: the second
    is decoded from the cached layout, with its own step, rank and values."""
    first = StepSummary(**_fields())
    second = StepSummary(**_fields(step=4, rank=0, wall_time=2.5, sum_sq=[9.0, 8.0, 7.0]))
    raw1, raw2 = encode_binary(first), encode_binary(second)
    cut = raw1.index(wire._METADATA_MEMBER)
    assert raw1[:cut] == raw2[:cut]  # same header bytes before the metadata
    assert decode_message(raw1) == first
    assert raw1[12:cut] in wire._LAYOUTS
    decoded = decode_message(raw2)
    assert decoded == second and decoded.step == 4 and decoded.rank == 0
    assert decoded.sum_sq.tolist() == [9.0, 8.0, 7.0] and not decoded.sum_sq.flags.writeable


def test_members_after_the_metadata_make_the_whole_header_parsed() -> None:
    """A header with the cached bytes before its metadata but another member after it
    (here ``sum_sq`` again, which JSON's last-wins makes the array that counts) is parsed
    whole, never decoded from the cached layout."""
    raw = _raw()
    assert decode_message(raw).sum_sq.tolist() == [0.5, 1.0, 0.25]  # layout cached
    extra = np.array([3.0, 2.0, 1.0]).tobytes()
    _, arrays = read_binary_container(raw)
    end = sum(a.nbytes for a in arrays.values())
    again = (',"sum_sq":{"dtype":"F64","shape":[3],"data_offsets":['
             f"{end},{end + len(extra)}" "]}")
    twisted = _repack(raw, after_metadata=again) + extra
    cut = twisted.index(wire._METADATA_MEMBER)
    assert twisted[12:cut] in wire._LAYOUTS  # the same bytes before the metadata
    assert decode_message(twisted).sum_sq.tolist() == [3.0, 2.0, 1.0]
    wire._LAYOUTS.clear()  # seen first, such a header leaves nothing cached for the others
    assert decode_message(twisted).sum_sq.tolist() == [3.0, 2.0, 1.0]
    assert twisted[12:cut] not in wire._LAYOUTS
    assert decode_message(raw).sum_sq.tolist() == [0.5, 1.0, 0.25]


def test_a_buffer_cut_short_is_refused_from_a_cached_layout_as_from_a_parsed_one() -> None:
    raw = _raw()
    decode_message(raw)
    short = raw[:-8]
    cached = _reason(short)
    wire._LAYOUTS.clear()
    assert _reason(short) == cached == (
        "undecodable binary message: nonfinite: shape / data_offsets do not match the buffer")


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"sum_abs": [1.0, math.nan, 1.0]}, "sum_abs.1: must be >= 0 (+inf allowed, not NaN)"),
        ({"sum_sq": [1.0, 1.0, -math.inf]}, "sum_sq.2: must be >= 0 (+inf allowed, not NaN)"),
        ({"max_abs": [1.0, math.inf, 1.0]}, "max_abs.1: must be finite and >= 0"),
        ({"max_abs": [-1.0, 1.0, 1.0]}, "max_abs.0: must be finite and >= 0"),
        ({"numel": [4, 0, 2]}, "numel.1: must be > 0"),
        ({"layer_indices": [0, -1, 2]}, "layer_indices.1: must be >= 0"),
        ({"numel": [4, 0, 2], "sum_sq": None}, "numel.1: must be > 0"),  # field order
        ({"sum_sq": None}, "sum_sq: Field required"),
        ({"weight_min": [1.0, -math.inf, 0.0]}, "weight_min.1: must be finite"),
        ({"exp_hist_offsets": [0, 1, 2, 3], "exp_hist_columns": [0, 999, 3],
          "exp_hist_counts": [4, 7, 2]}, "exp_hist_columns.1: must be in [0, "),
        ({"layer_indices": [1, 1, 2]}, "layer_indices must be unique"),
        ({"nonfinite": [0, 9, 0]}, "nonfinite[1]=9 exceeds numel[1]=8"),
        ({"rank": 2}, "rank 2 must be < world_size 2"),
    ],
)
def test_the_reductions_refuse_what_the_per_array_path_refuses(override, reason) -> None:
    """One message decoded three ways gives one refusal: the encoder's layout (one
    reduction per dtype over all arrays), the same arrays with gaps between them and with
    int32 / float32 arrays (both checked array by array, never by the reductions)."""
    raw = _raw(**override)
    gappy = _repack(raw, gap=8)
    narrow = _repack(raw, dtypes={"numel": "I32", "sum_abs": "F32"})
    assert wire._read_container(raw)[1].words is not None
    assert wire._read_container(gappy)[1].words is None
    got = [_reason(r) for r in (raw, gappy, narrow)]
    assert got[0].startswith(reason) and got[0] == got[1], got
    if "numel" not in override and "sum_abs" not in override:  # float32 NaN prints alike
        assert got[2] == got[0], got


def test_other_dtypes_and_gaps_decode_to_the_same_message() -> None:
    msg = StepSummary(**_fields(nan=[0, 1, 0], shard_index=[1, 1, 0], shard_count=[2, 2, 1]))
    raw = encode_binary(msg)
    for variant in (raw, _repack(raw, gap=16), _repack(raw, dtypes={"numel": "I32"})):
        decoded = decode_message(variant)
        assert decoded == msg
        assert decoded.numel.dtype == np.int64 and not decoded.numel.flags.writeable


def test_an_empty_array_decodes_and_layer_indices_may_not_be_empty() -> None:
    msg = StepSummary(**_fields(local_layer_indices=[0], local_numel=[4], local_sum_abs=[1.0],
                                local_sum_sq=[1.0], local_max_abs=[1.0], local_nonfinite=[0],
                                exp_hist_offsets=[0, 0, 0, 0], exp_hist_columns=[],
                                exp_hist_counts=[], numel=[0 + 1, 1, 2], nonfinite=[1, 1, 2]))
    decoded = decode_message(encode_binary(msg))
    assert decoded == msg and len(decoded.exp_hist_columns) == 0
    empty = {"layer_indices": [], "numel": [], "sum_abs": [], "sum_sq": [], "max_abs": [],
             "nonfinite": []}
    assert _reason(_raw(**empty)) == "layer_indices: List should have at least 1 item"


def test_the_decoded_message_is_what_model_construct_builds() -> None:
    """``_construct`` builds the instance ``model_construct`` builds (fields in field order,
    every field set, no extra, no private attributes); copies and dumps work on it."""
    for raw, decode, model in (
        (encode_binary(StepSummary(**_fields())), decode_message, StepSummary),
        (encode_binary(MergedFrame(**_fields(rank=0, ranks_seen=[0, 1]))),
         decode_frame_message, MergedFrame),
    ):
        decoded = decode(raw)
        assert model in wire._PLAIN_MODELS and type(decoded) is model
        built = model.model_construct(**decoded.__dict__)
        assert list(decoded.__dict__) == list(model.model_fields) == list(built.__dict__)
        assert decoded.__dict__ == built.__dict__
        assert decoded.model_fields_set == built.model_fields_set == set(model.model_fields)
        assert decoded.__pydantic_extra__ is built.__pydantic_extra__ is None
        assert decoded.__pydantic_private__ is built.__pydantic_private__ is None
        copy = decoded.model_copy(update={"step": 9})
        assert copy.step == 9 and decoded.step == 3 and copy.sum_sq is decoded.sum_sq
    assert isinstance(decode_frame_message(raw).ranks_seen, list)
