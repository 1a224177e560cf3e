"""The accelerator (CUDA) path of the torch adapter, run on CPU tensors with
``emulate_device=True``: the code a GPU runs (batched ``_foreach_norm`` reductions, float32
accumulation, one stacked device->host copy, the exact recount of non-finite layers),
checked against torch's own float64 values over the full gradients."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch  # installed by `make test` (requirements-frameworks.txt): missing fails

from producer.adapters import torch_device
from producer.adapters.torch import GradientTap
from producer.adapters.torch_summary import launch_summaries, summarize_tensors
from producer.summary import LayerSummaries
from tests.producer.adapters import FakeProducer

U32 = 2.0**-24  # unit roundoff of float32


def reference(grads: dict[str, Any]) -> dict[str, np.ndarray]:
    """torch's own float64 values over the finite elements of each full gradient."""
    out: dict[str, list[float]] = {"sum_abs": [], "sum_sq": [], "max_abs": [], "nonfinite": []}
    for g in grads.values():
        wide = g.detach().to(torch.float64).reshape(-1)
        finite = torch.isfinite(wide)
        clean = wide[finite]
        out["sum_abs"].append(float(torch.linalg.vector_norm(clean, 1)))
        out["sum_sq"].append(float(torch.sum(clean * clean)))
        out["max_abs"].append(float(clean.abs().max()) if clean.numel() else 0.0)
        out["nonfinite"].append(float((~finite).sum()))
    return {k: np.asarray(v) for k, v in out.items()}


def float32_bound(numel: np.ndarray, dtype: Any) -> np.ndarray:
    """The documented relative bound: (h + 3) u with h = n - 1 for float32 accumulation,
    float64 accumulation (float64 tensors) to 1e-12."""
    if dtype == torch.float64:
        return np.full(numel.shape, 1e-12)
    return (numel + 2) * U32


def assert_within_bound(got: LayerSummaries, grads: dict[str, Any]) -> None:
    want = reference(grads)
    np.testing.assert_array_equal(got.nonfinite, want["nonfinite"].astype(np.int64))
    np.testing.assert_array_equal(got.max_abs, want["max_abs"])  # max is exact
    for i, g in enumerate(grads.values()):
        bound = float32_bound(got.numel[i : i + 1], g.dtype)[0]
        for field in ("sum_abs", "sum_sq"):
            w = want[field][i]
            assert abs(getattr(got, field)[i] - w) <= bound * w, (field, i, g.dtype)


def mixed_gradients(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (1,), (200, 50), (7, 3, 5)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.bfloat16]
    return {
        f"l{i}": (torch.randn(shape, generator=gen) * 10.0 ** (i - 2)).to(dtype)
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True))
    }


@pytest.fixture
def foreach_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float, Any, Any]]:
    """Record every torch._foreach_norm call: (tensor count, ord, input dtype, dtype=)."""
    calls: list[tuple[int, float, Any, Any]] = []
    original = torch._foreach_norm

    def counting(tensors: Any, ord_: float = 2.0, dtype: Any = None) -> Any:
        calls.append((len(tensors), float(ord_), tensors[0].dtype, dtype))
        return original(tensors, ord_, dtype=dtype)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    return calls


def test_emulated_device_path_matches_torch_float64_within_the_float32_bound(
    foreach_calls: list[tuple[int, float, Any, Any]],
) -> None:
    grads = mixed_gradients()
    got = summarize_tensors(grads, emulate_device=True)
    assert_within_bound(got, grads)
    np.testing.assert_array_equal(got.numel, [g.numel() for g in grads.values()])
    # One batched call per statistic and dtype, float32 accumulation except for float64.
    by_dtype = {torch.bfloat16: 2, torch.float32: 1, torch.float16: 1, torch.float64: 1}
    assert len(foreach_calls) == 3 * len(by_dtype)
    for count, ord_, dtype, acc in foreach_calls:
        assert count == by_dtype[dtype] and ord_ in (1.0, 2.0, math.inf)
        assert acc == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_float32_accumulation_error_is_real_and_within_the_bound() -> None:
    # 2^22 elements of 1 + 2^-10: float32 partial sums lose low bits, float64 does not.
    g = torch.full((1 << 22,), 1.0 + 2.0**-10, dtype=torch.float32)
    g[::3] = 3.0 + 2.0**-12
    got = summarize_tensors({"g": g}, emulate_device=True)
    wide = summarize_tensors({"g": g}, host_numpy=False, accumulate="float64")
    assert_within_bound(got, {"g": g})
    assert_within_bound(wide, {"g": g})
    want = reference({"g": g})
    assert abs(wide.sum_sq[0] - want["sum_sq"][0]) <= 1e-12 * want["sum_sq"][0]


def test_one_stacked_copy_per_step_and_no_other_host_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    staged: list[tuple[tuple[int, ...], Any]] = []
    original = torch_device.stage

    def counting(stats: Any, torch_: Any, emulate: bool = False) -> Any:
        staged.append((tuple(stats.shape), stats.dtype))
        return original(stats, torch_, emulate)

    monkeypatch.setattr(torch_device, "stage", counting)
    for sync in ("item", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, sync, lambda self, *a, **k: pytest.fail("host sync"))
    grads = mixed_gradients()
    pending = launch_summaries(grads, emulate_device=True)
    assert staged == [((5, 3), torch.float64)]  # every layer, every dtype: one copy
    assert pending.copies == 1 and pending.ready()
    monkeypatch.undo()
    assert_within_bound(pending.result(), grads)
    assert pending.copies == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_non_finite_layers_recounted_exactly_on_the_emulated_path(dtype: Any) -> None:
    gen = torch.Generator().manual_seed(2)
    grads = {f"l{i}": torch.randn(300, generator=gen).to(dtype) for i in range(5)}
    grads["l1"][[3, 99]] = math.nan
    grads["l2"][7] = math.inf
    grads["l2"][8] = -math.inf
    grads["l4"][:] = math.nan  # nothing finite
    pending = launch_summaries(grads, emulate_device=True)
    got = pending.result()
    assert pending.copies == 2  # the rare path: one more small copy for the recount
    assert got.nonfinite.tolist() == [0, 2, 2, 0, 300]
    assert got.sum_abs[4] == got.sum_sq[4] == got.max_abs[4] == 0.0
    assert_within_bound(got, grads)


def test_float32_overflow_recounted_in_float64_on_the_emulated_path() -> None:
    g = torch.full((4,), 1e30, dtype=torch.float32)  # g^2 overflows float32, not float64
    grads = {"big": g, "ok": torch.ones(3)}
    pending = launch_summaries(grads, emulate_device=True)
    got = pending.result()
    assert pending.copies == 2 and got.nonfinite.tolist() == [0, 0]
    v = float(np.float32(1e30))
    assert got.sum_sq[0] == pytest.approx(4 * v * v, rel=1e-12)
    assert got.max_abs[0] == np.float32(1e30)
    # the clean layer keeps its float32 value: sqrt(3) rounded to float32, then squared
    assert got.sum_sq[1] == pytest.approx(3.0, rel=5 * U32) and got.sum_sq[1] != 3.0


def test_emulated_norms_mode_runs_one_batched_reduction(
    foreach_calls: list[tuple[int, float, Any, Any]],
) -> None:
    grads = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, math.inf, 2.0])}
    got = summarize_tensors(grads, emulate_device=True, norms_only=True)
    assert got.sum_abs is None and got.max_abs is None
    assert got.sum_sq.tolist() == pytest.approx([25.0, 5.0], rel=1e-15)  # sqrt(sum g^2)^2
    assert got.nonfinite.tolist() == [0, 1]
    assert [c[1] for c in foreach_calls if c[0] == 2] == [2.0]  # one L2 call for the step


def test_deferred_emulated_read_loses_only_the_nonfinite_counts() -> None:
    grads = {"g": torch.tensor([1.0, math.nan]), "ok": torch.tensor([2.0, -2.0])}
    pending = launch_summaries(grads, emulate_device=True, keep_gradients=False)
    got = pending.result()
    assert pending.inexact == 1 and pending.copies == 1
    assert got.nonfinite.tolist() == [2, 0] and got.sum_sq[0] == 0.0
    assert got.sum_sq[1] == pytest.approx(8.0, rel=(2 + 2) * U32)  # float32 norm, squared


def _tiny_gpt(seed: int) -> Any:
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(
        nn.Embedding(50, 16),
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True),
        nn.Linear(16, 50),
    ).to(torch.bfloat16)


def test_tap_on_the_emulated_device_path_reports_the_full_gradients() -> None:
    model = _tiny_gpt(0)
    fake = FakeProducer()
    tap = GradientTap(model, fake, emulate_device=True)
    tap.start_run()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tap.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(4)
    seen = []
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        tokens = torch.randint(0, 50, (2, 6), generator=gen)
        model(tokens).float().pow(2).mean().backward()
        seen.append({n.removeprefix("module."): p.grad.clone() for n, p in
                     model.named_parameters()})
        opt.step()
    assert [s for s, _ in fake.steps] == [0, 1]
    for (_, got), grads in zip(fake.steps, seen, strict=True):
        assert got.names == tuple(grads)
        assert_within_bound(got, grads)
        np.testing.assert_array_equal(got.shard_count, np.ones(len(got), dtype=np.int64))
