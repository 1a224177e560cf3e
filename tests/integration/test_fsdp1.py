"""FSDP v1 (``FullyShardedDataParallel``) end to end: real gloo ranks on CPU, the real
``GradientTap`` -> ``GradientProducer`` -> broker -> ``Worker`` -> DuckDB, with flat
parameters and with ``use_orig_params=True``.

The stored statistics of every (step, layer) must equal torch's own values of the original
parameter's full gradient right before ``optimizer.step()`` (``summon_full_params`` /
the all-gathered flat gradient), the step's total norm what FSDP's ``clip_grad_norm_``
returns, and every frame must be complete (every rank, pieces adding up to the full
sizes). World 3 divides none of the flat sizes, so padding and uneven or empty slices
occur. Both ways of reducing a run are exercised. Tolerances as in ``test_parallelism``.
"""

from __future__ import annotations

import pytest

from tests.integration.parallel_ranks import STEPS
from tests.integration.test_parallelism import assert_frames_match_torch, run_job


@pytest.mark.parametrize("kind,world,reduce", [
    ("fsdp1_orig", 2, "in_band"), ("fsdp1_flat", 2, "in_band"), ("fsdp1_flat", 3, "off"),
    ("fsdp1_orig", 3, "in_band"),
])
def test_fsdp1_frames_are_the_full_gradient(kind, world, reduce, kafka_bootstrap, tmp_path,
                                            unique_name):
    """Reduced inside training (``in_band``: every rank's slices summed, one message per
    step) or merged by the consumer (``off``: each rank sends its pieces)."""
    result, con, run_id = run_job(kind, world, tmp_path, kafka_bootstrap, unique_name,
                                  reduce=reduce)
    assert result["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert_frames_match_torch(result, con, run_id)
    frames = con.execute("SELECT count(*) FROM frames WHERE run_id = ? AND complete",
                         [run_id]).fetchone()[0]
    assert frames == STEPS  # every rank reported every step, the pieces fit
    layers = con.execute("SELECT name, numel FROM layers WHERE run_id = ? ORDER BY "
                         "layer_index", [run_id]).fetchall()
    assert layers == [(n, result["records"][0]["layers"][n]["numel"])
                      for n in result["names"]]
