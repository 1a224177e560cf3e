"""The dashboard page in headless chromium links every registered analysis's report for
the selected run and step range (the links open ``/api/analysis/<name>``). The page is
opened by its token URL; the cookie it sets lets the link's new tab in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from analysis import registry
from analysis.dashboard.server import Dashboard, DashboardServer
from analysis.read.cursors import ReadCursors
from analysis.read.sidecar import dashboard_url, new_token
from tests.analysis.crafted import write_history
from tests.chromium import chromium_page


def test_page_links_the_registered_analyses(tmp_path: Path) -> None:
    db = write_history(tmp_path / "b.duckdb", np.vstack([np.ones(8), np.arange(1.0, 9.0)]),
                       names=["a", "b"], run_id="exp/1")
    cursors = ReadCursors.open_read_only(db)
    token = new_token()
    server = DashboardServer(Dashboard(cursors, token), "127.0.0.1", 0)
    server.start()
    try:
        with chromium_page() as page:
            page.goto(dashboard_url(server.url, token))
            assert page.url == server.url + "/"  # the token left the address
            page.wait_for_selector('a.analysis[data-analysis="weights"]', timeout=15_000)
            links = page.eval_on_selector_all(
                "a.analysis", "els => els.map(e => [e.textContent, e.title])")
            assert links == [[a.name, a.help] for a in registry.all_analyses()]
            page.fill("#to-step", "3")
            page.dispatch_event("#to-step", "change")
            href = page.get_attribute('a.analysis[data-analysis="flow"]', "href")
            assert href == "/api/analysis/flow?run=exp%2F1&to_step=3"
            # Opened as the link opens it (a new tab, from the page); window.open rather
            # than a click, since each refresh of the page rebuilds the links.
            with page.context.expect_page() as opened:
                page.evaluate("href => window.open(href, '_blank', 'noopener')", href)
            tab = opened.value
            tab.wait_for_load_state()
            report = json.loads(tab.inner_text("body"))
            assert (report["run_id"], report["to_step"], report["steps"]) == ("exp/1", 3, 4)
    finally:
        server.stop()
        cursors.close()
