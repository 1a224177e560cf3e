"""The dashboard page in headless chromium links every registered analysis's report for
the selected run and step range (the links open ``/api/analysis/<name>``)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np

from analysis import registry
from analysis.dashboard.cursors import ReadCursors
from analysis.dashboard.server import Dashboard, DashboardServer
from tests.analysis.crafted import write_history
from tests.chromium import chromium_page


def test_page_links_the_registered_analyses(tmp_path: Path) -> None:
    db = write_history(tmp_path / "b.duckdb", np.vstack([np.ones(8), np.arange(1.0, 9.0)]),
                       names=["a", "b"], run_id="exp/1")
    cursors = ReadCursors.open_read_only(db)
    server = DashboardServer(Dashboard(cursors, "token"), "127.0.0.1", 0)
    server.start()
    try:
        with chromium_page() as page:
            page.goto(server.url + "/")
            page.wait_for_selector('a.analysis[data-analysis="weights"]', timeout=15_000)
            links = page.eval_on_selector_all(
                "a.analysis", "els => els.map(e => [e.textContent, e.title])")
            assert links == [[a.name, a.help] for a in registry.all_analyses()]
            page.fill("#to-step", "3")
            page.dispatch_event("#to-step", "change")
            href = page.get_attribute('a.analysis[data-analysis="flow"]', "href")
            assert href == "/api/analysis/flow?run=exp%2F1&to_step=3"
            with urllib.request.urlopen(server.url + href, timeout=10) as response:
                report = json.loads(response.read())
            assert (report["run_id"], report["to_step"], report["steps"]) == ("exp/1", 3, 4)
    finally:
        server.stop()
        cursors.close()
