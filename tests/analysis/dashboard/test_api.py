"""The dashboard's HTTP endpoints on a store written by this process (no browser).

Requests carry the server's token as ``Authorization: Bearer`` (the access rules
themselves are tested in ``test_auth.py``)."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from analysis import registry
from analysis.dashboard.server import Dashboard, DashboardServer
from analysis.plots.grid import FLAG_EXPLODING
from analysis.read.cursors import ReadCursors
from analysis.read.sidecar import new_token
from analysis.registry import ANALYSES
from tests.analysis.crafted import Stat, StoreBuilder

NAMES = ["embed", "block", "head"]
TOKEN = new_token()
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def live(tmp_path: Path):  # type: ignore[no-untyped-def]
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("a/1", NAMES)
    builder.add_steps("a/1", range(10), {n: Stat(norm=float(i + 1)) for i, n in enumerate(NAMES)})
    store = builder.write()
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


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=AUTH | (headers or {})),
                                    timeout=10) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def get_json(url: str) -> dict:
    status, body, _ = get(url)
    assert status == 200, body
    return json.loads(body)


def add_frame(writer: duckdb.DuckDBPyConnection, step: int, norm: float, exploding: bool,
              finalized_at: float) -> None:
    """Write (or rewrite) one frame of run a/1 the way the sink does: rows and the frames
    row in one transaction."""
    writer.begin()
    writer.execute("DELETE FROM layer_stats WHERE run_id = 'a/1' AND step = ?", [step])
    writer.execute(
        "INSERT INTO layer_stats (run_id, step, layer_index, numel, sum_abs, sum_sq, "
        "max_abs_grad, nonfinite, mean_abs_grad, grad_norm, flow_intensity, is_vanishing, "
        "is_exploding) SELECT 'a/1', ?, i, 100, 1, 1, ?, 0, 0.01, ?, 1, false, ? "
        "FROM range(3) t(i)", [step, 5e3 if exploding else 1.0, norm, exploding],
    )
    writer.execute(
        "INSERT OR REPLACE INTO frames (run_id, step, health, num_layers, vanishing_layers, "
        "exploding_layers, nonfinite_layers, complete, ranks_seen, missing_ranks, wall_time, "
        "finalized_at) VALUES ('a/1', ?, 'Healthy', 3, 0, ?, 0, true, [0], [], 0, ?)",
        [step, 3 if exploding else 0, finalized_at],
    )
    writer.commit()


def test_runs_grid_layer_alerts(live) -> None:  # type: ignore[no-untyped-def]
    writer, url = live
    runs = get_json(url + "/api/runs")["runs"]
    assert [r["run_id"] for r in runs] == ["a/1"]
    assert runs[0]["health"] == "Healthy" and runs[0]["alerts"] == 0
    grid = get_json(url + "/api/grid?run=a%2F1&max_steps=4")
    assert grid["rows"] == NAMES and grid["col_first_step"] == [0, 3, 6, 9]
    assert "each column = max over 3" in grid["caption"]
    layer = get_json(url + "/api/layer?run=a%2F1&layer=2")
    assert layer["layer_name"] == "head" and layer["max_norm"] == [3.0] * 10
    writer.execute(
        "INSERT INTO alerts (alert_id, run_id, step, rule, severity, state, layers, ranks, "
        "message, created_at) VALUES ('x1', 'a/1', 4, 'exploding', 'critical', 'firing', "
        "['head'], [0], 'head exploded', 1.7e9)"
    )
    alerts = get_json(url + "/api/alerts?run=a%2F1")["alerts"]
    assert [(a["alert_id"], a["layers"], a["message"]) for a in alerts] == [
        ("x1", ["head"], "head exploded")]
    assert get_json(url + "/api/runs")["runs"][0]["alerts"] == 1
    assert get_json(url + "/api/alerts?run=other")["alerts"] == []


def test_grid_follows_new_and_rewritten_frames(live) -> None:  # type: ignore[no-untyped-def]
    writer, url = live
    first = get_json(url + "/api/grid?run=a/1")
    assert first["n_frames"] == 10
    add_frame(writer, 10, 7.0, exploding=False, finalized_at=2e9)
    grown = get_json(url + "/api/grid?run=a/1")
    assert grown["n_frames"] == 11 and grown["col_last_step"][-1] == 10
    # A late shard rewrites frame 10: same count and last step, new values.
    add_frame(writer, 10, 9.0, exploding=True, finalized_at=2e9 + 1)
    rewritten = get_json(url + "/api/grid?run=a/1")
    assert rewritten["flags"][0][-1] & FLAG_EXPLODING
    assert rewritten["log_norm"][0][-1] == pytest.approx(0.9542, abs=1e-4)


def test_exports_download(live) -> None:  # type: ignore[no-untyped-def]
    _writer, url = live
    status, body, headers = get(url + "/api/export?run=a%2F1&format=parquet&from_step=2&to_step=4")
    assert status == 200 and 'filename="a_1.parquet"' in headers["Content-Disposition"]
    table = pq.read_table(io.BytesIO(body))
    assert table.num_rows == 9 and sorted(set(table.column("step").to_pylist())) == [2, 3, 4]
    status, body, headers = get(url + "/api/export?run=a%2F1&format=csv")
    assert status == 200 and headers["Content-Type"].startswith("text/csv")
    assert body.decode().splitlines()[0].startswith("step,layer,mean_abs_grad")
    status, body, _ = get(url + "/api/export?run=a%2F1&format=jsonl&order=model&to_step=0")
    assert [json.loads(line)["layer"] for line in body.decode().splitlines()] == NAMES
    status, body, _ = get(url + "/api/export?run=a%2F1&format=xml")
    assert status == 400


def test_errors_and_page(live) -> None:  # type: ignore[no-untyped-def]
    _writer, url = live
    status, body, _ = get(url + "/api/grid?run=nope")
    assert status == 404 and "unknown run 'nope'" in json.loads(body)["error"]
    assert get(url + "/api/grid")[0] == 400
    assert get(url + "/api/grid?run=a/1&max_steps=x")[0] == 400
    assert get(url + "/api/layer?run=a/1&layer=7")[0] == 400
    assert get(url + "/api/nothing")[0] == 404
    assert get(url + "/static/../server.py")[0] == 404
    assert get(url + "/api/runs", {"Host": "attacker.example"})[0] == 403
    status, body, headers = get(url + "/")
    assert status == 200 and b'id="heatmap"' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    config = body.decode().split('id="config">')[1].split("</script>")[0]
    assert json.loads(config)["writer"] is True
    for name in ("dashboard.js", "dashboard.css", "heatmap.js"):
        assert get(url + "/static/" + name)[0] == 200


# -- the registered analyses ---------------------------------------------------------------


def test_analyses_are_listed_with_their_options(live) -> None:  # type: ignore[no-untyped-def]
    _writer, url = live
    listed = get_json(url + "/api/analyses")["analyses"]
    assert [a["name"] for a in listed] == list(ANALYSES)
    by_name = {a["name"]: a for a in listed}
    assert by_name["flow"]["help"] == registry.get("flow").help
    window = by_name["flow"]["options"]["properties"]["window"]
    assert (window["default"], window["minimum"]) == (50, 1)
    assert set(by_name["explosion"]["options"]["properties"]) == {
        "threshold", "rules", "ignore_layers"}


def test_analysis_reports_equal_the_direct_build(live) -> None:  # type: ignore[no-untyped-def]
    writer, url = live
    cur = writer.cursor()
    for name, query, values in [
        ("flow", "&window=4&color_scheme=Monochrome", {"window": 4, "color_scheme": "Monochrome"}),
        ("explosion", "&threshold=2.5&from_step=3", {"threshold": 2.5}),
        ("enhanced", "&window=5&alpha=0.05", {"window": 5, "alpha": 0.05}),
    ]:
        served = get_json(url + f"/api/analysis/{name}?run=a%2F1{query}")
        start = 3 if "from_step" in query else None
        direct = registry.get(name).run(cur, "a/1", start, None, values)
        assert served == json.loads(direct.model_dump_json()), name
    flow = get_json(url + "/api/analysis/flow?run=a/1&window=4")
    assert flow["visualization_config"]["temporal_window"] == 4
    explosion = get_json(url + "/api/analysis/explosion?run=a/1&threshold=2.5")
    assert [x["layer_name"] for x in explosion["exploding_layers"]] == ["head"]
    cur.close()


def test_analysis_errors(live) -> None:  # type: ignore[no-untyped-def]
    _writer, url = live

    def error(path: str) -> tuple[int, str]:
        status, body, _ = get(url + path)
        return status, json.loads(body)["error"]

    assert error("/api/analysis/nope?run=a/1") == (
        404, "no analysis 'nope'; registered: flow, enhanced, explosion, weights")
    assert error("/api/analysis/flow")[0] == 400
    status, message = error("/api/analysis/flow?run=zzz")
    assert status == 404 and "unknown run 'zzz'" in message
    status, message = error("/api/analysis/flow?run=a/1&window=0")
    assert status == 400 and "invalid flow options: window" in message
    status, message = error("/api/analysis/explosion?run=a/1&window=3")
    assert status == 400 and "explosion has no option window; its options: threshold" in message
    status, message = error("/api/analysis/weights?run=a/1")
    assert status == 400 and "weight_stats=True" in message
    assert error("/api/analysis/flow?run=a/1&from_step=x")[0] == 400


def test_weights_report_is_the_command_line_json(tmp_path: Path) -> None:
    """Served from a store no one writes, the weight report (which holds NaN statistics
    for a layer without finite weights) is byte-for-byte the JSON of `gradstream analyze`."""
    import numpy as np
    import typer
    from typer.testing import CliRunner

    from deploy.cli.analyze import register
    from tests.analysis.crafted import write_history

    rng = np.random.default_rng(3)
    weights = {(i, s): rng.normal(0, 1, 40) for i in range(2) for s in (0, 5)}
    weights[(2, 0)] = weights[(2, 5)] = np.full(40, np.nan)
    db = write_history(tmp_path / "w.duckdb", np.ones((3, 6)), names=["x", "y", "z"],
                       numel=[40, 40, 40], weights=weights)
    cli = typer.Typer()
    register(cli)

    @cli.callback()
    def _root() -> None:
        """test root"""

    printed = CliRunner().invoke(cli, ["analyze", "--db", str(db), "--kind", "weights",
                                       "--alpha", "0.05", "--format", "json"])
    assert printed.exit_code == 0, printed.output
    cursors = ReadCursors.open_read_only(db)
    server = DashboardServer(Dashboard(cursors, TOKEN), "127.0.0.1", 0)
    server.start()
    try:
        served = get_json(server.url + "/api/analysis/weights?run=r&alpha=0.05")
    finally:
        server.stop()
        cursors.close()
    assert served == json.loads(printed.stdout)
    z = served["distribution"]["layer_analyses"][2]["statistics"]
    assert z["count"] == 0 and z["mean"] is None and z["nonfinite"] == 40
