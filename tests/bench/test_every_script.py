"""Every benchmark is exercised by ``make test``: a script (a ``bench/*.py`` with a
``__main__`` block) has its own ``tests/bench/test_<script>.py`` that runs it, and a helper
module of the scripts is imported by one of these tests. A new script without a smoke test
fails here."""

from __future__ import annotations

import re

from tests.bench import ROOT

BENCH = ROOT / "bench"
TESTS = ROOT / "tests" / "bench"


def test_every_bench_script_has_a_smoke_test_that_runs_it() -> None:
    scripts = sorted(p.stem for p in BENCH.glob("*.py")
                     if re.search(r'^if __name__ == "__main__":', p.read_text(), re.MULTILINE))
    assert len(scripts) >= 8
    for stem in scripts:
        test = TESTS / f"test_{stem}.py"
        assert test.exists(), f"bench/{stem}.py has no smoke test ({test} is missing)"
        text = test.read_text()
        runs = f'run_script("{stem}"' in text or f"from bench import {stem}" in text
        assert runs, f"{test.name} does not run bench/{stem}.py"


def test_every_helper_module_is_used_by_a_test() -> None:
    helpers = sorted(p.stem for p in BENCH.glob("*.py")
                     if not re.search(r'^if __name__ == "__main__":', p.read_text(),
                                      re.MULTILINE))
    tests = "\n".join(p.read_text() for p in TESTS.glob("test_*.py"))
    scripts = "\n".join(p.read_text() for p in BENCH.glob("*.py"))
    for stem in helpers:
        assert stem in tests or re.search(rf"^(from bench\.{stem} |import {stem}\b)", scripts,
                                          re.MULTILINE), f"bench/{stem}.py is used by no test"
