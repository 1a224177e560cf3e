"""Decoding many binary step summaries at once: one NumPy pass per message shape.

:func:`schemas.wire.decode_message` checks one message with a few dozen small NumPy
calls, each costing microseconds whatever its size: for the 16-layer summaries of a
pipeline stage that call overhead is most of a message's decoding. A worker reads records
hundreds at a time (one poll), and the summaries of one run share their shape (the same
array fields and lengths, so the same header bytes before the metadata, one cached
``schemas.wire._Layout``). :func:`decode_messages` decodes such a group together:

1. each record's container is read as :func:`schemas.wire.decode_message` reads it (the
   header, the layout, the scalar fields), and its scalar fields are validated by the
   same pydantic model;
2. the buffers of the group are laid side by side as one ``int64[messages, words]``
   matrix (one copy), and every array's element rule (``>= 0``, ``> 0``, finite, ...) is
   checked for every message with one ``ufunc.reduceat`` per dtype and bound over the
   whole matrix;
3. the model's cross-field rules (:meth:`schemas.wire.StepSummary._aligned`) are checked
   column-wise over the matrix for the fields the SDK sends every step (the statistics,
   the shard layout, dense per-rank scalars); a message carrying any other array field
   (histograms, the weight distribution, a local view, an in-band reduction) or an
   empty one has the model's validator run on it alone;
4. each message is built with its arrays as read-only row slices of the matrix.

A message that fails any check, or is not a binary step summary, or is the only one of
its shape, is decoded again alone by :func:`schemas.wire.decode_message`, so a rejected
message gets exactly the error (and the dead-letter reason) it gets alone, and a valid one
exactly the same message: ``decode_messages(raws)`` equals
``[decode_message(r) for r in raws]`` with each WireError returned in place of being
raised (``tests/schemas/test_wire_batch.py`` checks this on random valid and broken
messages).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import ValidationError

from schemas.wire import (
    _ANY_FLOAT,
    _BINARY_MODELS,
    _FIELD_TEMPLATES,
    _FLOAT_KINDS,
    _HIST_COL,
    _I64,
    _NONNEG_FLOAT,
    _POS_INT,
    _SUM_FLOAT,
    EXP_HIST_BINS,
    MAX_MESSAGE_BYTES,
    LocalSummary,
    RunFinished,
    RunStarted,
    StepSummary,
    WireError,
    _array_plan,
    _construct,
    _Layout,
    _read_container,
    decode_message,
    is_binary,
)

Decoded = RunStarted | StepSummary | RunFinished | LocalSummary | WireError
"""What :func:`decode_messages` gives for one record: the message, or why it was refused."""

_KIND = "step_summary"

COLUMN_CHECKED = frozenset({
    "layer_indices", "numel", "sum_abs", "sum_sq", "max_abs", "nonfinite", "nan",
    "shard_index", "shard_count", "rank_scalar_values",
})
"""The array fields whose cross-field rules :func:`_aligned_rows` checks column-wise: what
the SDK sends every step. A layout with any other array field runs the model's own
validator per message instead."""


def decode_one(raw: bytes | str | None) -> Decoded:
    """:func:`schemas.wire.decode_message`, with its WireError returned instead of raised."""
    try:
        return decode_message(raw)  # type: ignore[arg-type]
    except WireError as exc:
        return exc


def decode_messages(raws: Sequence[bytes | str | None]) -> list[Decoded]:
    """Decode and validate the summaries-topic records ``raws`` (JSON or binary), the
    binary step summaries of one shape together (module doc).

    Args:
        raws: record values, as :func:`schemas.wire.decode_message` takes them.

    Returns:
        One entry per record, in order: the validated message, or the WireError that
        :func:`schemas.wire.decode_message` raises for it (its ``reason`` names the field).
        Binary arrays are read-only views of one matrix per group of same-shaped
        messages.
    """
    out: list[Decoded | None] = [None] * len(raws)
    groups: dict[int, tuple[_Layout, list[tuple[int, dict[str, Any], memoryview]]]] = {}
    for i, raw in enumerate(raws):
        if raw is None or len(raw) > MAX_MESSAGE_BYTES or not is_binary(raw):
            out[i] = decode_one(raw)
            continue
        try:
            scalars, layout, data = _read_container(bytes(raw))
        except ValueError:  # WireError included: the single path says which
            out[i] = decode_one(raw)
            continue
        if scalars.get("type") != _KIND or layout.words is None:
            out[i] = decode_one(raw)
            continue
        groups.setdefault(id(layout), (layout, []))[1].append((i, scalars, data))
    for layout, members in groups.values():
        if len(members) < 2:
            for i, _, _ in members:
                out[i] = decode_one(raws[i])
            continue
        _decode_group(layout, members, out)
        for i, _, _ in members:
            if out[i] is None:  # refused by a batch check: the single path names why
                out[i] = decode_one(raws[i])
    return out  # type: ignore[return-value]


def _decode_group(layout: _Layout, members: list[tuple[int, dict[str, Any], memoryview]],
                  out: list[Decoded | None]) -> None:
    """Decode ``members`` (record index, scalar fields, buffer area), binary step summaries
    of one ``layout``, into ``out``; a member failing any check is left None."""
    model, scalar_model, validators, fields = _BINARY_MODELS[_KIND]
    plan = layout.plans.get(_KIND)
    if plan is None:
        plan = layout.plans[_KIND] = _array_plan(layout, fields)
    entries, error, fast, _, _ = plan
    if error is not None or not fast:
        return
    heads: list[Any] = []
    rows: list[int] = []
    for row, (_, scalars, _) in enumerate(members):
        try:
            heads.append(scalar_model.model_validate(scalars))
            rows.append(row)
        except ValidationError:
            continue
    if not rows:
        return
    assert layout.words is not None
    base, starts, words = layout.words
    matrix = np.frombuffer(b"".join(members[r][2][base:base + 8 * words] for r in rows),
                           _I64).reshape(len(rows), words)
    floats = matrix.view(np.float64)
    ok = _elements_ok(layout, entries, matrix, floats, starts)
    columns = {}
    for name, rule, _, at in entries:
        if at >= 0:
            start, stop, _ = layout.slots[name]
            columns[name] = (floats if rule in _FLOAT_KINDS else matrix)[:, start:stop]
    empty = {name: _empty(rule, as_list) for name, rule, as_list, at in entries if at < 0}
    if not empty and set(columns) <= COLUMN_CHECKED:
        ok &= _aligned_rows(heads, columns)
        validators = ()
    template = _FIELD_TEMPLATES[_KIND]
    for j in np.flatnonzero(ok).tolist():
        values = template.copy()
        values.update(heads[j].__dict__)
        values.update(empty)
        for name, column in columns.items():
            values[name] = column[j]
        message = _construct(model, values)
        try:
            for validator in validators:
                getattr(message, validator)()
        except ValueError:
            continue
        out[members[rows[j]][0]] = message


def _empty(rule: int, as_list: bool) -> Any:
    """An empty array field as a binary decode holds it."""
    if as_list:
        return []
    array = np.empty(0, np.float64 if rule in _FLOAT_KINDS else np.int64)
    array.flags.writeable = False
    return array


def _elements_ok(layout: _Layout, entries: tuple[tuple[str, int, bool, int], ...],
                 matrix: np.ndarray, floats: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """bool[messages]: every array of the row keeps its element rule, from one
    ``reduceat`` per dtype and bound along the rows (the bounds and rules of
    :func:`schemas.wire._checked_arrays`; a NaN makes a float bound NaN, which fails)."""
    ok = np.ones(len(matrix), bool)
    rules = {rule for _, rule, _, at in entries if at >= 0}
    lo_int = np.minimum.reduceat(matrix, starts, axis=1) if rules - set(_FLOAT_KINDS) else None
    hi_int = np.maximum.reduceat(matrix, starts, axis=1) if _HIST_COL in rules else None
    floaty = bool(rules & (set(_FLOAT_KINDS) - {_ANY_FLOAT}))
    lo_f = np.minimum.reduceat(floats, starts, axis=1) if floaty else None
    hi_f = np.maximum.reduceat(floats, starts, axis=1) if floaty else None
    with np.errstate(invalid="ignore"):
        for _, rule, _, at in entries:
            if at < 0 or rule == _ANY_FLOAT:
                continue
            if rule in _FLOAT_KINDS:
                assert lo_f is not None and hi_f is not None
                lo, hi = lo_f[:, at], hi_f[:, at]
                if rule == _SUM_FLOAT:
                    ok &= lo >= 0
                elif rule == _NONNEG_FLOAT:
                    ok &= (lo >= 0) & (hi < math.inf)
                else:
                    ok &= (lo > -math.inf) & (hi < math.inf)
            else:
                assert lo_int is not None
                lo = lo_int[:, at]
                if rule == _HIST_COL:
                    assert hi_int is not None
                    ok &= (lo >= 0) & (hi_int[:, at] < EXP_HIST_BINS)
                else:
                    ok &= lo > 0 if rule == _POS_INT else lo >= 0
    return ok


def _aligned_rows(heads: list[Any], columns: dict[str, np.ndarray]) -> np.ndarray:
    """bool[messages]: the rows pass :meth:`schemas.wire.StepSummary._aligned`, for a
    layout whose array fields are all in :data:`COLUMN_CHECKED` (``columns``: name ->
    ``[messages, length]`` view). False where a rule fails *or* is not decided here
    (layer indices not ascending): the single path decides those."""
    n = len(heads)
    layers = columns["layer_indices"]
    width = layers.shape[1]
    if any(c.shape[1] != width for name, c in columns.items() if name != "rank_scalar_values"):
        return np.zeros(n, bool)
    if ("sum_abs" in columns) != ("max_abs" in columns):
        return np.zeros(n, bool)
    if ("shard_index" in columns) != ("shard_count" in columns):
        return np.zeros(n, bool)
    rank = np.fromiter((h.rank for h in heads), np.int64, n)
    world = np.fromiter((h.world_size for h in heads), np.int64, n)
    ok = rank < world
    ok &= (layers[:, 1:] > layers[:, :-1]).all(axis=1)  # ascending, so unique
    nonfinite = columns["nonfinite"]
    ok &= (nonfinite <= columns["numel"]).all(axis=1)
    if "nan" in columns:
        ok &= (columns["nan"] <= nonfinite).all(axis=1)
    if "shard_index" in columns:
        count = columns["shard_count"]
        ok &= (columns["shard_index"] < count).all(axis=1)
        ok &= count.max(axis=1) <= world
    values = columns.get("rank_scalar_values")
    count_values = 0 if values is None else values.shape[1]
    for j, head in enumerate(heads):
        names = head.rank_scalar_names
        if names is None:
            ok[j] &= values is None
        else:  # dense, one reported rank (no reduced_ranks in this layout)
            ok[j] &= values is not None and count_values == len(names) == len(set(names))
        if (head.part_index is None) != (head.part_count is None) or (
                head.part_index is not None and head.part_index >= head.part_count):
            ok[j] = False
    return ok
