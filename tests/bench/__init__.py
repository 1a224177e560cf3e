"""Tests of the benchmark scripts: each script's real main path at tiny sizes, as
``python bench/NAME.py ...`` is run (a fresh interpreter from the repository root), with
its printed figures checked."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, bootstrap: str | None = None,
               timeout: float = 300) -> str:
    """Run ``python bench/<name>.py ARGS`` from the repository root and return its stdout.

    Args:
        name: the script's file name without ``.py``.
        args: its command-line arguments.
        bootstrap: the broker to use (``KAFKA_BOOTSTRAP_SERVERS`` in the script's
            environment); None leaves the variable as the test process has it.
        timeout: seconds before the run is killed (``subprocess.TimeoutExpired``).

    Raises:
        AssertionError: the script exited with a non-zero status (its output attached).
    """
    env = dict(os.environ)
    if bootstrap is not None:
        env["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    done = subprocess.run([sys.executable, f"bench/{name}.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"bench/{name}.py exited with {done.returncode}\n--- stdout\n{done.stdout[-4000:]}"
        f"\n--- stderr\n{done.stderr[-4000:]}")
    return done.stdout


def finite_positive(text: str) -> float:
    """``float(text)``, asserted finite and > 0."""
    value = float(text)
    assert math.isfinite(value) and value > 0, text
    return value


def key_values(line: str) -> dict[str, str]:
    """The ``name=value`` pairs of one printed line."""
    return dict(part.split("=", 1) for part in line.split() if "=" in part)
