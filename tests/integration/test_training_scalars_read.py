"""Training scalars read back: a run streamed through the real Kafka broker into a real
DuckDB file by a worker (``tests.integration.test_training_scalars.run_single``: three ranks,
a NaN loss on rank 2 at step 21, rank 1 slow for a stretch), then read by the notebook API,
the report and the plot, each against the values the ranks sent."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.notebook import Store
from tests.integration import test_training_scalars as ts


def test_notebook_report_and_plot_read_what_the_ranks_sent(kafka_bootstrap, tmp_path,
                                                           unique_name) -> None:
    run_id = f"run-{unique_name}"
    db = ts.run_single(kafka_bootstrap, tmp_path, unique_name, run_id)
    run = Store(db).run(run_id)

    wide = run.scalars()
    assert wide["step"].tolist() == list(range(ts.STEPS))
    assert {"loss", "lr", "loss_scale", "tokens", "compute_time_s", "step_time_s"} <= set(wide)
    for step in range(ts.STEPS):
        losses = [ts.loss(step, r) for r in range(ts.WORLD)]
        got = wide.loc[step, "loss"]
        assert (math.isnan(got) if step == ts.NAN_STEP
                else got == pytest.approx(np.mean(losses), rel=1e-12))
        assert wide.loc[step, "compute_time_s"] == max(ts.compute_time(step, r)
                                                       for r in range(ts.WORLD))
    ranks = run.scalars(names="loss", ranks=True)
    assert len(ranks) == ts.STEPS * ts.WORLD
    sent = [ts.loss(s, r) for s in range(ts.STEPS) for r in range(ts.WORLD)]
    np.testing.assert_array_equal(ranks["value"].to_numpy(), sent)

    training = run.report().training
    assert training is not None
    assert (training.nonfinite_loss_steps, training.first_nonfinite_loss_step,
            training.first_nonfinite_loss_ranks) == (1, ts.NAN_STEP, [ts.NAN_RANK])
    finite = [(s, float(np.mean([ts.loss(s, r) for r in range(ts.WORLD)])))
              for s in range(ts.STEPS) if s != ts.NAN_STEP]
    assert (training.first_loss_step, training.last_loss_step) == (0, ts.STEPS - 1)
    assert training.min_loss == pytest.approx(min(v for _, v in finite), rel=1e-12)
    assert training.loss_scale_decreases == 0 and training.last_loss_scale == 65536.0
    medians = {r: float(np.median([ts.compute_time(s, r) for s in range(ts.STEPS)]))
               for r in range(ts.WORLD)}
    slowest = max(medians, key=lambda r: (medians[r], -r))
    assert training.slowest_rank == slowest
    assert training.slowest_rank_compute_time_s == pytest.approx(medians[slowest])
    assert training.median_step_time_s is not None and training.median_step_time_s > 0

    fig = run.plot()
    loss_ax, heat_ax = fig.axes[:2]
    assert loss_ax.get_ylabel() == "loss" and loss_ax.get_shared_x_axes().joined(loss_ax,
                                                                                  heat_ax)
    y = loss_ax.get_lines()[0].get_ydata()
    assert math.isnan(y[ts.NAN_STEP]) and y[0] == pytest.approx(finite[0][1], rel=1e-12)
