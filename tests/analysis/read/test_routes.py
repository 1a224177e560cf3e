"""analysis.read.routes: the one route table, its parameters, and that no route path is
spelled outside it in the server or the reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from analysis.read.connect import StoreError
from analysis.read.routes import READS, ROUTES, STATIC_FILES, Param, ParamError, find

ROOT = Path(__file__).resolve().parents[3]


def test_every_read_names_its_builder_and_answer() -> None:
    assert set(READS) == {"report", "heatmap", "grid", "analysis"}
    for name, route in READS.items():
        assert route.method == "GET" and route.path.startswith("/api/"), name
        assert callable(route.builder()), name
        assert route.answer in {"model", "text", "grid"}, name
        assert route.params[0].name == "run" and route.params[0].required, name
    assert READS["report"].model_type().__name__ == "GradientFlowSummary"
    assert READS["analysis"].model_type("flow").__name__ != "GradientFlowSummary"


def test_parameters_parse_and_encode_back() -> None:
    route = READS["report"]
    query = route.query({"run": "a/1", "from_step": 3, "to_step": None,
                         "ignore_layers": ("x*",), "exclude_rounding": True})
    assert query == {"run": "a/1", "from_step": "3", "ignore_layers": '["x*"]',
                     "exclude_rounding": "true"}
    assert route.parse(query) == {"run": "a/1", "from_step": 3, "to_step": None,
                                  "ignore_layers": ("x*",), "exclude_rounding": True,
                                  "order": "model", "nonfinite_rule": "critical"}
    with pytest.raises(ParamError, match="the run parameter is required"):
        route.parse({})
    with pytest.raises(ParamError, match="from_step must be an integer, got 'x'"):
        route.parse({"run": "r", "from_step": "x"})
    with pytest.raises(ParamError, match="ignore_layers must be a JSON list"):
        route.parse({"run": "r", "ignore_layers": "x"})
    bounded = Param("max_steps", bounds=(1, 8))
    assert (bounded.parse("0"), bounded.parse("99")) == (1, 8)
    with pytest.raises(StoreError, match="max_steps must be >= 1, got 0"):
        bounded.encode(0)
    analysis = READS["analysis"]
    assert analysis.parse({"run": "r", "window": "4", "timeout_s": "2"})["options"] == {
        "window": "4"}
    assert analysis.url("a b") == "/api/analysis/a%20b"


def test_paths_match_one_segment() -> None:
    assert [r.handler for r, _ in find("/static/dashboard.js")] == ["_static"]
    assert find("/static/a/b") == [] and find("/static/") == []
    assert [name for _, name in find("/api/analysis/flow")] == ["flow"]
    assert set(STATIC_FILES) == {"dashboard.js", "dashboard.css", "heatmap.js"}


def test_no_route_path_is_spelled_twice() -> None:
    """The server and the reader take every path from the table."""
    paths = {route.path for route in ROUTES if route.path.startswith("/api/")}
    for module in ("analysis/dashboard/server.py", "analysis/read/reader.py"):
        code = (ROOT / module).read_text(encoding="utf-8")
        spelled = set(re.findall(r"[\"'](/api/[a-z/{}]+)", code))
        assert not spelled & paths, (module, spelled & paths)
