"""Versioned, columnar pydantic v2 wire models (JSON on the wire).

A message is one JSON object with a ``type`` discriminator and a ``schema_version``
``"MAJOR.MINOR"``. Consumers accept every minor version of the major version they know
(unknown fields are ignored, so a newer minor version still parses) and reject any other
major version with :class:`WireError`.

Per-layer statistics are columnar: one array per statistic, aligned with ``layer_indices``,
which index the layer list sent in :class:`RunStarted` (model order). The statistics merge
exactly across ranks: sums add, maxima take the maximum,
counts add.

The run-health classes and the vanishing / exploding thresholds follow trustformers-debug's
``gradient_flow`` module.
"""

from __future__ import annotations

import json
import math
import operator
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

# The exponent-histogram layout of the wire (``exp_hist_*`` / ``weight_exp_hist_*``): its
# one definition lives with the statistics that bin it; re-exported here.
from schemas.stats import EXP_HIST_BINS as EXP_HIST_BINS
from schemas.stats import EXP_HIST_MAX as EXP_HIST_MAX
from schemas.stats import EXP_HIST_MIN as EXP_HIST_MIN

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 3
SCHEMA_VERSION = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"
"""1.0: per-layer numel, sum_abs, sum_sq, max_abs, nonfinite. 1.1 adds the optional richer
statistics (exponent histogram, weight and update norms); 1.0 messages still parse (the new
fields default to None) and 1.0 consumers ignore the new fields. 1.2 makes ``sum_abs`` and
``max_abs`` optional together (the producer's "norms" mode sends only ``sum_sq`` and
``nonfinite``) and adds the weight-distribution statistics (power sums, extremes, exponent
histogram of the weights). A 1.2 message in full mode still parses in a 1.1 consumer; a
norms-mode message does not (1.1 requires ``sum_abs``) and goes to its dead-letter topic.
1.3 adds the shard layout of a StepSummary (``shard_index``/``shard_count``: which disjoint
piece of each parameter a rank's statistics cover, so that replicas count once), the
per-rank *local* view (statistics of the rank's own gradient before the reduction) and the
gradient dtype of each layer in RunStarted. A 1.2 consumer ignores them and would count
replicas once per rank."""


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
    """Run health classes (``GradientHealth``), ordered by severity."""

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
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
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
    the per-layer flag thresholds (``vanishing_threshold`` on mean |g|, default 1e-7;
    ``exploding_threshold`` on max |g|, default 1e3; the reference implementation's defaults),
    ``host``, ``start_time`` (unix seconds) and free-form JSON ``config``.
    ``dtypes`` (schema 1.3, optional): each layer's gradient dtype name (``float32``,
    ``bfloat16``, ``float16``, ``float64``, ...), used to tell a gradient that is zero up to
    that dtype's rounding from one that is merely small.
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
    dtypes: list[Annotated[str, Field(min_length=1, max_length=32)]] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> RunStarted:
        if len(self.numel) != len(self.layer_names):
            raise ValueError(
                f"numel has {len(self.numel)} entries but layer_names has "
                f"{len(self.layer_names)}"
            )
        if self.dtypes is not None and len(self.dtypes) != len(self.layer_names):
            raise ValueError(
                f"dtypes has {len(self.dtypes)} entries but layer_names has "
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
    ``sum_abs`` and ``max_abs`` are both present (full mode) or both None (norms mode,
    schema 1.2): the consumer then bounds mean |g| and max |g| by the RMS
    (``consumer.frames``).

    Optional (schema 1.1, off by default in the producer), all exactly mergeable by
    addition across ranks:

    - exponent histogram of the finite elements in sparse CSR form: for layer i, the
      columns ``exp_hist_columns[exp_hist_offsets[i]:exp_hist_offsets[i+1]]`` (ascending,
      in ``[0, EXP_HIST_BINS)``) hold the counts ``exp_hist_counts[...]``; the counts of a
      layer sum to ``numel - nonfinite``;
    - ``weight_sum_sq``: sum of w^2 of the layer's weights (this rank's shard);
    - ``update_sum_sq``: sum of (w_t - w_{t-1})^2, the squared norm of the last update.

    Weight distribution (schema 1.2, sent with ``weight_sum_sq``), over the finite weights
    of this rank's shard; power sums add across ranks, extremes take min / max:
    ``weight_sum`` = sum w, ``weight_sum_cube`` = sum w^3, ``weight_sum_quad`` = sum w^4,
    ``weight_min`` / ``weight_max`` (0 when no finite weight), ``weight_nonfinite`` = count
    of NaN/Inf weights, and the exponent histogram of |w| in the same CSR layout as the
    gradient's (``weight_exp_hist_*``; a layer's counts sum to numel - weight_nonfinite;
    column 0 counts exact zeros).

    Shard layout (schema 1.3, optional, both or neither): the parameter of layer i is cut
    into ``shard_count[i]`` disjoint pieces that together make the whole tensor, and this
    rank's statistics cover piece ``shard_index[i]``. Ranks that send the same
    (layer, shard_index) hold *replicas* of one piece (DDP, the replicate dimension of
    HSDP, a DTensor ``Replicate`` placement): the consumer counts that piece once and checks
    that the replicas agree. Without a layout every rank's piece is its own
    (``shard_index = rank``, ``shard_count = world_size``: disjoint shards, the 1.2 meaning).

    Local view (schema 1.3, optional, all or none): statistics of this rank's *own*
    gradient before the cross-rank reduction (a DDP communication hook, a data-parallel
    rank's local gradient), for ``local_layer_indices`` with the meaning of the main arrays.
    They are stored per rank and never merged into frames.
    """

    type: Literal["step_summary"] = "step_summary"
    run_id: RunId
    step: NonNegInt
    rank: NonNegInt
    world_size: PosInt
    wall_time: WallTime
    layer_indices: list[NonNegInt] = Field(min_length=1)
    numel: list[PosInt]
    sum_abs: list[NonNegFloat] | None = None
    sum_sq: list[NonNegFloat]
    max_abs: list[NonNegFloat] | None = None
    nonfinite: list[NonNegInt]
    exp_hist_offsets: list[NonNegInt] | None = None
    exp_hist_columns: list[Annotated[int, Field(ge=0, lt=EXP_HIST_BINS)]] | None = None
    exp_hist_counts: list[PosInt] | None = None
    weight_sum_sq: list[NonNegFloat] | None = None
    update_sum_sq: list[NonNegFloat] | None = None
    weight_sum: list[FiniteFloat] | None = None
    weight_sum_cube: list[FiniteFloat] | None = None
    weight_sum_quad: list[NonNegFloat] | None = None
    weight_min: list[FiniteFloat] | None = None
    weight_max: list[FiniteFloat] | None = None
    weight_nonfinite: list[NonNegInt] | None = None
    weight_exp_hist_offsets: list[NonNegInt] | None = None
    weight_exp_hist_columns: list[Annotated[int, Field(ge=0, lt=EXP_HIST_BINS)]] | None = None
    weight_exp_hist_counts: list[PosInt] | None = None
    shard_index: list[NonNegInt] | None = None
    shard_count: list[PosInt] | None = None
    local_layer_indices: list[NonNegInt] | None = None
    local_numel: list[PosInt] | None = None
    local_sum_abs: list[NonNegFloat] | None = None
    local_sum_sq: list[NonNegFloat] | None = None
    local_max_abs: list[NonNegFloat] | None = None
    local_nonfinite: list[NonNegInt] | None = None

    @property
    def has_abs(self) -> bool:
        """True when the message carries ``sum_abs`` and ``max_abs`` (full mode)."""
        return self.sum_abs is not None

    @property
    def has_weight_distribution(self) -> bool:
        """True when the message carries the weight-distribution statistics (1.2)."""
        return self.weight_sum is not None

    @property
    def has_local(self) -> bool:
        """True when the message carries the local (pre-reduction) view (1.3)."""
        return self.local_layer_indices is not None

    @model_validator(mode="after")
    def _aligned(self) -> StepSummary:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        if (self.sum_abs is None) != (self.max_abs is None):
            raise ValueError("sum_abs and max_abs go together: send both (full mode) or "
                             "neither (norms mode)")
        n = len(self.layer_indices)
        for name in ("numel", "sum_abs", "sum_sq", "max_abs", "nonfinite"):
            values = getattr(self, name)
            if values is None:
                continue
            got = len(values)
            if got != n:
                raise ValueError(
                    f"{name} has {got} entries but layer_indices has {n}: arrays must be aligned"
                )
        if len(set(self.layer_indices)) != n:
            raise ValueError("layer_indices must be unique within one summary")
        if any(map(operator.gt, self.nonfinite, self.numel)):  # C-level scan, hot path
            i = next(i for i, x in enumerate(self.nonfinite) if x > self.numel[i])
            raise ValueError(
                f"nonfinite[{i}]={self.nonfinite[i]} exceeds numel[{i}]={self.numel[i]}"
            )
        for name in ("weight_sum_sq", "update_sum_sq", *_WEIGHT_DISTRIBUTION):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries but layer_indices has {n}")
        given = [getattr(self, name) is not None for name in _WEIGHT_DISTRIBUTION]
        if any(given) and not (all(given) and self.weight_exp_hist_offsets is not None
                               and self.weight_sum_sq is not None):
            raise ValueError(
                "the weight distribution goes together: weight_sum_sq, "
                + ", ".join(_WEIGHT_DISTRIBUTION) + " and weight_exp_hist_*"
            )
        if any(given) and any(
            lo > hi for lo, hi in zip(self.weight_min, self.weight_max, strict=True)  # type: ignore[arg-type]
        ):
            raise ValueError("weight_min must be <= weight_max for every layer")
        self._check_histogram(
            n, "exp_hist", (self.exp_hist_offsets, self.exp_hist_columns, self.exp_hist_counts),
            self.nonfinite,
        )
        if self.weight_exp_hist_offsets is not None and self.weight_nonfinite is None:
            raise ValueError("weight_exp_hist_* needs the rest of the weight distribution")
        self._check_histogram(
            n, "weight_exp_hist",
            (self.weight_exp_hist_offsets, self.weight_exp_hist_columns,
             self.weight_exp_hist_counts),
            self.weight_nonfinite or [],
        )
        self._check_layout(n)
        self._check_local()
        return self

    def _local_keys(self) -> list[Any]:
        """What makes a local row unique: its layer (one rank per StepSummary)."""
        return list(self.local_layer_indices or ())

    def _check_layout(self, n: int) -> None:
        if self.shard_index is None and self.shard_count is None:
            return
        if self.shard_index is None or self.shard_count is None:
            raise ValueError("shard_index and shard_count go together")
        if len(self.shard_index) != n or len(self.shard_count) != n:
            raise ValueError(
                f"shard_index and shard_count must have {n} entries, one per layer_indices"
            )
        index = np.asarray(self.shard_index, np.int64)
        count = np.asarray(self.shard_count, np.int64)
        bad = np.flatnonzero((index >= count) | (count > self.world_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"shard_index[{i}]={index[i]} must be < shard_count[{i}]={count[i]} "
                f"<= world_size {self.world_size}"
            )

    def _check_local(self) -> None:
        given = [getattr(self, name) is not None for name in _LOCAL_VIEW]
        if not any(given):
            return
        if not all(given):
            raise ValueError("the local view goes together: " + ", ".join(_LOCAL_VIEW))
        m = len(self.local_layer_indices or ())
        for name in _LOCAL_VIEW[1:]:
            if len(getattr(self, name)) != m:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries but local_layer_indices "
                    f"has {m}"
                )
        if m == 0:
            raise ValueError("local_layer_indices must not be empty when given")
        if len(set(self._local_keys())) != m:
            raise ValueError("local_layer_indices must be unique within one summary (per rank)")
        if np.any(np.asarray(self.local_nonfinite) > np.asarray(self.local_numel)):
            raise ValueError("local_nonfinite exceeds local_numel for some layer")

    def _check_histogram(
        self, n: int, prefix: str, parts: tuple[list[int] | None, ...], nonfinite: list[int],
    ) -> None:
        if all(p is None for p in parts):
            return
        offsets, columns, counts = parts
        if offsets is None or columns is None or counts is None:
            raise ValueError(
                f"{prefix}_offsets, {prefix}_columns and {prefix}_counts go together"
            )
        if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(columns):
            raise ValueError(
                f"{prefix}_offsets must have {n + 1} entries from 0 to len({prefix}_columns)"
            )
        if len(counts) != len(columns):
            raise ValueError(f"{prefix}_counts and {prefix}_columns must have equal lengths")
        off = np.asarray(offsets, dtype=np.int64)
        if np.any(np.diff(off) < 0):
            raise ValueError(f"{prefix}_offsets must be non-decreasing")
        cols = np.asarray(columns, dtype=np.int64)
        starts = np.zeros(len(cols), dtype=bool)
        starts[off[:-1][off[:-1] < len(cols)]] = True
        if np.any((np.diff(cols) <= 0) & ~starts[1:]):
            raise ValueError(f"{prefix}_columns must be strictly ascending within each layer")
        cum = np.concatenate(([0], np.cumsum(np.asarray(counts, dtype=np.int64))))
        per_layer = cum[off[1:]] - cum[off[:-1]]
        expected = np.asarray(self.numel, np.int64) - np.asarray(nonfinite, np.int64)
        bad = np.flatnonzero(per_layer != expected)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{prefix}_counts of layer {i} sum to {per_layer[i]}, expected "
                f"numel - nonfinite = {expected[i]}"
            )


_WEIGHT_DISTRIBUTION = (
    "weight_sum", "weight_sum_cube", "weight_sum_quad", "weight_min", "weight_max",
    "weight_nonfinite",
)
_LOCAL_VIEW = (
    "local_layer_indices", "local_numel", "local_sum_abs", "local_sum_sq", "local_max_abs",
    "local_nonfinite",
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


class MergedFrame(StepSummary):
    """A finished frame in scale-out mode: the merged sums of every rank of one (run, step),
    published by a worker to the frames topic and stored by ``gradstream store``.

    The per-layer arrays have the meaning of :class:`StepSummary`'s, summed (maxima: max)
    over the ranks in ``ranks_seen``; ``rank`` is the smallest of them. An optional
    statistic is sent only when every rank of every layer carried it. Frames merge like
    shards when their rank sets are disjoint (a late rank), which is what the store does;
    each piece of a replicated parameter is already counted once (no shard layout here).
    The local view, when present, holds the local rows of every rank merged in this
    version of the frame, ``local_ranks`` naming each row's rank.
    """

    type: Literal["merged_frame"] = "merged_frame"  # type: ignore[assignment]
    ranks_seen: list[NonNegInt] = Field(min_length=1)
    local_ranks: list[NonNegInt] | None = None

    def _local_keys(self) -> list[Any]:
        return list(zip(self.local_ranks or (), self.local_layer_indices or (), strict=False))

    def _check_local(self) -> None:
        if (self.local_ranks is None) != (self.local_layer_indices is None):
            raise ValueError("local_ranks goes with the local view")
        if self.local_ranks is not None and len(self.local_ranks) != len(
            self.local_layer_indices or ()
        ):
            raise ValueError("local_ranks must be aligned with local_layer_indices")
        super()._check_local()

    @model_validator(mode="after")
    def _ranks(self) -> MergedFrame:
        if sorted(set(self.ranks_seen)) != self.ranks_seen:
            raise ValueError("ranks_seen must be strictly ascending")
        if self.ranks_seen[-1] >= self.world_size:
            raise ValueError(f"ranks_seen reach {self.ranks_seen[-1]} >= world_size")
        if self.rank != self.ranks_seen[0]:
            raise ValueError("rank must be the smallest of ranks_seen")
        return self


Message = Annotated[RunStarted | StepSummary | RunFinished, Field(discriminator="type")]
_ADAPTER: TypeAdapter[RunStarted | StepSummary | RunFinished] = TypeAdapter(Message)
FrameTopicMessage = Annotated[
    RunStarted | MergedFrame | RunFinished, Field(discriminator="type")
]
_FRAME_ADAPTER: TypeAdapter[RunStarted | MergedFrame | RunFinished] = TypeAdapter(
    FrameTopicMessage
)


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


def decode_frame_message(raw: bytes | str) -> RunStarted | MergedFrame | RunFinished:
    """Parse and validate one message of the frames topic (scale-out mode).

    Raises:
        WireError: as :func:`decode_message`.
    """
    if raw is None:
        raise WireError("empty message (no value)")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(raw)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        return _FRAME_ADAPTER.validate_json(raw)
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
