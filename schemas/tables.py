"""DuckDB table definitions: the store's half of the contract.

Written by the consumer's DuckDB output, read by ``analysis``. :data:`CREATE_TABLES`
declares the current schema; :data:`SCHEMA_DDL` is what a writer runs on opening a store:
those statements, then the migrations of :mod:`schemas.migrations` that bring a store
created by an older version to the same columns (each a no-op on a current store). All
statements are idempotent. Times are unix seconds (DOUBLE); steps are optimiser steps.

Tables
------
runs
    One row per run: world size, thresholds, host, times, config, the layer-name patterns
    the run excludes from its health (``ignore_layers``; NULL = none), and the
    incremental health counters kept by the worker (``frames``, ``issue_frames``,
    ``health``...).
run_ranks
    One row per (run, rank) that sent RunFinished: its last step, steps it recorded and
    step summaries it dropped (queue full while Kafka was unreachable).
refused_ranks
    One row per (run, rank) whose RunStarted contradicted the run's and was refused, with
    the reason: a worker restarted on the file keeps dead-lettering that rank's summaries
    (``refused_rank``) instead of merging them.
layers
    Layer names in model order (``layer_index``), their full-tensor element counts and,
    when the producer sent it, the gradient ``dtype``.
layer_stats
    One row per (run, step, layer): the exactly-mergeable sums over every rank
    (``numel``, ``sum_abs``, ``sum_sq``, ``max_abs_grad``, ``nonfinite``) and the
    frame fields derived from them (``mean_abs_grad``, ``grad_norm``, ``flow_intensity``,
    ``is_vanishing``, ``is_exploding``). Optional richer statistics (NULL unless every
    shard of the layer sent them): ``weight_sum_sq`` (sum w^2), ``update_sum_sq``
    (sum (w_t - w_{t-1})^2), ``update_to_weight = sqrt(update_sum_sq / weight_sum_sq)``
    (the update-to-weight norm ratio), and the exponent histogram of the finite gradient
    elements as sparse ``exp_hist_columns`` / ``exp_hist_counts`` (column layout in
    ``schemas.wire``: EXP_HIST_MIN, EXP_HIST_MAX, EXP_HIST_BINS). ``sum_abs``,
    ``max_abs_grad`` and ``mean_abs_grad`` are NULL for a layer some rank sent in norms
    mode. Unique on (run_id, step, layer_index) without an index: the DuckDB output writes a
    frame by deleting the batch's (run_id, step) rows, then appending the new ones, in one
    transaction (an index would cost more per inserted row than the rest of the insert;
    a store that carries that primary key keeps it, and the same writes keep it
    satisfied). The weight distribution over the finite weights (NULL unless every
    shard sent it): ``weight_sum`` = sum w, ``weight_sum_cube`` = sum w^3,
    ``weight_sum_quad`` = sum w^4, ``weight_min``, ``weight_max``, ``weight_zeros`` (exact
    zeros), ``weight_nonfinite`` and the exponent histogram of |w|
    (``weight_exp_hist_columns`` / ``weight_exp_hist_counts``, same layout). Like the
    gradient sums, the weight sums add over the pieces of a parameter: a sharded tensor
    (FSDP) adds up to the whole tensor, and a replicated one (DDP) is counted once when the
    producer sends a shard layout, so ``layer_stats.numel = layers.numel``. A run whose
    producer sent no shard layout under DDP holds ``R = layer_stats.numel / layers.numel``
    identical copies; dividing the sums by ``R`` gives one copy in both cases.
    ``nan``: how many of the ``nonfinite`` elements are NaN, the others being +-Inf; NULL
    where some shard of the layer did not send the count (``analysis.nonfinite`` then
    cannot rebuild the reference's (trustformers-debug) values of a row with
    ``nonfinite > 0``).
local_layer_stats
    One row per (run, step, rank, layer) of the per-rank *local* view: the statistics of
    that rank's own gradient before the cross-rank reduction (``numel``, ``sum_abs``,
    ``sum_sq``, ``max_abs_grad``, ``nonfinite``), sent only when the producer's local view
    is on. Never merged into ``layer_stats``; it tells which rank's gradient went bad first.
    ``trigger`` / ``trigger_step``: for a row sent by the rank's flight recorder
    (``schemas.wire.LocalSummary``, the default ``local_view="recorder"``), why it was sent
    (``nonfinite``, ``exploding``, ``norm_spike``, ``sample``, or ``every_step`` for a
    local view sent alone every step) and the step at which that trigger fired; NULL for
    a row that came inside a StepSummary (``local_view="every_step"``). Recorder rows exist
    only for the steps around a trigger: a step without rows is not a healthy step.
frames
    One row per (run, step): run health after this frame, per-frame counts, whether every
    rank reported (``complete``), the ranks seen and missing, and why a frame is partial
    besides ``missing_ranks``: the missing ranks whose data was refused
    (``refused_ranks``: a refused RunStarted, a dead-lettered summary; the others sent
    nothing) and how many layers hold pieces that do not fit their parameter
    (``layout_violations``: numel that does not add up, a replica of another size, another
    shard count). The frame's summary, written with its rows (``schemas.frame_summary``:
    the layer indices flagged vanishing, exploding, non-finite and Inf, and the inputs of
    the rounding-level judgement), so that a report reads frames instead of rows; NULL in
    a row stored before the summary existed.
step_scalars
    One row per (run, step, scalar name) of the training scalars (``schemas.scalars``):
    the step scalars the producers sent (learning rates ``lr``, ``lr/1``...,
    ``loss_scale``, user names; the same on every rank: the value stored first stays)
    and, for each per-rank scalar, its value for the step made from every rank stored in
    ``rank_scalars`` (``schemas.scalars.RANK_AGGREGATES``: the mean ``loss``, the summed
    ``tokens`` / ``samples``, the slowest rank's ``step_time_s`` / ``compute_time_s``),
    recomputed when a late rank arrives. ``value`` may be NaN or +-Inf.
rank_scalars
    One row per (run, step, rank, scalar name) of the per-rank training scalars: the
    rank's own loss, tokens and samples, and the step and compute times its SDK measured.
    Unique on (run_id, step, rank, name) without an index, as ``layer_stats``: a frame's
    rows are appended, and a frame that may rewrite stored rows (a late rank, a frame
    stored again) deletes the (run, step, rank) rows it carries first, in the same
    transaction (an index would cost more per row than the insert: 12,288 rows a step at
    4,096 ranks).
alerts
    Alert events raised by workers (``schemas.alert.Alert``): one row per firing or
    resolved event, keyed by ``alert_id``; the two events of an incident share
    ``incident_id`` and ``first_step`` (the step it began); ``frame_values`` (JSON) holds
    the frame values behind the event and ``wall_time`` the producer wall time of that
    frame.
kafka_offsets
    Next Kafka offset to consume per (consumer group, topic, partition), written in the
    same transaction as the rows it covers (exactly-once into the store).
layer_stats_rollup
    Per (run, level, block of ``2^level`` steps, layer): the maximum ``grad_norm`` and
    ``flow_intensity``, the OR of the row flags and the row count of the layer's
    ``layer_stats`` rows in the block, refreshed with the rows (``schemas.grid_rollup``),
    so that the layers x steps grid reads blocks instead of rows.
"""

from schemas.frame_summary import SUMMARY_COLUMNS
from schemas.grid_rollup import ROLLUP_DDL
from schemas.migrations import MIGRATIONS

CREATE_TABLES: tuple[str, ...] = (
    """
    CREATE TABLE IF NOT EXISTS runs (
        run_id              VARCHAR PRIMARY KEY,
        world_size          INTEGER NOT NULL,
        num_layers          INTEGER NOT NULL,
        vanishing_threshold DOUBLE NOT NULL,
        exploding_threshold DOUBLE NOT NULL,
        host                VARCHAR,
        start_time          DOUBLE,
        end_time            DOUBLE,
        config              JSON,
        health              VARCHAR NOT NULL DEFAULT 'Healthy',
        frames              BIGINT NOT NULL DEFAULT 0,
        issue_frames        BIGINT NOT NULL DEFAULT 0,
        last_step           BIGINT,
        first_nonfinite_step BIGINT,
        ignore_layers       VARCHAR[]
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS run_ranks (
        run_id         VARCHAR NOT NULL,
        rank           INTEGER NOT NULL,
        last_step      BIGINT NOT NULL,
        steps_recorded BIGINT NOT NULL,
        dropped        BIGINT NOT NULL,
        end_time       DOUBLE NOT NULL,
        PRIMARY KEY (run_id, rank)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS refused_ranks (
        run_id VARCHAR NOT NULL,
        rank   INTEGER NOT NULL,
        reason VARCHAR NOT NULL,
        PRIMARY KEY (run_id, rank)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS layers (
        run_id      VARCHAR NOT NULL,
        layer_index INTEGER NOT NULL,
        name        VARCHAR NOT NULL,
        numel       BIGINT NOT NULL,
        dtype       VARCHAR,
        PRIMARY KEY (run_id, layer_index)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS layer_stats (
        run_id         VARCHAR NOT NULL,
        step           BIGINT NOT NULL,
        layer_index    INTEGER NOT NULL,
        numel          BIGINT NOT NULL,
        sum_abs        DOUBLE,
        sum_sq         DOUBLE NOT NULL,
        max_abs_grad   DOUBLE,
        nonfinite      BIGINT NOT NULL,
        mean_abs_grad  DOUBLE,
        grad_norm      DOUBLE NOT NULL,
        flow_intensity DOUBLE NOT NULL,
        is_vanishing   BOOLEAN NOT NULL,
        is_exploding   BOOLEAN NOT NULL,
        weight_sum_sq  DOUBLE,
        update_sum_sq  DOUBLE,
        update_to_weight DOUBLE,
        exp_hist_columns SMALLINT[],
        exp_hist_counts  BIGINT[],
        weight_sum       DOUBLE,
        weight_sum_cube  DOUBLE,
        weight_sum_quad  DOUBLE,
        weight_min       DOUBLE,
        weight_max       DOUBLE,
        weight_zeros     BIGINT,
        weight_nonfinite BIGINT,
        weight_exp_hist_columns SMALLINT[],
        weight_exp_hist_counts  BIGINT[],
        nan              BIGINT
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS local_layer_stats (
        run_id        VARCHAR NOT NULL,
        step          BIGINT NOT NULL,
        rank          INTEGER NOT NULL,
        layer_index   INTEGER NOT NULL,
        numel         BIGINT NOT NULL,
        sum_abs       DOUBLE NOT NULL,
        sum_sq        DOUBLE NOT NULL,
        max_abs_grad  DOUBLE NOT NULL,
        nonfinite     BIGINT NOT NULL,
        trigger       VARCHAR,
        trigger_step  BIGINT
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS frames (
        run_id           VARCHAR NOT NULL,
        step             BIGINT NOT NULL,
        health           VARCHAR NOT NULL,
        num_layers       INTEGER NOT NULL,
        vanishing_layers INTEGER NOT NULL,
        exploding_layers INTEGER NOT NULL,
        nonfinite_layers INTEGER NOT NULL,
        complete         BOOLEAN NOT NULL,
        ranks_seen       INTEGER[] NOT NULL,
        missing_ranks    INTEGER[] NOT NULL,
        wall_time        DOUBLE NOT NULL,
        finalized_at     DOUBLE NOT NULL,
        refused_ranks    INTEGER[],
        layout_violations INTEGER,
        vanishing_indices INTEGER[],
        exploding_indices INTEGER[],
        nonfinite_indices INTEGER[],
        inf_indices       INTEGER[],
        top_magnitude     DOUBLE,
        rounding_candidates INTEGER[],
        rounding_magnitudes DOUBLE[],
        rounding_gaps       DOUBLE[],
        layer_index_max     INTEGER,
        PRIMARY KEY (run_id, step)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS alerts (
        alert_id   VARCHAR PRIMARY KEY,
        run_id     VARCHAR NOT NULL,
        step       BIGINT NOT NULL,
        rule       VARCHAR NOT NULL,
        severity   VARCHAR NOT NULL,
        state      VARCHAR NOT NULL,
        layers     VARCHAR[] NOT NULL,
        ranks      INTEGER[] NOT NULL,
        message    VARCHAR NOT NULL,
        created_at DOUBLE NOT NULL,
        incident_id  VARCHAR,
        first_step   BIGINT,
        frame_values JSON,
        wall_time    DOUBLE
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS step_scalars (
        run_id VARCHAR NOT NULL,
        step   BIGINT NOT NULL,
        name   VARCHAR NOT NULL,
        value  DOUBLE NOT NULL,
        PRIMARY KEY (run_id, step, name)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS rank_scalars (
        run_id VARCHAR NOT NULL,
        step   BIGINT NOT NULL,
        rank   INTEGER NOT NULL,
        name   VARCHAR NOT NULL,
        value  DOUBLE NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS kafka_offsets (
        consumer_group VARCHAR NOT NULL,
        topic          VARCHAR NOT NULL,
        kafka_partition INTEGER NOT NULL,
        next_offset    BIGINT NOT NULL,
        PRIMARY KEY (consumer_group, topic, kafka_partition)
    )
    """,
    ROLLUP_DDL,
)

"""Every table at the current schema (``CREATE TABLE IF NOT EXISTS``); columns in the order
a migrated older store has them, so positional inserts fit both."""

SCHEMA_DDL: tuple[str, ...] = (*CREATE_TABLES, *MIGRATIONS)
"""What a writer runs on opening a store: the tables, then the migrations of older stores."""

LAYER_STATS_COLUMNS: tuple[str, ...] = (
    "run_id", "step", "layer_index", "numel", "sum_abs", "sum_sq", "max_abs_grad",
    "nonfinite", "mean_abs_grad", "grad_norm", "flow_intensity", "is_vanishing",
    "is_exploding", "weight_sum_sq", "update_sum_sq", "update_to_weight",
    "exp_hist_columns", "exp_hist_counts", "weight_sum", "weight_sum_cube", "weight_sum_quad",
    "weight_min", "weight_max", "weight_zeros", "weight_nonfinite", "weight_exp_hist_columns",
    "weight_exp_hist_counts", "nan",
)
"""Column order of ``layer_stats`` (the DuckDB output's bulk inserts follow it)."""

LOCAL_LAYER_STATS_COLUMNS: tuple[str, ...] = (
    "run_id", "step", "rank", "layer_index", "numel", "sum_abs", "sum_sq", "max_abs_grad",
    "nonfinite",
)
"""Column order of ``local_layer_stats`` (its required columns; the nullable ``trigger``
and ``trigger_step`` of recorder rows follow)."""

FRAMES_COLUMNS: tuple[str, ...] = (
    "run_id", "step", "health", "num_layers", "vanishing_layers", "exploding_layers",
    "nonfinite_layers", "complete", "ranks_seen", "missing_ranks", "wall_time", "finalized_at",
)
"""Column order of ``frames`` (its required columns; the optional ``refused_ranks`` and
``layout_violations`` and the summary follow, see :data:`FRAMES_OPTIONAL_COLUMNS`)."""

FRAMES_OPTIONAL_COLUMNS: tuple[str, ...] = (
    "refused_ranks", "layout_violations", *SUMMARY_COLUMNS)
"""The nullable columns of ``frames``: the missing ranks whose data was refused, the
number of layers whose pieces do not fit their parameter, and the frame's summary
(``schemas.frame_summary``)."""
