"""Migrations of DuckDB stores created by older versions to the current schema.

:data:`schemas.tables.CREATE_TABLES` creates a new store at the current schema directly.
A store created by an older version has the same tables with fewer columns (and
``layer_stats`` gradient columns that are NOT NULL); :data:`MIGRATIONS`, run after the
``CREATE TABLE IF NOT EXISTS`` statements, brings it to the current columns, in order.
Each statement detects whether it applies from the columns the store has
(``ADD COLUMN IF NOT EXISTS``; ``DROP NOT NULL`` of a column that is already nullable
changes nothing), so on a current store every one is a no-op. The added columns come at
the end of their table in the order of ``CREATE_TABLES``, so positional inserts fit old
and new stores alike. Rows stored before a column existed hold NULL in it (the column's
meaning for NULL is in :mod:`schemas.tables`).
"""

from __future__ import annotations

MIGRATIONS: tuple[str, ...] = (
    "ALTER TABLE runs ADD COLUMN IF NOT EXISTS ignore_layers VARCHAR[]",
    "ALTER TABLE layers ADD COLUMN IF NOT EXISTS dtype VARCHAR",
    # layer_stats: the optional richer statistics
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS weight_sum_sq DOUBLE",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS update_sum_sq DOUBLE",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS update_to_weight DOUBLE",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS exp_hist_columns SMALLINT[]",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS exp_hist_counts BIGINT[]",
    # layer_stats: sum |g| and max |g| unknown for a layer sent in norms mode
    "ALTER TABLE layer_stats ALTER COLUMN sum_abs DROP NOT NULL",
    "ALTER TABLE layer_stats ALTER COLUMN max_abs_grad DROP NOT NULL",
    "ALTER TABLE layer_stats ALTER COLUMN mean_abs_grad DROP NOT NULL",
    # layer_stats: the weight distribution
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS weight_sum DOUBLE",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS weight_sum_cube DOUBLE",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS weight_sum_quad DOUBLE",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS weight_min DOUBLE",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS weight_max DOUBLE",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS weight_zeros BIGINT",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS weight_nonfinite BIGINT",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS weight_exp_hist_columns SMALLINT[]",
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS weight_exp_hist_counts BIGINT[]",
    # layer_stats: the NaN count among the non-finite elements
    "ALTER TABLE layer_stats ADD COLUMN IF NOT EXISTS nan BIGINT",
    # frames: why a frame is partial besides its missing ranks
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS refused_ranks INTEGER[]",
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS layout_violations INTEGER",
    # frames: the summary a report reads instead of the rows (schemas.frame_summary)
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS vanishing_indices INTEGER[]",
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS exploding_indices INTEGER[]",
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS nonfinite_indices INTEGER[]",
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS inf_indices INTEGER[]",
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS top_magnitude DOUBLE",
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS rounding_candidates INTEGER[]",
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS rounding_magnitudes DOUBLE[]",
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS rounding_gaps DOUBLE[]",
    "ALTER TABLE frames ADD COLUMN IF NOT EXISTS layer_index_max INTEGER",
    # alerts: the incident, its first step, the frame values and wall time
    "ALTER TABLE alerts ADD COLUMN IF NOT EXISTS incident_id VARCHAR",
    "ALTER TABLE alerts ADD COLUMN IF NOT EXISTS first_step BIGINT",
    "ALTER TABLE alerts ADD COLUMN IF NOT EXISTS frame_values JSON",
    "ALTER TABLE alerts ADD COLUMN IF NOT EXISTS wall_time DOUBLE",
    # local_layer_stats: why a flight recorder sent the row, and when it fired
    "ALTER TABLE local_layer_stats ADD COLUMN IF NOT EXISTS trigger VARCHAR",
    "ALTER TABLE local_layer_stats ADD COLUMN IF NOT EXISTS trigger_step BIGINT",
)
"""ALTER statements bringing an older store to the current schema, in order; each a no-op
on a store at the current schema."""
