"""analysis.read sits at the bottom of the analysis package: loading any of its modules
loads no other analysis module (the builders it serves are imported when a read runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_PROBE = r"""
import importlib, json, pkgutil, sys
import analysis.read as package
names = [f"analysis.read.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
for name in names:
    importlib.import_module(name)
above = sorted(m for m in sys.modules
               if m.startswith("analysis.") and not m.startswith("analysis.read"))
print(json.dumps([names, above]))
"""


def test_the_read_package_loads_nothing_above_it() -> None:
    result = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    names, above = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"analysis.read.reader", "analysis.read.routes", "analysis.read.sql"} <= set(names)
    assert above == []
