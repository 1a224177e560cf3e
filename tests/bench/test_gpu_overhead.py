"""bench/gpu_overhead.py: its CPU smoke mode runs every variant end to end against the real
broker and prints the figures it would print on a GPU; without CUDA it refuses to measure.

torch is installed by ``make test`` (requirements-frameworks.txt): a missing torch fails."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from bench import gpu_overhead


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """The smoke mode sets torch's thread count; give the test process its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_cpu_tiny_smoke_mode_prints_every_variant_and_the_summary_line(
    capsys: pytest.CaptureFixture[str], torch_threads: None, kafka_bootstrap: str,
) -> None:
    assert gpu_overhead.main(["--device", "cpu", "--tiny",
                              "--bootstrap-servers", kafka_bootstrap]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert "CPU smoke test" in out
    number = r"(-?\d+\.\d+)"
    table = re.compile(rf"(\S+)\s+{number}\s+{number}\s+{number}%\s+{number}\s+{number}")
    rows = {m.group(1): [float(x) for x in m.groups()[1:]]
            for m in map(table.fullmatch, lines) if m is not None}
    assert set(rows) >= {"none", "floor", "tap", "tap-norms"}
    for name, (step_ms, _, _, in_hook_ms, host_ms) in rows.items():
        assert step_ms > 0 and in_hook_ms >= 0 and host_ms >= 0, name
    assert rows["tap"][3] > 0 and rows["floor"][3] > 0
    assert "wandb" in rows or "wandb is not installed" in out
    # Both producers sent every tap step to the broker: RunStarted + steps + RunFinished.
    delivered = re.findall(r"(tap(?:-norms)?): (\d+) step summaries recorded, (\d+) messages "
                           r"acknowledged, (\d+) dropped, (\d+) failed", out)
    assert [d[0] for d in delivered] == ["tap", "tap-norms"], out
    for _, recorded, sent, dropped, failed in delivered:
        assert int(recorded) > 0 and int(sent) == int(recorded) + 2
        assert int(dropped) == int(failed) == 0
    last = re.fullmatch(
        r"gpu_tap_overhead_pct=(-?\d+\.\d\d) tap_ratio_to_foreach_norm_floor=(\d+\.\d\d)",
        lines[-1],
    )
    assert last is not None, lines[-1]
    assert float(last.group(2)) > 0


def test_without_cuda_it_exits_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_overhead.main([]) == 2
    out = capsys.readouterr().out
    assert "CUDA is not available" in out and "nothing measured" in out
    assert gpu_overhead.main(["--device", "cpu"]) == 2
    assert "--tiny" in capsys.readouterr().out
