"""Versioned, columnar pydantic v2 wire models (JSON on the wire).

A message is one JSON object with a ``type`` discriminator and a ``schema_version``
``"MAJOR.MINOR"``. Consumers accept every minor version of the major version they know
(unknown fields are ignored, so a newer minor version still parses) and reject any other
major version with :class:`WireError`.

Per-layer statistics are columnar: one array per statistic, aligned with ``layer_indices``,
which index the layer list sent in :class:`RunStarted` (model order). The statistics merge
exactly across ranks (DESIGN.md, "Wire contract"): sums add, maxima take the maximum,
counts add.
"""

from __future__ import annotations

import json
import math
from enum import StrEnum
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 1
SCHEMA_VERSION = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"
"""1.0: per-layer numel, sum_abs, sum_sq, max_abs, nonfinite. 1.1 adds the optional richer
statistics (exponent histogram, weight and update norms); 1.0 messages still parse (the new
fields default to None) and 1.0 consumers ignore the new fields."""

EXP_HIST_MIN = -134
"""Smallest binned base-2 exponent: |g| in [2^k, 2^(k+1)) goes to column k - MIN + 2.
-134 reaches below bf16's smallest subnormal (2^-133; IEEE 754 binary32 range)."""
EXP_HIST_MAX = 24
"""One past the largest binned exponent: |g| >= 2^MAX share the last column."""
EXP_HIST_BINS = EXP_HIST_MAX - EXP_HIST_MIN + 3
"""Columns: 0 exact zeros, 1 underflow (< 2^MIN), 2..B-2 one per exponent, B-1 overflow."""

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Largest encoded message accepted on either side (bytes). A 100k-layer StepSummary is
about 10 MiB; anything larger is refused before parsing."""

MAX_RUN_ID_LENGTH = 256


class WireError(ValueError):
    """A message that cannot be used: undecodable, invalid, oversized or of an unknown
    major schema version. ``reason`` is a one-line human-readable explanation that names
    the offending field; it is what the dead-letter record carries."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GradientHealth(StrEnum):
    """Run health classes of seed 001 (``GradientHealth``), ordered by severity."""

    HEALTHY = "Healthy"
    MINOR_ISSUES = "MinorIssues"
    PROBLEMS_DETECTED = "ProblemsDetected"
    CRITICAL = "Critical"

    @property
    def severity(self) -> int:
        """0 (Healthy) to 3 (Critical)."""
        return _SEVERITY[self]


_SEVERITY = {
    GradientHealth.HEALTHY: 0,
    GradientHealth.MINOR_ISSUES: 1,
    GradientHealth.PROBLEMS_DETECTED: 2,
    GradientHealth.CRITICAL: 3,
}

NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(gt=0)]
RunId = Annotated[str, Field(min_length=1, max_length=MAX_RUN_ID_LENGTH)]
WallTime = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class _Wire(BaseModel):
    """Common base: strict about types, tolerant of unknown fields (newer minor versions)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: str = SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _known_major(cls, value: str) -> str:
        major, _, minor = value.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise ValueError(f"schema_version must look like 'MAJOR.MINOR', got {value!r}")
        if int(major) != SCHEMA_MAJOR:
            raise ValueError(
                f"unsupported schema major version {major} (this build reads {SCHEMA_MAJOR}.x)"
            )
        return value


class RunStarted(_Wire):
    """Announces a run and its layer list. Every rank sends one before its first step.

    Fields: ``layer_names`` in model order (index i is layer i everywhere else),
    ``numel`` elements per layer (full tensor, all ranks together), ``world_size`` ranks,
    the seed's thresholds (``vanishing_threshold`` on mean |g|, default 1e-7;
    ``exploding_threshold`` on max |g|, default 1e3; seed 001 ``GradientFlowAnimator``),
    ``host``, ``start_time`` (unix seconds) and free-form JSON ``config``.
    """

    type: Literal["run_started"] = "run_started"
    run_id: RunId
    rank: NonNegInt = 0
    world_size: PosInt
    layer_names: list[str] = Field(min_length=1)
    numel: list[PosInt]
    vanishing_threshold: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1e-7
    exploding_threshold: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1e3
    host: str = ""
    start_time: WallTime
    config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _aligned(self) -> RunStarted:
        if len(self.numel) != len(self.layer_names):
            raise ValueError(
                f"numel has {len(self.numel)} entries but layer_names has "
                f"{len(self.layer_names)}"
            )
        if len(set(self.layer_names)) != len(self.layer_names):
            raise ValueError("layer_names must be unique")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        if self.vanishing_threshold >= self.exploding_threshold:
            raise ValueError("vanishing_threshold must be below exploding_threshold")
        return self


class StepSummary(_Wire):
    """One rank's gradient summary for one optimiser step.

    Arrays are aligned with ``layer_indices`` (indices into RunStarted.layer_names):
    ``numel`` elements of this rank's shard (int > 0), ``sum_abs`` = sum |g| and
    ``sum_sq`` = sum g^2 over the finite elements (float64, >= 0), ``max_abs`` = max |g|
    over the finite elements (0 when none), ``nonfinite`` = count of NaN/+-Inf elements.
    ``wall_time`` is the producer's unix time (s) when the step was recorded.

    Optional (schema 1.1, off by default in the producer), all exactly mergeable by
    addition across ranks:

    - exponent histogram of the finite elements in sparse CSR form: for layer i, the
      columns ``exp_hist_columns[exp_hist_offsets[i]:exp_hist_offsets[i+1]]`` (ascending,
      in ``[0, EXP_HIST_BINS)``) hold the counts ``exp_hist_counts[...]``; the counts of a
      layer sum to ``numel - nonfinite``;
    - ``weight_sum_sq``: sum of w^2 of the layer's weights (this rank's shard);
    - ``update_sum_sq``: sum of (w_t - w_{t-1})^2, the squared norm of the last update.
    """

    type: Literal["step_summary"] = "step_summary"
    run_id: RunId
    step: NonNegInt
    rank: NonNegInt
    world_size: PosInt
    wall_time: WallTime
    layer_indices: list[NonNegInt] = Field(min_length=1)
    numel: list[PosInt]
    sum_abs: list[NonNegFloat]
    sum_sq: list[NonNegFloat]
    max_abs: list[NonNegFloat]
    nonfinite: list[NonNegInt]
    exp_hist_offsets: list[NonNegInt] | None = None
    exp_hist_columns: list[Annotated[int, Field(ge=0, lt=EXP_HIST_BINS)]] | None = None
    exp_hist_counts: list[PosInt] | None = None
    weight_sum_sq: list[NonNegFloat] | None = None
    update_sum_sq: list[NonNegFloat] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> StepSummary:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        n = len(self.layer_indices)
        for name in ("numel", "sum_abs", "sum_sq", "max_abs", "nonfinite"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(
                    f"{name} has {got} entries but layer_indices has {n}: arrays must be aligned"
                )
        if len(set(self.layer_indices)) != n:
            raise ValueError("layer_indices must be unique within one summary")
        for i, (count, bad) in enumerate(zip(self.numel, self.nonfinite, strict=True)):
            if bad > count:
                raise ValueError(
                    f"nonfinite[{i}]={bad} exceeds numel[{i}]={count}"
                )
        for name in ("weight_sum_sq", "update_sum_sq"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries but layer_indices has {n}")
        self._check_histogram(n)
        return self

    def _check_histogram(self, n: int) -> None:
        parts = (self.exp_hist_offsets, self.exp_hist_columns, self.exp_hist_counts)
        if all(p is None for p in parts):
            return
        offsets, columns, counts = parts
        if offsets is None or columns is None or counts is None:
            raise ValueError("exp_hist_offsets, exp_hist_columns and exp_hist_counts go together")
        if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(columns):
            raise ValueError(
                f"exp_hist_offsets must have {n + 1} entries from 0 to len(exp_hist_columns)"
            )
        if len(counts) != len(columns):
            raise ValueError("exp_hist_counts and exp_hist_columns must have equal lengths")
        off = np.asarray(offsets, dtype=np.int64)
        if np.any(np.diff(off) < 0):
            raise ValueError("exp_hist_offsets must be non-decreasing")
        cols = np.asarray(columns, dtype=np.int64)
        starts = np.zeros(len(cols), dtype=bool)
        starts[off[:-1][off[:-1] < len(cols)]] = True
        if np.any((np.diff(cols) <= 0) & ~starts[1:]):
            raise ValueError("exp_hist_columns must be strictly ascending within each layer")
        cum = np.concatenate(([0], np.cumsum(np.asarray(counts, dtype=np.int64))))
        per_layer = cum[off[1:]] - cum[off[:-1]]
        expected = np.asarray(self.numel, np.int64) - np.asarray(self.nonfinite, np.int64)
        bad = np.flatnonzero(per_layer != expected)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"exp_hist_counts of layer {i} sum to {per_layer[i]}, expected "
                f"numel - nonfinite = {expected[i]}"
            )


class RunFinished(_Wire):
    """A rank's end of run: its last optimiser step and the summaries it could not deliver
    (``dropped``, counted by the producer)."""

    type: Literal["run_finished"] = "run_finished"
    run_id: RunId
    rank: NonNegInt
    world_size: PosInt
    last_step: int = Field(ge=-1)
    steps_recorded: NonNegInt = 0
    dropped: NonNegInt = 0
    end_time: WallTime

    @model_validator(mode="after")
    def _rank(self) -> RunFinished:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        return self


Message = Annotated[RunStarted | StepSummary | RunFinished, Field(discriminator="type")]
_ADAPTER: TypeAdapter[RunStarted | StepSummary | RunFinished] = TypeAdapter(Message)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "message"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {err['msg']}{more}"


def decode_message(raw: bytes | str) -> RunStarted | StepSummary | RunFinished:
    """Parse and validate one wire message.

    Args:
        raw: UTF-8 JSON bytes (or str) of one message, at most ``MAX_MESSAGE_BYTES``.

    Returns:
        The validated RunStarted, StepSummary or RunFinished.

    Raises:
        WireError: oversized, not JSON, unknown ``type``, unknown major schema version,
            or any field invalid; ``reason`` names the field.
    """
    if raw is None:
        raise WireError("empty message (no value)")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(raw)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        return _ADAPTER.validate_json(raw)
    except ValidationError as exc:
        raise WireError(_first_error(exc)) from None


def encode_message(message: RunStarted | StepSummary | RunFinished) -> bytes:
    """Serialise a wire model to compact UTF-8 JSON bytes.

    Raises:
        WireError: the encoded message exceeds ``MAX_MESSAGE_BYTES``.
    """
    data = message.model_dump_json().encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(
            f"encoded {message.type} is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit"
        )
    return data


def is_finite_number(value: object) -> bool:
    """True for an int or a finite float (helper for callers building messages)."""
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def dumps_config(config: dict[str, Any]) -> str:
    """JSON text of a run's free-form config (for storage)."""
    return json.dumps(config, sort_keys=True, default=str)
