"""Versioned, columnar pydantic v2 wire models, as JSON or as typed binary buffers.

A message is one JSON object with a ``type`` discriminator and a ``schema_version``
``"MAJOR.MINOR"``, or, for StepSummary and MergedFrame, the same fields in the columnar
binary form (:func:`encode_binary`: the per-layer arrays as little-endian int64 / float64
buffers in a safetensors container behind a 4-byte prefix ``BINARY_MAGIC`` + layout byte).
The first byte tells the two apart (JSON never starts with NUL); a binary message of an
unknown layout is refused with a :class:`WireError` ("unknown wire encoding"). Both are
validated against the same pydantic models: binary arrays by vectorised NumPy checks of
each field's element rule and the models' own cross-field validators, never per element in
Python. Consumers accept every minor version of the major version they know
(unknown fields are ignored, so a newer minor version still parses) and reject any other
major version with :class:`WireError` (:class:`schemas.versioned.VersionedMessage`).

The container is read and written here (:func:`read_binary_container`) rather than
through the ``safetensors`` library, which measured slower on the decode path
(``bench/wire_codec.py``); the library reads every container :func:`encode_binary` writes.

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
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import (
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_core import from_json

from schemas.scalars import RankScalars, ScalarName

# The exponent-histogram layout of the wire (``exp_hist_*`` / ``weight_exp_hist_*``): its
# one definition lives with the statistics that bin it; re-exported here.
from schemas.stats import EXP_HIST_BINS as EXP_HIST_BINS
from schemas.stats import EXP_HIST_MAX as EXP_HIST_MAX
from schemas.stats import EXP_HIST_MIN as EXP_HIST_MIN
from schemas.versioned import VersionedMessage

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 12
SCHEMA_VERSION = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"
"""The version this build writes. What each minor version carries (a consumer of an older
minor version ignores the fields it does not know):

=====  ================================================================================
1.0    per-layer ``numel``, ``sum_abs``, ``sum_sq``, ``max_abs``, ``nonfinite``
1.1    the optional exponent histogram (``exp_hist_*``), ``weight_sum_sq``,
       ``update_sum_sq``
1.2    ``sum_abs`` / ``max_abs`` optional together (norms mode; a 1.1 consumer
       dead-letters such a message); the weight distribution (``weight_*``)
1.3    the shard layout (``shard_index``/``shard_count``), the local view (``local_*``),
       RunStarted ``dtypes``
1.4    the parts of a StepSummary (``part_index``/``part_count``)
1.5    RunStarted ``ignore_layers``
1.6    ``sum_abs`` / ``sum_sq`` (and their local views) may be +inf, a float64 sum that
       overflowed (JSON ``Infinity``; a 1.5 consumer dead-letters such a message)
1.7    the NaN count ``nan`` of a StepSummary / MergedFrame
1.8    MergedFrame ``layout_violations`` and ``refused_ranks``
1.9    a StepSummary reduced in-band over several ranks (``reduced_ranks``) and the
       replica disagreements its cross-check found (``replica_divergence``)
1.10   the flight recorder's message :class:`LocalSummary` (type ``local_summary``, JSON):
       one rank's local view of one step, sent when a local trigger fired (a 1.9
       consumer dead-letters it as an unknown type)
1.11   MergedFrame ``replica_divergence`` (without ``reduced_ranks``) and
       ``nonfinite_pieces``: what only a worker sees, for the store writer's alert rules
1.12   training scalars (``schemas.scalars``) of a StepSummary / MergedFrame: the step
       scalars ``scalars`` (name -> value: learning rates, loss scale) and the per-rank
       ones in long form, ``rank_scalar_names`` with the aligned arrays
       ``rank_scalar_ranks`` / ``rank_scalar_index`` / ``rank_scalar_values`` (loss,
       step and compute time, tokens), NaN and +-Inf allowed
=====  ================================================================================
"""


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
SumFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=True)]
"""A sum of magnitudes: >= 0, +inf allowed (a float64 sum that overflowed), NaN refused."""
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(gt=0)]
RunId = Annotated[str, Field(min_length=1, max_length=MAX_RUN_ID_LENGTH)]
WallTime = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class _Wire(VersionedMessage):
    """Common base of the wire messages (:class:`schemas.versioned.VersionedMessage`);
    non-finite floats serialise as JSON constants."""

    model_config = ConfigDict(ser_json_inf_nan="constants")
    schema_major: ClassVar[int] = SCHEMA_MAJOR

    schema_version: str = SCHEMA_VERSION


class RunStarted(_Wire):
    """Announces a run and its layer list. Every rank sends one before its first step.

    Fields: ``layer_names`` in model order (index i is layer i everywhere else),
    ``numel`` elements per layer (full tensor, all ranks together), ``world_size`` ranks,
    the per-layer flag thresholds (``vanishing_threshold`` on mean |g|, default 1e-7;
    ``exploding_threshold`` on max |g|, default 1e3; the reference's defaults, trustformers-debug),
    ``host``, ``start_time`` (unix seconds) and free-form JSON ``config``.
    ``dtypes`` (schema 1.3, optional): each layer's gradient dtype name (``float32``,
    ``bfloat16``, ``float16``, ``float64``, ...), used to tell a gradient that is zero up to
    that dtype's rounding from one that is merely small.
    ``ignore_layers`` (schema 1.5, optional): shell-style patterns
    (:func:`schemas.health.match_layers`) of layers the run excludes from its health, issue
    frames and vanishing / exploding alerts, by an explicit setting
    (``start_run(..., ignore_layers=...)`` or an adapter that knows the model's structure);
    recorded with the run and named in its report. Empty = every layer counts.
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
    ignore_layers: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list, max_length=1024)

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
    ``sum_sq`` = sum g^2 over the finite elements (float64, >= 0; +inf when the float64
    sum overflowed, as the reference's (trustformers-debug) f64 sums do: squares of elements
    above ~1.34e154; schema 1.6), ``max_abs`` = max |g|
    over the finite elements (0 when none), ``nonfinite`` = count of NaN/+-Inf elements,
    ``nan`` (optional, schema 1.7) = how many of those are NaN (``nonfinite - nan`` are
    +-Inf). Without it a layer with ``nonfinite = 0`` has no NaN either and the split of
    the others is unknown; the producer sends it only when some
    layer has a non-finite element, so the all-finite common case costs no byte.
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

    Parts (schema 1.4, optional, both or neither): a summary too large for one Kafka
    message is sent as ``part_count`` messages, part ``part_index`` holding a disjoint
    range of the layers (and the local rows of those layers); the consumer counts the
    rank as reported once all its parts arrived.

    Reduced in-band (schema 1.9, optional): ``reduced_ranks`` holds rank ranges as
    flattened ``[start, stop)`` pairs (ascending, disjoint, within ``world_size``, the
    sending ``rank`` among them). The statistics are those of the whole parameters, already
    reduced across every listed rank by a collective inside training (shards added, each
    replica counted once, ``producer.adapters.torch_reduce``): the message counts as the
    report of every listed rank. ``replica_divergence`` (only with ``reduced_ranks``) holds
    rows ``(layer_index, rank, reference_rank)`` flattened, three integers a row: the
    replicas of a layer that the in-band cross-check found to disagree (``rank`` computed
    the checked copy, ``reference_rank`` the counted one).

    Local view (schema 1.3, optional, all or none): statistics of this rank's *own*
    gradient before the cross-rank reduction (a DDP communication hook, a data-parallel
    rank's local gradient), for ``local_layer_indices`` with the meaning of the main arrays.
    They are stored per rank and never merged into frames.

    Training scalars (schema 1.12, optional; ``schemas.scalars``): ``scalars`` maps a step
    scalar's name to its value (learning rates, AMP loss scale, user names), and the
    per-rank ones (loss, step and compute time, tokens, samples) travel as
    ``rank_scalar_names`` (metadata) with ``rank_scalar_values``, for ranks this message
    reports for (its ``rank``, or those of ``reduced_ranks``; a MergedFrame's
    ``ranks_seen``): in long form the aligned ``rank_scalar_ranks`` and
    ``rank_scalar_index`` (into the names) give each value's (rank, name); without them the
    form is dense, every reported rank having every name, ``rank_scalar_values`` holding
    ranks x names values row-major in ascending rank order. Values may be NaN or +-Inf.

    Holding the arrays. A message validated from JSON or built in Python holds each array
    field as a list; one decoded from the binary form holds it as the decoded buffer
    itself, a read-only NumPy array (int64 or float64, checked by the same element rules
    in NumPy), so that a consumer reads it with ``np.asarray`` without a copy and nothing
    is converted element by element. Read array fields through ``np.asarray`` (or ``len``,
    indexing, slicing), never with list-only operations (``x or ()``, ``==`` against a
    list); message equality compares the values either way.
    """

    type: Literal["step_summary"] = "step_summary"
    run_id: RunId
    step: NonNegInt
    rank: NonNegInt
    world_size: PosInt
    wall_time: WallTime
    layer_indices: list[NonNegInt] = Field(min_length=1)
    numel: list[PosInt]
    sum_abs: list[SumFloat] | None = None
    sum_sq: list[SumFloat]
    max_abs: list[NonNegFloat] | None = None
    nonfinite: list[NonNegInt]
    nan: list[NonNegInt] | None = None
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
    local_sum_abs: list[SumFloat] | None = None
    local_sum_sq: list[SumFloat] | None = None
    local_max_abs: list[NonNegFloat] | None = None
    local_nonfinite: list[NonNegInt] | None = None
    part_index: NonNegInt | None = None
    part_count: PosInt | None = None
    reduced_ranks: list[NonNegInt] | None = None
    replica_divergence: list[NonNegInt] | None = None
    scalars: dict[ScalarName, float] | None = None
    rank_scalar_names: list[ScalarName] | None = None
    rank_scalar_ranks: list[NonNegInt] | None = None
    rank_scalar_index: list[NonNegInt] | None = None
    rank_scalar_values: list[float] | None = None

    def _np(self, name: str) -> np.ndarray:
        """Field ``name`` as an int64 / float64 array: the decoded buffer itself for a
        binary message (no copy), else converted from the list."""
        kind = _ARRAY_FIELDS[name]
        return np.asarray(getattr(self, name), np.float64 if kind in _FLOAT_KINDS else np.int64)

    def __eq__(self, other: object) -> bool:
        """Field-wise equality in which an array field held as a list (JSON, or built in
        Python) equals one held as a NumPy array (binary) with the same values."""
        if type(other) is not type(self):
            return NotImplemented
        for name in type(self).model_fields:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name in _ARRAY_FIELDS and mine is not None and theirs is not None:
                if len(mine) != len(theirs) or not np.array_equal(self._np(name),
                                                                  other._np(name)):
                    return False
            elif mine != theirs:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # array fields are not hashable

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
        for name in ("numel", "sum_abs", "sum_sq", "max_abs", "nonfinite", "nan"):
            values = getattr(self, name)
            if values is None:
                continue
            got = len(values)
            if got != n:
                raise ValueError(
                    f"{name} has {got} entries but layer_indices has {n}: arrays must be aligned"
                )
        if not _unique(self._np("layer_indices")):
            raise ValueError("layer_indices must be unique within one summary")
        nonfinite, numel = self._np("nonfinite"), self._np("numel")
        if np.count_nonzero(nonfinite > numel):  # (the cheapest test of a bool array)
            i = int(np.flatnonzero(nonfinite > numel)[0])
            raise ValueError(
                f"nonfinite[{i}]={self.nonfinite[i]} exceeds numel[{i}]={self.numel[i]}"
            )
        if self.nan is not None:
            over = np.flatnonzero(self._np("nan") > nonfinite)
            if over.size:
                i = int(over[0])
                raise ValueError(
                    f"nan[{i}]={self.nan[i]} exceeds nonfinite[{i}]={self.nonfinite[i]} "
                    "(the NaN elements are some of the non-finite ones)"
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
        if any(given) and np.any(self._np("weight_min") > self._np("weight_max")):
            raise ValueError("weight_min must be <= weight_max for every layer")
        self._check_histogram(n, "exp_hist", "nonfinite")
        if self.weight_exp_hist_offsets is not None and self.weight_nonfinite is None:
            raise ValueError("weight_exp_hist_* needs the rest of the weight distribution")
        self._check_histogram(n, "weight_exp_hist", "weight_nonfinite")
        self._check_layout(n)
        self._check_local()
        self._check_reduced()
        self._check_scalars()
        if (self.part_index is None) != (self.part_count is None):
            raise ValueError("part_index and part_count go together")
        if self.part_index is not None and self.part_index >= self.part_count:  # type: ignore[operator]
            raise ValueError(
                f"part_index {self.part_index} must be < part_count {self.part_count}"
            )
        return self

    def _local_unique(self) -> bool:
        """Whether the local rows are unique by their key: the layer (one rank per
        StepSummary)."""
        return _unique(self._np("local_layer_indices"))

    def _check_layout(self, n: int) -> None:
        if self.shard_index is None and self.shard_count is None:
            return
        if self.shard_index is None or self.shard_count is None:
            raise ValueError("shard_index and shard_count go together")
        if len(self.shard_index) != n or len(self.shard_count) != n:
            raise ValueError(
                f"shard_index and shard_count must have {n} entries, one per layer_indices"
            )
        index = self._np("shard_index")
        count = self._np("shard_count")
        # two reductions on the valid path (the ufuncs, no wrappers); the entry named below
        if (not np.count_nonzero(index >= count)
                and int(np.maximum.reduce(count, initial=0)) <= self.world_size):
            return
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
        m = len(self._np("local_layer_indices"))
        for name in _LOCAL_VIEW[1:]:
            if len(getattr(self, name)) != m:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries but local_layer_indices "
                    f"has {m}"
                )
        if m == 0:
            raise ValueError("local_layer_indices must not be empty when given")
        if not self._local_unique():
            raise ValueError("local_layer_indices must be unique within one summary (per rank)")
        if np.any(self._np("local_nonfinite") > self._np("local_numel")):
            raise ValueError("local_nonfinite exceeds local_numel for some layer")

    def _check_reduced(self) -> None:
        if self.reduced_ranks is None:
            if self.replica_divergence is not None:
                raise ValueError("replica_divergence goes with reduced_ranks")
            return
        ranges = self._np("reduced_ranks")
        if ranges.size == 0 or ranges.size % 2:
            raise ValueError("reduced_ranks must hold [start, stop) pairs, at least one")
        flat_ok = (bool((ranges[1::2] > ranges[::2]).all())
                   and bool((ranges[2::2] >= ranges[1:-1:2]).all()))
        if not flat_ok or int(ranges[-1]) > self.world_size:
            raise ValueError(
                f"reduced_ranks must be ascending, disjoint [start, stop) pairs within "
                f"world_size {self.world_size}"
            )
        if not bool(((ranges[::2] <= self.rank) & (self.rank < ranges[1::2])).any()):
            raise ValueError(f"the sending rank {self.rank} must be among reduced_ranks")
        if self.replica_divergence is not None:
            rows = self._np("replica_divergence")
            if rows.size % 3:
                raise ValueError("replica_divergence must hold 3 integers a row")
            ranks = rows.reshape(-1, 3)[:, 1:]
            if ranks.size and int(ranks.max()) >= self.world_size:
                raise ValueError("replica_divergence names a rank >= world_size")

    def _check_scalars(self) -> None:
        given = [getattr(self, name) is not None for name in _RANK_SCALAR_FIELDS]
        if not any(given):
            return
        if self.rank_scalar_names is None or self.rank_scalar_values is None:
            raise ValueError("rank_scalar_names and rank_scalar_values go together")
        if (self.rank_scalar_ranks is None) != (self.rank_scalar_index is None):
            raise ValueError("rank_scalar_ranks and rank_scalar_index go together")
        names = self.rank_scalar_names
        if self.rank_scalar_ranks is None:  # dense: one value per (reported rank, name)
            expected = len(names) * len(self._scalar_ranks())
            if len(self.rank_scalar_values) != expected or len(set(names)) != len(names):
                raise ValueError(
                    f"rank_scalar_*: dense rank scalars need {len(self._scalar_ranks())} x "
                    f"{len(names)} values of unique names, got {len(self.rank_scalar_values)}")
            return
        try:
            rows = self.rank_scalar_rows()
            assert rows is not None
            rows.check()
        except ValueError as exc:
            raise ValueError(f"rank_scalar_*: {exc}") from None
        if len(rows) and not np.isin(rows.rank, self._scalar_ranks()).all():
            raise ValueError("rank_scalar_ranks must be ranks this message reports for")

    def _scalar_ranks(self) -> np.ndarray:
        """The ranks whose scalars this message may carry: those it reports for."""
        if self.reduced_ranks is None:
            return np.array([self.rank], np.int64)
        return np.asarray(self.reporting_ranks(), np.int64)

    def rank_scalar_rows(self) -> RankScalars | None:
        """The per-rank scalars as :class:`schemas.scalars.RankScalars` (long rows, from
        either form), or None.

        Raises:
            ValueError: a dense form of another length than ranks x names.
        """
        if self.rank_scalar_names is None:
            return None
        values = self._np("rank_scalar_values")
        if self.rank_scalar_ranks is None:  # dense: every rank this message reports for
            return RankScalars.from_dense(self.rank_scalar_names, self._scalar_ranks(), values)
        return RankScalars(tuple(self.rank_scalar_names), self._np("rank_scalar_ranks"),
                           self._np("rank_scalar_index"), values)

    def reporting_ranks(self) -> list[int]:
        """The ranks this summary reports for: its ``rank``, or every rank of
        ``reduced_ranks`` (ascending)."""
        if self.reduced_ranks is None:
            return [self.rank]
        return ranges_to_ranks(self._np("reduced_ranks")).tolist()

    def _check_histogram(self, n: int, prefix: str, nonfinite_field: str) -> None:
        offsets = getattr(self, prefix + "_offsets")
        columns = getattr(self, prefix + "_columns")
        counts = getattr(self, prefix + "_counts")
        if offsets is None and columns is None and counts is None:
            return
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
        off = self._np(f"{prefix}_offsets")
        if np.any(np.diff(off) < 0):
            raise ValueError(f"{prefix}_offsets must be non-decreasing")
        cols = self._np(f"{prefix}_columns")
        starts = np.zeros(len(cols), dtype=bool)
        starts[off[:-1][off[:-1] < len(cols)]] = True
        if np.any((np.diff(cols) <= 0) & ~starts[1:]):
            raise ValueError(f"{prefix}_columns must be strictly ascending within each layer")
        cum = np.concatenate(([0], np.cumsum(self._np(f"{prefix}_counts"))))
        per_layer = cum[off[1:]] - cum[off[:-1]]
        expected = self._np("numel") - self._np(nonfinite_field)
        bad = np.flatnonzero(per_layer != expected)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{prefix}_counts of layer {i} sum to {per_layer[i]}, expected "
                f"numel - nonfinite = {expected[i]}"
            )


def _unique(values: np.ndarray) -> bool:
    """Whether the int64[k] ``values`` are pairwise distinct (O(k) when ascending)."""
    if values.size < 2:
        return True
    if not np.count_nonzero(values[1:] <= values[:-1]):  # ascending: one pass
        return True
    return bool((np.diff(np.sort(values)) != 0).all())


_WEIGHT_DISTRIBUTION = (
    "weight_sum", "weight_sum_cube", "weight_sum_quad", "weight_min", "weight_max",
    "weight_nonfinite",
)
def ranges_to_ranks(ranges: np.ndarray) -> np.ndarray:
    """The ranks of flattened ``[start, stop)`` pairs (``StepSummary.reduced_ranks``), as
    int64, ascending when the pairs are.

    >>> ranges_to_ranks(np.array([0, 2, 5, 7])).tolist()
    [0, 1, 5, 6]
    """
    pairs = np.asarray(ranges, np.int64).reshape(-1, 2)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in pairs.tolist()])


def rank_scalar_fields(rows: RankScalars, ranks: np.ndarray) -> dict[str, Any]:
    """The ``rank_scalar_*`` field values of a StepSummary / MergedFrame carrying ``rows``
    for the message's ``ranks`` (int64, ascending): the dense form when every rank has every
    name (8 bytes a value instead of 24), else the long form.

    Raises:
        ValueError: ``rows`` name a rank outside ``ranks`` (a bug upstream; the message's
            validation would refuse it).
    """
    dense = rows.dense(ranks)
    if dense is not None:
        return {"rank_scalar_names": list(rows.names), "rank_scalar_values": dense.tolist()}
    if len(rows) and not np.isin(rows.rank, ranks).all():
        raise ValueError("rank scalars of ranks the message does not report for")
    return {"rank_scalar_names": list(rows.names), "rank_scalar_ranks": rows.rank.tolist(),
            "rank_scalar_index": rows.name_index.tolist(),
            "rank_scalar_values": rows.value.tolist()}


_RANK_SCALAR_FIELDS = (
    "rank_scalar_names", "rank_scalar_ranks", "rank_scalar_index", "rank_scalar_values",
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


LocalTrigger = Literal["nonfinite", "exploding", "norm_spike", "sample", "every_step"]
"""Why a rank sent its local view: its flight recorder (``producer.flight_recorder``) fired
``nonfinite`` (a NaN/Inf element in some layer), ``exploding`` (some layer's max |g| above
the run's exploding threshold), ``norm_spike`` (the local total norm above ``spike_factor``
times the median of the rank's previous norms) or ``sample`` (the sparse baseline, every
``local_view_sample_every`` steps), the first of this order when several fire at once; or
``every_step``: the producer sends every step's local view (``local_view="every_step"``)
and this rank's came alone (``GradientProducer.record_local``), not inside a StepSummary."""


class LocalSummary(_Wire):
    """One rank's local view of one optimiser step, sent by its flight recorder (schema
    1.10; ``producer.flight_recorder``): the statistics of the rank's *own* gradient
    before the cross-rank reduction, with the meaning and the validation rules of
    :class:`StepSummary`'s local view (``local_*``: aligned arrays, at least one layer,
    layer indices unique, ``local_nonfinite <= local_numel``; sums >= 0 and +inf allowed,
    max finite and >= 0).

    A rank keeps its last K local views in a ring buffer and sends them when a local
    trigger fires on the newest one: each entry of that dump is one message, carrying the
    ``trigger`` that fired and ``trigger_step``, the step at which it fired (>= ``step``;
    equal for the entry that fired). ``wall_time`` is the unix time (s) the entry was
    recorded. Stored per rank in ``local_layer_stats`` (never merged into frames). Always
    JSON: the messages are rare.
    """

    type: Literal["local_summary"] = "local_summary"
    run_id: RunId
    step: NonNegInt
    rank: NonNegInt
    world_size: PosInt
    wall_time: WallTime
    trigger: LocalTrigger
    trigger_step: NonNegInt
    local_layer_indices: list[NonNegInt] = Field(min_length=1)
    local_numel: list[PosInt]
    local_sum_abs: list[SumFloat]
    local_sum_sq: list[SumFloat]
    local_max_abs: list[NonNegFloat]
    local_nonfinite: list[NonNegInt]

    @model_validator(mode="after")
    def _aligned(self) -> LocalSummary:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        if self.trigger_step < self.step:
            raise ValueError(f"trigger_step {self.trigger_step} must be >= step {self.step}")
        m = len(self.local_layer_indices)
        for name in _LOCAL_VIEW[1:]:
            if len(getattr(self, name)) != m:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries but "
                                 f"local_layer_indices has {m}")
        if not _unique(np.asarray(self.local_layer_indices, np.int64)):
            raise ValueError("local_layer_indices must be unique within one summary")
        if np.any(np.asarray(self.local_nonfinite, np.int64)
                  > np.asarray(self.local_numel, np.int64)):
            raise ValueError("local_nonfinite exceeds local_numel for some layer")
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
    layout_violations: list[NonNegInt] | None = None
    """Schema 1.8: the worker's layout-violation rows of pieces it did not count (a replica
    of another numel, a rank cutting a layer into another number of pieces), flattened
    row-major, 5 integers a row: (layer_index, kind, rank, got, expected); kinds
    ``consumer.merge.VIOLATION_REPLICA_NUMEL`` / ``VIOLATION_SHARD_COUNT``. The merged sums
    cannot show them (the misfit piece was left out), so the store stores a frame carrying
    any as partial. None (older workers) or empty: none known."""
    refused_ranks: list[NonNegInt] | None = None
    """Schema 1.8: missing ranks (ascending, not in ``ranks_seen``) whose data for this
    step the worker refused (their RunStarted was refused, or their summary of the step was
    dead-lettered), as opposed to ranks that sent nothing."""
    nonfinite_pieces: list[NonNegInt] | None = None
    """Schema 1.11: rows (rank, layer_index), flattened, 2 integers a row: the ranks whose
    own summaries of this step held NaN/Inf in that layer (per-rank sending; a summary
    reduced in-band names none), so that the store writer's ``nonfinite`` alert names them.
    ``replica_divergence`` (schema 1.11 on a MergedFrame, any frame) carries the frame's
    disagreeing replicas (layer_index, rank, reference_rank) for the ``replica_divergence``
    alert."""

    def _check_reduced(self) -> None:
        if self.reduced_ranks is not None:
            super()._check_reduced()
            return
        if self.replica_divergence is not None:
            rows = self._np("replica_divergence")
            if rows.size % 3:
                raise ValueError("replica_divergence must hold 3 integers a row")
            if rows.size and int(rows.reshape(-1, 3)[:, 1:].max()) >= self.world_size:
                raise ValueError("replica_divergence names a rank >= world_size")
        if self.nonfinite_pieces is not None:
            rows = self._np("nonfinite_pieces")
            if rows.size % 2:
                raise ValueError("nonfinite_pieces must hold 2 integers a row")
            if rows.size and int(rows[::2].max()) >= self.world_size:
                raise ValueError("nonfinite_pieces names a rank >= world_size")

    def _scalar_ranks(self) -> np.ndarray:
        return self._np("ranks_seen")

    def _local_unique(self) -> bool:
        ranks, layers = self._np("local_ranks"), self._np("local_layer_indices")
        return _unique(ranks * (int(layers.max(initial=0)) + 1) + layers)

    def _check_local(self) -> None:
        if (self.local_ranks is None) != (self.local_layer_indices is None):
            raise ValueError("local_ranks goes with the local view")
        if self.local_ranks is not None and len(self.local_ranks) != len(
            () if self.local_layer_indices is None else self.local_layer_indices
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
        if self.layout_violations is not None and len(self.layout_violations) % 5:
            raise ValueError("layout_violations must hold 5 integers a row")
        if self.refused_ranks is not None and len(self.refused_ranks):
            refused = self._np("refused_ranks")
            if (np.diff(refused) <= 0).any() or refused[-1] >= self.world_size:
                raise ValueError("refused_ranks must be strictly ascending and < world_size")
            if np.isin(refused, self._np("ranks_seen")).any():
                raise ValueError("refused_ranks must not be in ranks_seen")
        return self


Message = Annotated[RunStarted | StepSummary | RunFinished | LocalSummary,
                    Field(discriminator="type")]
_ADAPTER: TypeAdapter[RunStarted | StepSummary | RunFinished | LocalSummary] = TypeAdapter(
    Message)
FrameTopicMessage = Annotated[
    RunStarted | MergedFrame | RunFinished | LocalSummary, Field(discriminator="type")
]
_FRAME_ADAPTER: TypeAdapter[RunStarted | MergedFrame | RunFinished | LocalSummary] = TypeAdapter(
    FrameTopicMessage
)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "message"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {err['msg']}{more}"


WireFormat = Literal["json", "binary"]
"""How a message is encoded: ``"json"`` (UTF-8 JSON object) or ``"binary"`` (columnar,
see :func:`encode_binary`)."""

BINARY_MAGIC = b"\x00GS"
"""First three bytes of a binary message. A JSON text never starts with NUL, so the first
byte tells the encodings apart; the fourth byte names the binary layout."""

BINARY_LAYOUT_SAFETENSORS = b"T"
"""The one binary layout this build reads and writes: the safetensors container."""

_ST_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
}
_NONNEG_FLOAT, _FINITE_FLOAT, _NONNEG_INT, _POS_INT, _HIST_COL, _SUM_FLOAT, _ANY_FLOAT = range(7)
_FLOAT_KINDS = (_NONNEG_FLOAT, _FINITE_FLOAT, _SUM_FLOAT, _ANY_FLOAT)

_ARRAY_FIELDS: dict[str, int] = {
    "layer_indices": _NONNEG_INT, "numel": _POS_INT, "sum_abs": _SUM_FLOAT,
    "sum_sq": _SUM_FLOAT, "max_abs": _NONNEG_FLOAT, "nonfinite": _NONNEG_INT,
    "nan": _NONNEG_INT,
    "exp_hist_offsets": _NONNEG_INT, "exp_hist_columns": _HIST_COL, "exp_hist_counts": _POS_INT,
    "weight_sum_sq": _NONNEG_FLOAT, "update_sum_sq": _NONNEG_FLOAT,
    "weight_sum": _FINITE_FLOAT, "weight_sum_cube": _FINITE_FLOAT,
    "weight_sum_quad": _NONNEG_FLOAT, "weight_min": _FINITE_FLOAT, "weight_max": _FINITE_FLOAT,
    "weight_nonfinite": _NONNEG_INT, "weight_exp_hist_offsets": _NONNEG_INT,
    "weight_exp_hist_columns": _HIST_COL, "weight_exp_hist_counts": _POS_INT,
    "shard_index": _NONNEG_INT, "shard_count": _POS_INT,
    "local_layer_indices": _NONNEG_INT, "local_numel": _POS_INT,
    "local_sum_abs": _SUM_FLOAT, "local_sum_sq": _SUM_FLOAT,
    "local_max_abs": _NONNEG_FLOAT, "local_nonfinite": _NONNEG_INT,
    "ranks_seen": _NONNEG_INT, "local_ranks": _NONNEG_INT,
    "layout_violations": _NONNEG_INT, "refused_ranks": _NONNEG_INT,
    "reduced_ranks": _NONNEG_INT, "replica_divergence": _NONNEG_INT,
    "nonfinite_pieces": _NONNEG_INT,
    "rank_scalar_ranks": _NONNEG_INT, "rank_scalar_index": _NONNEG_INT,
    "rank_scalar_values": _ANY_FLOAT,
}
"""Every list field of StepSummary / MergedFrame and the element rule its pydantic type
states (finite and >= 0, finite, int >= 0, int > 0, histogram column in [0, BINS), any
float: NaN and +-Inf allowed)."""

_NON_EMPTY = frozenset({"layer_indices", "ranks_seen"})

_LIST_FIELDS = frozenset({"ranks_seen"})
"""Array fields a binary decode still hands over as a Python list (a few ranks, used as
a set), where every other array field is a read-only NumPy array."""


def _scalar_model(model: type[_Wire]) -> type[_Wire]:
    """A pydantic model with ``model``'s non-array fields (same types and constraints)."""
    from pydantic import create_model

    fields: dict[str, Any] = {
        name: (info.annotation, info) for name, info in model.model_fields.items()
        if name not in _ARRAY_FIELDS and name != "schema_version"
    }
    return create_model(f"{model.__name__}Scalars", __base__=_Wire, **fields)


_BINARY_MODELS: dict[str, tuple[type[StepSummary], type[_Wire], tuple[str, ...],
                                 tuple[tuple[str, int, bool], ...]]] = {
    m.model_fields["type"].default: (
        m, _scalar_model(m), tuple(
            name for name, dec in m.__pydantic_decorators__.model_validators.items()
            if dec.info.mode == "after"
        ),
        tuple((name, _ARRAY_FIELDS[name], info.is_required())
              for name, info in m.model_fields.items() if name in _ARRAY_FIELDS),
    )
    for m in (StepSummary, MergedFrame)
}
"""Per binary message type: the model, the model of its scalar fields, its after-validators
and its array fields (name, element rule, required)."""

_FIELD_TEMPLATES: dict[str, dict[str, Any]] = {
    kind: {name: None if info.is_required() else info.get_default(call_default_factory=True)
           for name, info in model.model_fields.items()}
    for kind, (model, _, _, _) in _BINARY_MODELS.items()
}
"""Per binary message type, every field of its model in field order with its default (None
for a required field, which a decoded message always sets): a decoded message's
``__dict__`` starts as a copy of it."""

_PLAIN_MODELS = frozenset(
    model for model, _, _, _ in _BINARY_MODELS.values()
    if model.model_config.get("extra") != "allow" and not model.__pydantic_post_init__
    and not model.__pydantic_root_model__
    and all(info.alias is None and info.validation_alias is None
            for info in model.model_fields.values())
)
"""Binary message models whose ``model_construct`` only sets the given fields
(:func:`_construct`)."""


def _check_elements(name: str, kind: int, values: np.ndarray) -> None:
    """Vectorised element rule of one decoded array (ValueError names the first bad one).

    The common case costs one or two reductions without temporaries: the minimum and the
    maximum bound every element (a NaN makes the minimum NaN, which fails ``>=``); only a
    failing array is scanned again to name its first bad element."""
    if values.size == 0 or kind == _ANY_FLOAT:
        return
    lo = values.min()
    if kind in _FLOAT_KINDS:
        hi = values.max()
        if kind == _SUM_FLOAT:  # NaN fails >= (a NaN makes the minimum NaN)
            if lo >= 0:
                return
            bad, rule = ~(values >= 0), ">= 0 (+inf allowed, not NaN)"
        elif (lo >= 0 if kind == _NONNEG_FLOAT else lo > -np.inf) and hi < np.inf:
            return
        else:
            bad = ~np.isfinite(values)
            if kind == _NONNEG_FLOAT:
                bad |= values < 0
            rule = "finite and >= 0" if kind == _NONNEG_FLOAT else "finite"
    elif kind == _NONNEG_INT:
        if lo >= 0:
            return
        bad, rule = values < 0, ">= 0"
    elif kind == _POS_INT:
        if lo > 0:
            return
        bad, rule = values <= 0, "> 0"
    else:
        if lo >= 0 and values.max() < EXP_HIST_BINS:
            return
        bad, rule = (values < 0) | (values >= EXP_HIST_BINS), f"in [0, {EXP_HIST_BINS})"
    i = int(np.argmax(bad))
    raise ValueError(f"{name}.{i}: must be {rule}, got {values[i]}")


_LAYOUT_CACHE_SIZE = 4096
"""How many binary header layouts :func:`_read_container` remembers (the producers of a
run send a handful, one per message shape); the cache is emptied when it is full. A bound
on memory, not a tuning knob."""

_METADATA_MEMBER = b',"__metadata__":'
"""Where the gradstream metadata starts in a compact header (:func:`encode_binary` writes
it last): the header bytes before it describe the arrays, which repeat from message to
message of one shape, while the metadata (step, rank, wall time) changes every time."""


class _Layout:
    """The arrays of a binary header, checked (dtype, shape, offsets; the extent against
    each message's buffer area): what every header with the same bytes before its metadata
    describes.

    Attributes:
        specs: (name, dtype, count, byte offset in the buffer area) per array, header order.
        end: bytes of the buffer area the arrays reach.
        words: when every array is 8 bytes an element (``I64`` / ``F64``) and the
            non-empty ones lie end to end (as :func:`encode_binary` writes them):
            (byte offset of the first, int ``np.intp[k]`` start of each non-empty array in
            8-byte words from there, ascending: ``ufunc.reduceat`` indices; the number of
            words); else None.
        slots: name -> (start, stop) in words, and the array's position in ``words``.
        plans: per message type, the checks of its array fields (:func:`_array_plan`).
    """

    __slots__ = ("end", "plans", "slots", "specs", "words")

    def __init__(self, header: dict[str, Any], available: int) -> None:
        """Check ``header`` (the parsed header without its metadata) against a buffer
        area of ``available`` bytes, array by array in header order.

        Raises:
            ValueError: an unsupported dtype, a shape or offsets that do not match, an
                array past ``available``.
        """
        specs = []
        for name, spec in header.items():
            dtype = _ST_DTYPES.get(spec.get("dtype")) if isinstance(spec, dict) else None
            if dtype is None:
                raise ValueError(f"{name}: unsupported or missing dtype in the binary header")
            shape = spec.get("shape")
            begin, end = spec.get("data_offsets", (0, -1))
            if (not isinstance(shape, list) or len(shape) != 1 or not isinstance(shape[0], int)
                    or not isinstance(begin, int) or not isinstance(end, int)
                    or not 0 <= begin <= end <= available
                    or end - begin != shape[0] * dtype.itemsize):
                raise ValueError(f"{name}: shape / data_offsets do not match the buffer")
            specs.append((name, dtype, shape[0], begin))
        self.specs = tuple(specs)
        self.end = max((b + n * dt.itemsize for _, dt, n, b in specs), default=0)
        self.plans: dict[str, Any] = {}
        self.words: tuple[int, np.ndarray, int] | None = None
        self.slots: dict[str, tuple[int, int, int]] = {}
        filled = sorted((b, n, name) for name, dt, n, b in specs if n)
        if not filled or any(dt.itemsize != 8 or dt.kind not in "if" for _, dt, _, _ in specs):
            return
        base = filled[0][0]
        at = base
        for i, (begin, count, name) in enumerate(filled):
            if begin != at:  # a gap or an overlap: check array by array
                self.slots = {}
                return
            self.slots[name] = ((begin - base) // 8, (begin - base) // 8 + count, i)
            at = begin + 8 * count
        starts = np.array([(b - base) // 8 for b, _, _ in filled], np.intp)
        self.words = (base, starts, (at - base) // 8)

    def check_extent(self, data: memoryview) -> None:
        """Raise ValueError naming the first array (header order) that runs past ``data``."""
        if self.end <= len(data):
            return
        for name, dtype, count, begin in self.specs:
            if begin + count * dtype.itemsize > len(data):
                raise ValueError(f"{name}: shape / data_offsets do not match the buffer")


_LAYOUTS: dict[bytes, _Layout] = {}
"""Header bytes before the metadata member -> their checked layout (:func:`_read_container`)."""


def _read_container(raw: bytes) -> tuple[dict[str, Any], _Layout, memoryview]:
    """The scalars, the checked array layout and the buffer area of a binary message.

    A header whose bytes before ``,"__metadata__":`` were seen before (an earlier message
    of the same shape) is not parsed again: only its metadata member is, and only when it
    is the header's last member (the rest parses as one object with that one key); any
    other header is parsed whole. The metadata is parsed by pydantic's JSON parser
    (``pydantic_core.from_json``: the values of ``json.loads``, about four times faster on
    these short texts). Either way the result is that of parsing the whole
    header: ``_METADATA_MEMBER``'s quote follows a comma, so it cannot sit inside a JSON
    string, and a tail that parses as one object closes exactly the header's own brace, so
    the bytes before it are the header's other members.

    Raises:
        WireError: an unknown binary layout ("unknown wire encoding").
        ValueError: a malformed container (truncated, a header that is not a JSON object,
            no gradstream metadata, an unsupported dtype, offsets outside the buffer).
    """
    layout_code = raw[3:4]
    if layout_code != BINARY_LAYOUT_SAFETENSORS:
        raise WireError(
            f"unknown wire encoding: binary layout {layout_code!r} (this build reads JSON and "
            f"the binary layout {BINARY_LAYOUT_SAFETENSORS!r}, safetensors)"
        )
    if len(raw) < 12:
        raise ValueError("binary message truncated before its header")
    size = int.from_bytes(raw[4:12], "little")
    if 12 + size > len(raw):
        raise ValueError(f"binary header of {size} bytes runs past the message end")
    text = raw[12 : 12 + size]
    cut = text.find(_METADATA_MEMBER)
    layout = _LAYOUTS.get(text[:cut]) if cut > 0 else None
    meta: Any = None
    if layout is not None:
        try:
            tail = from_json(b"{" + text[cut + 1 :])
        except ValueError:
            tail = None
        if isinstance(tail, dict) and len(tail) == 1:
            meta = tail["__metadata__"]
        else:
            layout = None
    if layout is None:
        header = json.loads(text)
        if not isinstance(header, dict):
            raise ValueError("binary header is not a JSON object")
        meta = header.pop("__metadata__", None)
        layout = _Layout(header, len(raw) - 12 - size)
        if cut > 0 and _metadata_is_last(text, cut):
            if len(_LAYOUTS) >= _LAYOUT_CACHE_SIZE:
                _LAYOUTS.clear()
            _LAYOUTS[text[:cut]] = layout
    scalars = from_json((meta or {}).get("gradstream", "null"))
    if not isinstance(scalars, dict):
        raise ValueError("binary header has no gradstream metadata object")
    data = memoryview(raw)[12 + size :]
    layout.check_extent(data)
    return scalars, layout, data


def _metadata_is_last(text: bytes, cut: int) -> bool:
    """Whether the header ``text`` (a JSON object) ends with its metadata member, starting
    at ``cut``: the bytes from there parse as one object with that one key."""
    try:
        tail = from_json(b"{" + text[cut + 1 :])
    except ValueError:
        return False
    return isinstance(tail, dict) and len(tail) == 1


def read_binary_container(raw: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Scalars and arrays of a binary message (:func:`encode_binary`), unvalidated.

    The safetensors container is read here rather than with the ``safetensors`` library:
    the library copies every buffer and has no reader for the metadata of an in-memory
    container, and measured slower on this path (``bench/wire_codec.py``; figures in
    ``bench/README.md``). Arrays are read-only views of ``raw``
    (``np.frombuffer``); every offset and size is checked against the buffer first.

    Returns:
        (the scalar fields, a dict ``name -> 1-D array`` of the dtype the header names).

    Raises:
        WireError: an unknown binary layout ("unknown wire encoding").
        ValueError: a malformed container (truncated, a header that is not a JSON object,
            no gradstream metadata, an unsupported dtype, offsets outside the buffer).
    """
    scalars, layout, data = _read_container(raw)
    return scalars, {name: np.frombuffer(data, dtype, count=count, offset=begin)
                     for name, dtype, count, begin in layout.specs}


_ArrayPlan = tuple[tuple[tuple[str, int, bool, int], ...], str | None, bool, bool, bool]
"""(fields present: (name, element rule, handed over as a list, position in the layout's
words or -1), the first error the layout alone makes (a required field missing, a float
array for an integer field, an empty ``layer_indices``), whether the layout's word
reductions apply, and whether integer / float word reductions are needed)."""


def _array_plan(layout: _Layout, fields: tuple[tuple[str, int, bool], ...]) -> _ArrayPlan:
    """What a message type's array ``fields`` (name, element rule, required) need of
    ``layout``, in field order up to the first error the layout alone makes: the checks
    and their order of :func:`_decode_binary`'s per-array path."""
    present = {name: (dtype, count) for name, dtype, count, _ in layout.specs}
    entries: list[tuple[str, int, bool, int]] = []
    error = None
    fast = layout.words is not None
    for name, kind, required in fields:
        dtype, count = present.get(name, (None, 0))
        if dtype is None:
            if required:
                error = f"{name}: Field required"
                break
            continue
        if kind not in _FLOAT_KINDS and dtype.kind != "i" and dtype.kind != "u":
            error = f"{name}: integer array expected, got {dtype}"
            break
        if count == 0 and name in _NON_EMPTY:
            error = f"{name}: List should have at least 1 item"
            break
        if dtype != (_F64 if kind in _FLOAT_KINDS else _I64):
            fast = False  # converted on decoding: the per-array path
        slot = layout.slots.get(name)
        entries.append((name, kind, name in _LIST_FIELDS, -1 if slot is None else slot[2]))
    kinds = {kind for _, kind, _, _ in entries}
    return (tuple(entries), error, fast, bool(kinds - set(_FLOAT_KINDS)),
            bool(kinds & set(_FLOAT_KINDS)))


_I64, _F64 = np.dtype("<i8"), np.dtype("<f8")


def _checked_arrays(layout: _Layout, data: memoryview, kind: str,
                    fields: tuple[tuple[str, int, bool], ...]) -> dict[str, Any]:
    """The array fields of a message of type ``kind``, each checked by its element rule
    (ValueError names the first bad element, :func:`_check_elements`): read-only int64 /
    float64 views of ``data`` (or a list, ``_LIST_FIELDS``).

    When every array is 8 bytes an element and they lie end to end, every array's
    minimum (and, for floats and histogram columns, maximum) comes from one
    ``ufunc.reduceat`` over the whole buffer area per dtype, instead of one or two
    reductions per array; an array whose bounds break its rule is checked again by
    :func:`_check_elements` to name its first bad element."""
    plan = layout.plans.get(kind)
    if plan is None:
        plan = layout.plans[kind] = _array_plan(layout, fields)
    entries, error, fast, ints_needed, floats_needed = plan
    values: dict[str, Any] = {}
    if not fast:
        spec = {name: (dtype, count, begin) for name, dtype, count, begin in layout.specs}
        for name, rule, as_list, _ in entries:
            dtype, count, begin = spec[name]
            array = np.frombuffer(data, dtype, count=count, offset=begin)
            _check_elements(name, rule, array)
            array = array.astype(np.float64 if rule in _FLOAT_KINDS else np.int64, copy=False)
            array.flags.writeable = False  # the model is frozen; its arrays are too
            values[name] = array.tolist() if as_list else array
        if error is not None:
            raise ValueError(error)
        return values
    assert layout.words is not None
    base, starts, words = layout.words
    ints = np.frombuffer(data, _I64, count=words, offset=base)
    floats = ints.view(_F64) if floats_needed else None  # the same bytes as float64
    if not ints_needed:
        ints = None
    lo_int = np.minimum.reduceat(ints, starts).tolist() if ints is not None else ()
    hi_int: Any = None
    lo_float = np.minimum.reduceat(floats, starts).tolist() if floats is not None else ()
    hi_float = np.maximum.reduceat(floats, starts).tolist() if floats is not None else ()
    for name, rule, as_list, at in entries:
        if at < 0:  # empty: no element to check
            array = np.empty(0, np.float64 if rule in _FLOAT_KINDS else np.int64)
            array.flags.writeable = False
            values[name] = [] if as_list else array
            continue
        start, stop, _ = layout.slots[name]
        if rule in _FLOAT_KINDS:
            array = floats[start:stop]  # type: ignore[index]
            lo, hi = lo_float[at], hi_float[at]
            ok = (True if rule == _ANY_FLOAT else lo >= 0 if rule == _SUM_FLOAT
                  else (lo >= 0 if rule == _NONNEG_FLOAT else lo > -math.inf) and hi < math.inf)
        else:
            array = ints[start:stop]  # type: ignore[index]
            lo = lo_int[at]
            if rule == _HIST_COL:
                if hi_int is None:
                    hi_int = np.maximum.reduceat(ints, starts).tolist()
                ok = lo >= 0 and hi_int[at] < EXP_HIST_BINS
            else:
                ok = lo > 0 if rule == _POS_INT else lo >= 0
        if not ok:
            _check_elements(name, rule, array)  # raises, naming the first bad element
        values[name] = array.tolist() if as_list else array
    if error is not None:
        raise ValueError(error)
    return values


def _construct(model: type[StepSummary], values: dict[str, Any]) -> StepSummary:
    """``model.model_construct(**values)`` for ``values`` holding every field of ``model``
    in field order: the same instance (``__dict__`` = ``values``, every field set, no
    extra, no private attributes) without pydantic's per-field alias and default lookups,
    which cost more than the rest of a small message's decoding. Models for which
    ``model_construct`` does more (aliases, ``extra="allow"``, a post-init hook, a root
    model) go through it."""
    if model not in _PLAIN_MODELS:
        return model.model_construct(**values)
    message = model.__new__(model)
    object.__setattr__(message, "__dict__", values)
    object.__setattr__(message, "__pydantic_fields_set__", set(values))
    object.__setattr__(message, "__pydantic_extra__", None)
    object.__setattr__(message, "__pydantic_private__", None)
    return message


def _decode_binary(raw: bytes, allowed: tuple[str, ...]) -> StepSummary:
    """Validate a binary message: scalars by pydantic, arrays by NumPy, then the model's
    own cross-field validators."""
    try:
        scalars, layout, data = _read_container(raw)
    except WireError:
        raise
    except (ValueError, TypeError, AttributeError) as exc:
        raise WireError(f"undecodable binary message: {exc}") from None
    kind = scalars.get("type")
    if kind not in allowed:
        raise WireError(f"type: binary messages of type {kind!r} are not accepted here "
                        f"(expected one of {', '.join(allowed)})")
    model, scalar_model, validators, fields = _BINARY_MODELS[kind]
    try:
        head = scalar_model.model_validate(scalars)
    except ValidationError as exc:
        raise WireError(_first_error(exc)) from None
    try:
        arrays = _checked_arrays(layout, data, kind, fields)
        values = _FIELD_TEMPLATES[kind].copy()  # every field, in field order
        values.update(head.__dict__)
        values.update(arrays)
        message = _construct(model, values)
        for validator in validators:
            getattr(message, validator)()
    except ValueError as exc:
        raise WireError(f"{exc}") from None
    return message


def _check_size(raw: bytes | str | None) -> None:
    if raw is None:
        raise WireError("empty message (no value)")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(raw)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")


def is_binary(raw: bytes | str | None) -> bool:
    """True when ``raw`` starts like a binary message (``BINARY_MAGIC``), of any layout."""
    return isinstance(raw, bytes | bytearray | memoryview) and bytes(raw[:3]) == BINARY_MAGIC


def decode_message(
    raw: bytes | str,
) -> RunStarted | StepSummary | RunFinished | LocalSummary:
    """Parse and validate one wire message, JSON or binary (:func:`encode_binary`).

    The first byte says which: ``BINARY_MAGIC`` starts a binary message (its fourth byte
    names the layout), anything else is parsed as JSON.

    Args:
        raw: one message, at most ``MAX_MESSAGE_BYTES``: UTF-8 JSON bytes (or str), or
            binary bytes.

    Returns:
        The validated RunStarted, StepSummary, RunFinished or LocalSummary (JSON only).

    Raises:
        WireError: oversized, not JSON, unknown binary layout ("unknown wire encoding"),
            unknown ``type``, unknown major schema version, or any field invalid;
            ``reason`` names the field.
    """
    _check_size(raw)
    if is_binary(raw):
        return _decode_binary(bytes(raw), ("step_summary",))
    try:
        return _ADAPTER.validate_json(raw)
    except ValidationError as exc:
        raise WireError(_first_error(exc)) from None


def decode_frame_message(
    raw: bytes | str,
) -> RunStarted | MergedFrame | RunFinished | LocalSummary:
    """Parse and validate one message of the frames topic (scale-out mode), JSON or binary
    (a LocalSummary a worker republished there is JSON).

    Raises:
        WireError: as :func:`decode_message`.
    """
    _check_size(raw)
    if is_binary(raw):
        return _decode_binary(bytes(raw), ("merged_frame",))  # type: ignore[return-value]
    try:
        return _FRAME_ADAPTER.validate_json(raw)
    except ValidationError as exc:
        raise WireError(_first_error(exc)) from None


def encode_binary(message: StepSummary) -> bytes:
    """Serialise a StepSummary or MergedFrame to the columnar binary form.

    Layout: ``BINARY_MAGIC`` + ``BINARY_LAYOUT_SAFETENSORS`` (4 bytes), then a safetensors
    container (the Hugging Face safetensors format): an unsigned 64-bit little-endian
    header length N, N bytes of UTF-8 JSON header, then the raw buffers. The header maps
    each array field present to ``{"dtype": "I64" | "F64", "shape": [n], "data_offsets":
    [begin, end]}`` (byte offsets into the buffer area; integers as little-endian int64,
    floats as little-endian IEEE-754 float64) and holds the scalar fields (``type``,
    ``schema_version``, ``run_id``, ``step``, ...) as a JSON object text under
    ``__metadata__["gradstream"]``. The header is padded with spaces so that the buffers
    start 8-byte aligned in the message. Absent (None) arrays are left out.

    Raises:
        WireError: the encoded message exceeds ``MAX_MESSAGE_BYTES``.
    """
    scalars: dict[str, Any] = {}
    header: dict[str, Any] = {}
    buffers: list[bytes] = []
    offset = 0
    for name in type(message).model_fields:
        value = getattr(message, name)
        if name not in _ARRAY_FIELDS:
            if value is not None:
                scalars[name] = value
            continue
        if value is None:
            continue
        floats = _ARRAY_FIELDS[name] in _FLOAT_KINDS
        buf = np.asarray(value, "<f8" if floats else "<i8").tobytes()
        header[name] = {"dtype": "F64" if floats else "I64", "shape": [len(value)],
                        "data_offsets": [offset, offset + len(buf)]}
        buffers.append(buf)
        offset += len(buf)
    header["__metadata__"] = {"gradstream": json.dumps(scalars, separators=(",", ":"))}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(12 + len(text)) % 8)
    data = b"".join([BINARY_MAGIC, BINARY_LAYOUT_SAFETENSORS, len(text).to_bytes(8, "little"),
                     text, *buffers])
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(
            f"encoded {message.type} is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit"
        )
    return data


def encode_message(
    message: RunStarted | StepSummary | RunFinished | LocalSummary,
    wire_format: WireFormat = "json",
) -> bytes:
    """Serialise a wire model: compact UTF-8 JSON, or with ``wire_format="binary"`` the
    columnar binary form (:func:`encode_binary`) for a StepSummary or MergedFrame
    (RunStarted, RunFinished and LocalSummary are always JSON).

    Raises:
        WireError: the encoded message exceeds ``MAX_MESSAGE_BYTES``.
    """
    if isinstance(message, StepSummary):
        if wire_format == "binary":
            return encode_binary(message)
        arrays = {name: value.tolist() for name in _ARRAY_FIELDS
                  if isinstance(value := getattr(message, name, None), np.ndarray)}
        if arrays:  # a binary-decoded message: JSON takes lists
            message = message.model_copy(update=arrays)
    data = message.model_dump_json().encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(
            f"encoded {message.type} is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit"
        )
    return data


def _json_safe(values: np.ndarray) -> list[Any]:
    """A list for display: non-finite floats as the strings "NaN" / "Infinity"."""
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        return [v if math.isfinite(v) else str(v).replace("inf", "Infinity").replace(
            "nan", "NaN") for v in values.tolist()]
    return values.tolist()


def to_display(raw: bytes | str | None) -> dict[str, Any] | str | None:
    """A message for people, without validating it: a binary message as a dict (scalars
    and arrays as lists; non-finite floats as strings), JSON as the parsed object, other
    text as the text itself; None when the bytes are neither (the caller shows them
    base64) or the binary message is malformed."""
    if raw is None:
        return None
    if is_binary(raw):
        try:
            scalars, arrays = read_binary_container(bytes(raw))
        except (ValueError, TypeError, AttributeError):
            return None
        return {**scalars, **{k: _json_safe(v) for k, v in arrays.items()}}
    try:
        text = raw if isinstance(raw, str) else bytes(raw).decode()
    except UnicodeDecodeError:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


_PER_LAYER = (
    "layer_indices", "numel", "sum_abs", "sum_sq", "max_abs", "nonfinite", "nan", "weight_sum_sq",
    "update_sum_sq", *_WEIGHT_DISTRIBUTION, "shard_index", "shard_count",
)


def split_step_summary(
    message: StepSummary, bounds: list[tuple[int, int]]
) -> list[StepSummary]:
    """Cut a StepSummary into parts (schema 1.4) holding disjoint layer ranges.

    Part i holds the entries ``bounds[i][0]:bounds[i][1]`` of every per-layer array (the
    exponent histograms' CSR rows with them, offsets rebased to 0) and the local-view rows
    of those layers; local rows of layers in no range go with the first part, as do the
    replica disagreements and the training scalars. Every part
    carries ``part_index = i`` and ``part_count = len(bounds)``. The parts are built from an
    already validated message and are not validated again.

    Args:
        message: a validated StepSummary without parts.
        bounds: non-empty, disjoint ``(start, stop)`` ranges of positions in
            ``message.layer_indices`` (start < stop).

    Returns:
        ``len(bounds)`` StepSummary messages.

    Raises:
        ValueError: ``bounds`` is empty, or ``message`` is already a part.
    """
    if not bounds:
        raise ValueError("split_step_summary needs at least one layer range")
    if message.part_count is not None:
        raise ValueError("cannot split a StepSummary that is already a part")
    layers = np.asarray(message.layer_indices, np.int64)
    owner = None
    if message.local_layer_indices is not None:
        part_of = np.full(len(layers), -1, np.int64)
        for i, (a, b) in enumerate(bounds):
            part_of[a:b] = i
        order = np.argsort(layers)
        local = np.asarray(message.local_layer_indices, np.int64)
        at = np.minimum(np.searchsorted(layers[order], local), len(layers) - 1)
        found = layers[order][at] == local
        position = np.where(found, order[at], -1)
        owner = np.where(position >= 0, part_of[np.maximum(position, 0)], -1)
        owner[owner < 0] = 0
    parts = []
    for i, (a, b) in enumerate(bounds):
        update: dict[str, Any] = {"part_index": i, "part_count": len(bounds)}
        for name in _PER_LAYER:
            values = getattr(message, name)
            if values is not None:
                update[name] = values[a:b]
        for prefix in ("exp_hist", "weight_exp_hist"):
            offsets = getattr(message, f"{prefix}_offsets")
            if offsets is None:
                continue
            lo, hi = offsets[a], offsets[b]
            update[f"{prefix}_offsets"] = [o - lo for o in offsets[a : b + 1]]
            update[f"{prefix}_columns"] = getattr(message, f"{prefix}_columns")[lo:hi]
            update[f"{prefix}_counts"] = getattr(message, f"{prefix}_counts")[lo:hi]
        if owner is not None:
            rows = np.flatnonzero(owner == i)
            for name in _LOCAL_VIEW:
                values = getattr(message, name)
                update[name] = np.asarray(values)[rows].tolist() if rows.size else None
        if i and message.replica_divergence is not None:
            update["replica_divergence"] = None  # the message's rows, once (first part)
        if i:  # the training scalars, once (first part)
            update.update(dict.fromkeys(("scalars", *_RANK_SCALAR_FIELDS)))
        parts.append(message.model_copy(update=update))
    return parts

