"""The live dashboard end to end in headless chromium while a run streams through Kafka.

Two ranks send gradient summaries of a 4-layer model step by step through the real
broker; ``ServedWorker`` (what ``gradstream serve`` runs) consumes them into a real DuckDB
file and serves the page from the same process. The browser must show the run with its
health, a heatmap that grows while steps arrive, the alert raised by the worker when a
NaN gradient is injected (and the health badge turning Critical), a layer's series on
click, and export links whose Parquet equals the stored table. The ranks send a training
loss from step ``LOSS_FROM`` on: before it the loss panel stays hidden, after it the loss
curve is drawn above the heatmap on the heatmap's step columns. A screenshot is saved and
checked non-blank.

The browser opens the token URL the process prints (``ServedWorker.dashboard_url``, as
``gradstream serve`` does); the HttpOnly, SameSite=Strict cookie it sets carries every later
request of the page, the export download included. The URL that ``gradstream demo``
prints is parsed from its console output and opened while the demo's worker serves.
"""

from __future__ import annotations

import io
import re
import threading
import time
import urllib.error
import urllib.request

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest

from analysis.read.sidecar import read_sidecar, sidecar_path
from consumer.settings import ConsumerSettings
from deploy.serve import ServedWorker
from producer import GradientProducer
from tests.chromium import chromium_page, image_stats

WORLD = 2
LAYERS = {"embed": 64, "block.0": 32, 'attn "q", k': 48, "head ünï": 16}
STEPS = 120
NAN_STEP = 70
LOSS_FROM = 60
STEP_PAUSE_S = 0.05


def gradients(step: int, rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step * 10 + rank)
    out = {
        name: rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** -(i + 1))
        for i, (name, n) in enumerate(LAYERS.items())
    }
    if step >= NAN_STEP and rank == 1:
        out["block.0"][0] = np.nan
    return out


def stream(bootstrap: str, topic: str, run_id: str, errors: list[BaseException]) -> None:
    try:
        producers = [
            GradientProducer(run_id, rank=r, world_size=WORLD, bootstrap_servers=bootstrap,
                             topic=topic)
            for r in range(WORLD)
        ]
        for p in producers:
            p.start_run({k: v * WORLD for k, v in LAYERS.items()})
        for step in range(STEPS):
            for rank, p in enumerate(producers):
                loss = {"loss": 2.0 / (1 + step) + 0.01 * rank} if step >= LOSS_FROM else {}
                p.record_step(step, gradients(step, rank), scalars=loss)
            if step % 5 == 4:
                for p in producers:
                    p.flush(10)
            time.sleep(STEP_PAUSE_S)
        for p in producers:
            p.finish_run()
            p.close()
    except BaseException as exc:  # reported by the test
        errors.append(exc)


@pytest.fixture
def settings(kafka_bootstrap, tmp_path, unique_name) -> ConsumerSettings:
    return ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"dash-{unique_name}",
        dlq_topic=f"dash-dlq-{unique_name}", alerts_topic=f"dash-alerts-{unique_name}",
        group_id=f"dash-{unique_name}", db=str(tmp_path / "live.duckdb"), shard_timeout_s=30.0,
    )


def frames_shown(page) -> int:  # type: ignore[no-untyped-def]
    return int(page.get_attribute("#heatmap", "data-frames") or 0)


def test_dashboard_live_in_chromium(settings, tmp_path, unique_name) -> None:
    run_id = f"live/{unique_name}"
    served = ServedWorker(settings, port=0, refresh_s=0.25)
    url = served.start()
    errors: list[BaseException] = []
    producer = threading.Thread(
        target=stream, args=(settings.bootstrap_servers, settings.topic, run_id, errors),
        daemon=True,
    )
    try:
        assert served.worker is not None and served.worker.wait_ready(60), served.worker.error
        with chromium_page() as page:
            refused = page.goto(url + "/")  # without the token: the page that says where it is
            assert refused is not None and refused.status == 401
            assert "gradstream serve" in page.inner_text("body")
            page.goto(served.dashboard_url)
            assert page.url == url + "/"  # the token left the address bar
            assert page.title() == "gradstream dashboard"
            (cookie,) = page.context.cookies()
            assert (cookie["value"], cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (
                served.endpoint.token, True, "Strict", "/")
            page.wait_for_selector("#status.ok", timeout=20_000)
            assert "live" in page.inner_text("#status")
            producer.start()

            # The run appears with a health badge matching the store.
            row = f'#runs li[data-run-id="{run_id}"]'
            page.wait_for_selector(row, timeout=60_000)
            page.wait_for_function("() => Number(document.querySelector('#heatmap')"
                                   ".dataset.frames) >= 5", timeout=60_000)
            early = frames_shown(page)
            # No loss yet: the panel above the heatmap stays hidden.
            last_step, hidden, points = page.evaluate(
                "() => { const h = document.querySelector('#heatmap'), "
                "l = document.querySelector('#loss'); "
                "return [Number(h.dataset.lastStep), l.hidden, l.dataset.points]; }")
            assert last_step < LOSS_FROM and hidden and points == "0"
            health = page.get_attribute(row, "data-health")
            assert health in ("Healthy", "MinorIssues", "ProblemsDetected", "Critical")
            assert page.inner_text(f"{row} .badge") == health
            assert page.get_attribute("#heatmap", "data-rows") == str(len(LAYERS))

            # The heatmap grows while the run streams (before the producer is done).
            page.wait_for_function(
                f"() => Number(document.querySelector('#heatmap').dataset.frames) >= {early + 10}",
                timeout=60_000,
            )
            assert producer.is_alive() or frames_shown(page) > early

            # The NaN injected at NAN_STEP raises the worker's non-finite alert; the run's
            # badge turns Critical.
            alert = f'#alerts li[data-run-id="{run_id}"][data-rule="nonfinite"]'
            page.wait_for_selector(alert, timeout=90_000)
            text = page.inner_text(alert)
            assert "nonfinite" in text.lower() and "block.0" in text
            page.wait_for_selector(f'{row}[data-health="Critical"]', timeout=30_000)
            assert page.inner_text(f"{row} .badge") == "Critical"

            # Drill-down: clicking the second heatmap row shows that layer's series.
            box = page.locator("#heatmap").bounding_box()
            area = page.evaluate("() => { const a = document.querySelector('#heatmap')"
                                 ".gradstreamArea; return [a.x / a.ratio, a.y / a.ratio, "
                                 "a.w / a.ratio, a.h / a.ratio]; }")
            assert box is not None
            page.mouse.click(box["x"] + area[0] + area[2] / 2,
                             box["y"] + area[1] + area[3] * 1.5 / len(LAYERS))
            page.wait_for_selector('#layer-panel[data-layer-index="1"]', timeout=10_000)
            page.wait_for_function("() => Number(document.querySelector('#series')"
                                   ".dataset.points) > 0", timeout=10_000)
            assert "block.0" in page.inner_text("#series-caption")

            # Every frame stored; the page shows all of them.
            producer.join(120)
            assert not errors, errors
            assert served.worker.wait_for_runs([run_id], 60), served.worker.error
            page.wait_for_function(
                f"() => Number(document.querySelector('#heatmap').dataset.frames) === {STEPS}",
                timeout=30_000,
            )
            # The loss curve above the heatmap: one point per column from LOSS_FROM (the
            # canvas is wider than STEPS pixels: no binning), on the heatmap's x axis.
            page.wait_for_function(
                "() => Number(document.querySelector('#loss').dataset.points) === "
                f"{STEPS - LOSS_FROM}", timeout=30_000)
            loss = page.evaluate("() => Object.assign({}, document.querySelector('#loss')"
                                 ".dataset)")
            assert (loss["firstStep"], loss["lastStep"]) == (str(LOSS_FROM), str(STEPS - 1))
            assert loss["nonfinite"] == "0"
            assert [float(loss["plotLeft"]), float(loss["plotWidth"])] == pytest.approx(
                page.evaluate("() => { const a = document.querySelector('#heatmap')"
                              ".gradstreamArea; return [a.x / a.ratio, a.w / a.ratio]; }"))
            assert "loss: the step's value" in page.inner_text("#loss-caption")
            loss_shot = tmp_path / "loss.png"
            page.locator("#loss").screenshot(path=str(loss_shot))
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            heat = tmp_path / "heatmap.png"
            page.locator("#heatmap").screenshot(path=str(heat))

            # The export link serves the run as Parquet, equal to the stored rows.
            href = page.get_attribute('a.export[data-format="parquet"]', "href")
            assert href is not None
            # Downloaded with the browser's cookie, as a click on the link does.
            download = page.context.request.get(url + href, timeout=30_000)
            assert download.status == 200, download.text()
            exported = pq.read_table(io.BytesIO(download.body()))
            with pytest.raises(urllib.error.HTTPError) as no_token:
                urllib.request.urlopen(url + href, timeout=30)
            assert no_token.value.code == 401
    finally:
        served.stop()
        producer.join(5)

    assert shot.stat().st_size > 10_000
    std, colours = image_stats(shot)
    assert std > 0.05 and colours > 50, (std, colours)
    std, colours = image_stats(heat)
    assert std > 0.02 and colours >= 4, (std, colours)
    std, colours = image_stats(loss_shot)
    assert std > 0.01 and colours >= 3, (std, colours)  # a curve on the panel

    con = duckdb.connect(settings.db, read_only=True)
    stored = con.execute(
        "SELECT s.step, l.name AS layer, s.grad_norm, s.nonfinite FROM layer_stats s "
        "JOIN layers l USING (run_id, layer_index) WHERE run_id = ? ORDER BY step, layer",
        [run_id],
    ).fetchall()
    alerts = con.execute("SELECT count(*) FROM alerts WHERE run_id = ? AND rule = 'nonfinite'",
                         [run_id]).fetchone()
    con.close()
    assert alerts is not None and alerts[0] >= 1
    rows = sorted(zip(*(exported.column(c).to_pylist()
                        for c in ("step", "layer", "grad_norm", "nonfinite")), strict=True))
    assert rows == sorted(stored)
    assert len(rows) == STEPS * len(LAYERS)


class DemoConsole(io.StringIO):
    """The demo's console output. When the line announcing the dashboard is written, the
    URL is parsed from the text as printed and opened in chromium right then: the demo's
    worker serves while the line is printed, and the demo goes on once this returns."""

    def __init__(self, db) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.db = db
        self.opened: dict[str, object] = {}

    def write(self, text: str) -> int:
        written = super().write(text)
        found = re.search(r"Live dashboard: (\S+)", self.getvalue())
        if found and not self.opened:
            self.opened["url"] = found.group(1)
            self.open(found.group(1))
        return written

    def open(self, url: str) -> None:
        info = read_sidecar(self.db)
        assert info is not None and info.command == "demo"
        assert url == f"{info.url}/?token={info.token}", url
        with chromium_page() as page:
            page.goto(url)
            self.opened["address"] = page.url
            self.opened["title"] = page.title()
            page.wait_for_selector("#status.ok", timeout=20_000)
            self.opened["status"] = page.inner_text("#status")


def test_the_demo_prints_a_url_that_opens_the_dashboard(kafka_bootstrap, tmp_path,
                                                        unique_name) -> None:
    """``gradstream demo``'s printed URL, as a user copies it from an 80-column terminal
    (one line, not wrapped), opens the live dashboard of the demo's worker."""
    from rich.console import Console
    from rich.progress import Progress

    from deploy.demo.pipeline import train_and_consume

    db = tmp_path / "demo.duckdb"
    spy = DemoConsole(db)
    console = Console(file=spy, width=80, force_terminal=False)
    run_ids = train_and_consume(console, kafka_bootstrap, db, ["healthy"], 1, 2, unique_name,
                                None, 0, Progress(console=console))
    assert spy.opened.get("title") == "gradstream dashboard", (spy.opened, spy.getvalue())
    url = str(spy.opened["url"])
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/\?token=[A-Za-z0-9_-]{43}", url), url
    assert spy.opened["address"] == url.split("?")[0]
    assert "live" in str(spy.opened["status"])
    assert run_ids == [f"demo-healthy-{unique_name}"]
    assert not sidecar_path(db).exists()  # the demo stopped serving
