"""bench/tap_overhead.py at a tiny size: every variant runs, the tap's producer sends every
step to the real broker, and the ratio lines are finite and positive.

torch and lightning are installed by ``make test`` (requirements-frameworks.txt): a missing
one fails."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import pytest
import torch

from bench import tap_overhead

TINY = ["--d", "32", "--layers", "1", "--vocab", "64", "--batch", "2", "--context", "8",
        "--rounds", "2", "--steps", "1"]


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Give the test process its torch thread count back whatever the script does."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_tiny_run_sends_every_step_and_prints_the_ratios(
    capsys: pytest.CaptureFixture[str], torch_threads: None, kafka_bootstrap: str,
) -> None:
    assert tap_overhead.main([*TINY, "--bootstrap-servers", kafka_bootstrap]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    number = r"(-?\d+\.\d+)"
    table = re.compile(rf"(\S+)\s+{number}\s+{number}\s+{number}%\s+{number}")
    rows = {m.group(1): [float(x) for x in m.groups()[1:]]
            for m in map(table.fullmatch, lines) if m is not None}
    assert set(rows) == {"none", "floor", "tap", "lightning"}, out
    for name, (step_ms, _, _, in_hook_ms) in rows.items():
        assert step_ms > 0 and in_hook_ms >= 0, name
    assert rows["tap"][3] > 0 and rows["floor"][3] > 0
    sent = re.search(rf"producer -> {re.escape(kafka_bootstrap)}: (\d+) step summaries "
                     r"recorded, (\d+) messages acknowledged .*, (\d+) dropped, (\d+) failed "
                     r"\(binary wire\)", out)
    assert sent is not None, out
    recorded, acknowledged, dropped, failed = map(int, sent.groups())
    # 2 warm-up steps + 2 rounds x 1 step of the tap variant; RunStarted and RunFinished.
    assert recorded == 4 and acknowledged == recorded + 2 and dropped == failed == 0
    last = re.fullmatch(r"tap_ratio_to_foreach_norm_floor=(\d+\.\d\d)", lines[-1])
    assert last is not None, lines[-1]
    assert math.isfinite(float(last.group(1))) and float(last.group(1)) > 0
