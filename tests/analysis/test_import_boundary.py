"""``analysis`` never imports ``consumer`` (ARCHITECTURE.md, "Layout and import rules"):
every module under ``analysis/`` is imported in a fresh interpreter, and no ``consumer``
module may end up in ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import importlib, json, sys
found = {}
for name in json.loads(sys.argv[1]):
    before = set(sys.modules)
    importlib.import_module(name)
    new = sorted(m for m in set(sys.modules) - before
                 if m == "consumer" or m.startswith("consumer."))
    if new:
        found[name] = new
print(json.dumps(found))
"""


def analysis_modules() -> list[str]:
    """Dotted names of every module and package under ``analysis/``, sorted."""
    names = []
    for path in sorted((ROOT / "analysis").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_analysis_never_imports_consumer() -> None:
    modules = analysis_modules()
    assert {"analysis", "analysis.report", "analysis.analyses.weights.load"} <= set(modules)
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    # module -> the consumer modules that first appeared when it was imported
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {}
