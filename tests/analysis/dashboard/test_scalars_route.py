"""``GET /api/scalars``: a run's step scalars binned on the heatmap's columns, served by the
dashboard of a process writing the store (no browser; the page's drawing is tested in
``tests/integration/test_dashboard_browser.py``)."""

from __future__ import annotations

import json
import math
import urllib.parse
from pathlib import Path

import duckdb
import numpy as np
import pytest

from analysis.dashboard.server import Dashboard, DashboardServer
from analysis.plots.page_json import page_json
from analysis.plots.scalars import load_scalar_bins
from analysis.read.cursors import ReadCursors
from analysis.read.sidecar import new_token
from tests.analysis import scalar_run as sr
from tests.analysis.crafted import write_history
from tests.analysis.dashboard.test_api import AUTH, get

TOKEN = AUTH["Authorization"].removeprefix("Bearer ")


@pytest.fixture
def live(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = sr.write_scalar_run(tmp_path / "s.duckdb")
    write_history(store, np.ones((2, 10)), run_id="plain")
    writer = duckdb.connect(str(store))
    cursors = ReadCursors.from_connection(writer.cursor(), store)
    server = DashboardServer(Dashboard(cursors, TOKEN), "127.0.0.1", 0)
    server.start()
    try:
        yield writer, server.url
    finally:
        server.stop()
        cursors.close()
        writer.close()


def get_json(url: str) -> dict:
    status, body, _ = get(url)
    assert status == 200, body
    return json.loads(body)


def names_param(*names: str) -> str:
    return "&names=" + urllib.parse.quote(json.dumps(list(names)))


def test_binned_like_the_grid(live) -> None:  # type: ignore[no-untyped-def]
    writer, url = live
    served = get_json(url + "/api/scalars?run=r&max_steps=8")
    grid = get_json(url + "/api/grid?run=r&max_steps=8")
    cur = writer.cursor()
    try:
        direct = load_scalar_bins(cur, "r", 8).to_json()
    finally:
        cur.close()
    assert served == json.loads(page_json(direct))
    assert served["n_columns"] == len(grid["col_first_step"]) == 8
    assert served["steps_per_col"] == grid["steps_per_col"] == 5
    names = sorted({n for s in range(sr.STEPS) for n in sr.step_values(s)})
    assert served["names"] == names
    loss = served["series"]["loss"]
    assert loss["col"] == list(range(8))
    assert loss["first_step"] == grid["col_first_step"]
    values = np.array([sr.step_values(s)["loss"] for s in range(sr.STEPS)]).reshape(8, 5)
    finite = np.where(np.isfinite(values), values, np.nan)
    np.testing.assert_allclose(loss["mean"], np.nanmean(finite, axis=1), rtol=1e-12)
    assert loss["nonfinite"] == [0, 0, 0, 0, 0, 1, 1, 0]  # steps 25 (NaN) and 30 (Inf)
    assert "5 recorded steps" in served["caption"] and "NaN/Inf at 2 steps" in served["caption"]
    ppl = served["series"]["eval:ppl"]
    assert ppl["col"] == [0, 2, 4, 6] and ppl["points"] == [1, 1, 1, 1]


def test_names_range_and_runs_without_scalars(live) -> None:  # type: ignore[no-untyped-def]
    _writer, url = live
    only = get_json(url + "/api/scalars?run=r" + names_param("loss", "nope"))
    assert only["names"] == ["loss"] and only["n_columns"] == sr.STEPS
    assert only["series"]["loss"]["mean"][sr.NAN_STEP] is None  # NaN -> null in JSON
    part = get_json(url + "/api/scalars?run=r&from_step=10&to_step=19" + names_param("loss"))
    assert part["series"]["loss"]["first_step"] == list(range(10, 20))
    plain = get_json(url + "/api/scalars?run=plain")
    assert (plain["series"], plain["names"], plain["n_columns"]) == ({}, [], 10)
    assert plain["caption"] == "loss: none in the range"


def test_errors(live) -> None:  # type: ignore[no-untyped-def]
    _writer, url = live
    status, body, _ = get(url + "/api/scalars?run=nope")
    assert status == 404 and "unknown run 'nope'" in json.loads(body)["error"]
    status, body, _ = get(url + "/api/scalars?run=r&names=loss")
    assert status == 400 and "names must be a JSON list of strings" in json.loads(body)["error"]
    assert get(url + "/api/scalars")[0] == 400
    assert get(url + "/api/scalars?run=r", {"Authorization": f"Bearer {new_token()}"})[0] == 401


def test_follows_new_frames(live) -> None:  # type: ignore[no-untyped-def]
    """A frame written with its scalars (one transaction, as the sink does) shows at once,
    though answers are cached until the run's frames change."""
    writer, url = live
    before = get_json(url + "/api/scalars?run=r" + names_param("loss"))
    assert before["series"]["loss"]["last_step"][-1] == sr.STEPS - 1
    writer.begin()
    writer.execute(
        "INSERT INTO layer_stats (run_id, step, layer_index, numel, sum_abs, sum_sq, "
        "max_abs_grad, nonfinite, mean_abs_grad, grad_norm, flow_intensity, is_vanishing, "
        "is_exploding) SELECT 'r', 40, i, 100, 1, 1, 1, 0, 0.01, 1, 1, false, false "
        "FROM range(2) t(i)")
    writer.execute(
        "INSERT INTO frames (run_id, step, health, num_layers, vanishing_layers, "
        "exploding_layers, nonfinite_layers, complete, ranks_seen, missing_ranks, wall_time, "
        "finalized_at) VALUES ('r', 40, 'Healthy', 2, 0, 0, 0, true, [0, 1, 2], [], 0, 2e9)")
    writer.execute("INSERT INTO step_scalars VALUES ('r', 40, 'loss', 0.05)")
    writer.commit()
    after = get_json(url + "/api/scalars?run=r" + names_param("loss"))
    assert after["n_columns"] == sr.STEPS + 1
    assert after["series"]["loss"]["last_step"][-1] == 40
    assert math.isclose(after["series"]["loss"]["mean"][-1], 0.05)


def test_the_page_knows_the_route(live) -> None:  # type: ignore[no-untyped-def]
    _writer, url = live
    status, body, _ = get(url + "/")
    assert status == 200 and b'id="loss"' in body
    config = json.loads(body.decode().split('id="config">')[1].split("</script>")[0])
    assert config["routes"]["scalars"] == "/api/scalars"
    assert config["loss_color"].startswith("#")
