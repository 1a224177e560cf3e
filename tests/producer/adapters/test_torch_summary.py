"""producer.adapters.torch_summary on CPU tensors: the parallel chunked NumPy summary, float32
accumulation against its documented bound; through GradientTap, the deferred (next-step)
read (opt-in, for CUDA) and the training-thread time accounting."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
import torch  # installed by `make test` (requirements-frameworks.txt): missing fails

from producer.adapters import torch_summary
from producer.adapters.torch import GradientTap
from producer.adapters.torch_summary import launch_summaries, summarize_tensors
from producer.summary import summarize
from tests.producer.adapters import FakeProducer


def test_chunk_plan_covers_every_element_once_in_layer_order() -> None:
    sizes = (10, 3_000_000, 7, 1_000_001, 5)
    groups, starts = torch_summary._chunk_plan(sizes, 3)
    chunks = [c for g in groups for c in g]
    assert [c[0] for c in chunks] == sorted(c[0] for c in chunks)
    for layer, size in enumerate(sizes):
        mine = [c for c in chunks if c[0] == layer]
        assert chunks.index(mine[0]) == starts[layer]
        assert mine[0][1] == 0 and mine[-1][2] == size
        assert all(a[2] == b[1] for a, b in itertools.pairwise(mine))
    loads = [sum(hi - lo for _, lo, hi in g) for g in groups]
    assert max(loads) - min(loads) <= 1


def test_parallel_host_summary_equals_single_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_summary, "_PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(torch_summary, "_host_threads", lambda torch: 3)
    monkeypatch.setattr(torch_summary, "_host_timing", {})
    threaded: list[int] = []
    original = torch_summary._summarize_threads

    def counting(*args: object) -> object:
        threaded.append(1)
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_summary, "_summarize_threads", counting)
    gen = torch.Generator().manual_seed(0)
    grads = {f"l{i}": torch.randn(1000 * (i + 1), generator=gen) * 10.0**i for i in range(6)}
    grads["l2"][17] = math.nan
    grads["l4"][3] = -math.inf
    want = summarize({k: v.numpy() for k, v in grads.items()})
    for _ in range(8):  # 3 threaded, 3 single-thread (first of each untimed), the faster
        got = summarize_tensors(grads)
        np.testing.assert_array_equal(got.numel, want.numel)
        np.testing.assert_array_equal(got.nonfinite, want.nonfinite)
        np.testing.assert_array_equal(got.max_abs, want.max_abs)
        np.testing.assert_allclose(got.sum_abs, want.sum_abs, rtol=1e-12)
        np.testing.assert_allclose(got.sum_sq, want.sum_sq, rtol=1e-12)
    assert 3 <= len(threaded) <= 5
    timing = torch_summary._host_timing[tuple(g.numel() for g in grads.values())]
    assert timing[0] == 8 and math.isfinite(timing[1]) and math.isfinite(timing[2])


def test_a_modes_first_call_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first threaded call pays one-off costs; were it timed, one slow call would keep
    # the threads off for hundreds of calls.
    monkeypatch.setattr(torch_summary, "_PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(torch_summary, "_host_threads", lambda torch: 2)
    monkeypatch.setattr(torch_summary, "_host_timing", {})
    original = torch_summary._summarize_threads
    slow = [True]

    def first_call_slow(*args: object) -> object:
        if slow[0]:
            slow[0] = False
            time.sleep(0.5)
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_summary, "_summarize_threads", first_call_slow)
    grads = {"a": torch.ones(1000), "b": torch.ones(10)}
    for _ in range(3):
        summarize_tensors(grads)
    timing = torch_summary._host_timing[(1000, 10)]
    assert timing[0] == 3 and timing[1] < 0.25 and math.isinf(timing[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float32_accumulation_within_the_documented_bound(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    grads = {f"l{i}": (torch.randn(n, generator=gen) * 1e-2).to(dtype)
             for i, n in enumerate((1, 100, 50_000))}
    got = summarize_tensors(grads, host_numpy=False, accumulate="float32")
    want = summarize({k: v.float().numpy() for k, v in grads.items()})
    for i, n in enumerate(got.numel):
        bound = (n + 3) * 2.0**-24  # (h + 3) u with the worst-case height h = n - 1
        assert abs(got.sum_abs[i] - want.sum_abs[i]) <= bound * want.sum_abs[i]
        assert abs(got.sum_sq[i] - want.sum_sq[i]) <= bound * want.sum_sq[i]
    np.testing.assert_array_equal(got.max_abs, want.max_abs)  # max is exact


def test_float32_overflow_is_recounted_exactly_in_float64() -> None:
    g = torch.full((4,), 1e30, dtype=torch.float32)  # g^2 overflows float32, not float64
    got = summarize_tensors({"g": g}, host_numpy=False, accumulate="float32")
    assert got.nonfinite[0] == 0
    want = summarize({"g": g.numpy()})
    assert got.sum_sq[0] == pytest.approx(want.sum_sq[0], rel=1e-12)


def test_unknown_accumulate_rejected() -> None:
    with pytest.raises(ValueError, match="accumulate"):
        summarize_tensors({"g": torch.ones(2)}, accumulate="float16")
    with pytest.raises(ValueError, match="accumulate"):
        GradientTap(torch.nn.Linear(2, 2), FakeProducer(), accumulate="half")


def test_launch_without_gradients_marks_nonfinite_layers_inexact() -> None:
    g = torch.tensor([1.0, math.nan, 2.0])
    pending = launch_summaries({"g": g, "ok": torch.ones(2)}, host_numpy=False,
                               keep_gradients=False)
    assert pending.ready()
    s = pending.result()
    assert pending.inexact == 1
    assert s.nonfinite.tolist() == [3, 0] and s.sum_abs.tolist() == [0.0, 2.0]
    assert pending.result() is s


def _train(model: torch.nn.Module, tap: GradientTap, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tap.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 5, generator=gen)).pow(2).mean().backward()
        opt.step()


def test_deferred_tap_hands_each_step_over_at_the_next_and_on_flush() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    eager, deferred = FakeProducer(), FakeProducer()
    twin = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    twin.load_state_dict(model.state_dict())
    a = GradientTap(model, eager, host_numpy=False)
    b = GradientTap(twin, deferred, host_numpy=False, defer=True)
    a.start_run()
    b.start_run()
    _train(model, a, 3)
    _train(twin, b, 3)
    assert [s for s, _ in deferred.steps] == [0, 1]  # step 2 still waiting
    assert b.flush() is not None and b.flush() is None
    assert [s for s, _ in deferred.steps] == [0, 1, 2]
    for (_, x), (_, y) in zip(eager.steps, deferred.steps, strict=True):
        np.testing.assert_allclose(x.sum_sq, y.sum_sq, rtol=1e-12)
        np.testing.assert_array_equal(x.max_abs, y.max_abs)
        np.testing.assert_array_equal(y.shard_count, np.ones(len(y), dtype=np.int64))


def test_tap_counts_its_own_time_in_training_thread_s() -> None:
    from producer import GradientProducer

    model = torch.nn.Linear(300, 300)
    gp = GradientProducer("tap-time", bootstrap_servers="127.0.0.1:9", topic="t",
                          queue_size=4)
    try:
        tap = GradientTap(model, gp)
        tap.start_run()
        model(torch.randn(2, 300)).sum().backward()
        spent: list[float] = []
        original = gp.add_training_time
        gp.add_training_time = lambda s: (spent.append(s), original(s))  # type: ignore[method-assign]
        before = gp.stats().training_thread_s
        tap.step()
        after = gp.stats().training_thread_s
        assert len(spent) == 1 and spent[0] > 0
        assert after - before >= spent[0]
        with pytest.raises(ValueError):
            gp.add_training_time(-1.0)
    finally:
        gp.close(timeout=0.1)


class _IdlePool:
    """A pool whose threads never start (a machine too busy to schedule them)."""

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, fn: object, *args: object) -> None:
        self.submitted += 1


def _big_gradients() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {f"l{i}": torch.randn(2000 * (i + 1), generator=gen) for i in range(5)}


def test_threaded_summary_never_waits_for_a_thread_that_does_not_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = _big_gradients()
    arrays = [g.numpy() for g in grads.values()]
    sizes = tuple(a.size for a in arrays)
    idle = _IdlePool()
    monkeypatch.setattr(torch_summary, "_pool", lambda workers: idle)
    got = torch_summary._summarize_threads(arrays, sizes, 3, torch_summary._key_names(64))
    assert idle.submitted == 2  # work offered to both pool threads; none was needed
    want = summarize({k: v.numpy() for k, v in grads.items()})
    np.testing.assert_allclose(got[0], want.sum_abs, rtol=1e-12)
    np.testing.assert_allclose(got[1], want.sum_sq, rtol=1e-12)
    np.testing.assert_array_equal(got[2], want.max_abs)
    np.testing.assert_array_equal(got[3], want.nonfinite)


def test_threaded_summary_reraises_an_error_from_any_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = _big_gradients()
    arrays = [g.numpy() for g in grads.values()]
    calls: list[int] = []

    def failing_third(job: object) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("job 3")
        return summarize(job)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_summary, "summarize", failing_third)
    with pytest.raises(MemoryError, match="job 3"):
        torch_summary._summarize_threads(arrays, tuple(a.size for a in arrays), 2,
                                   torch_summary._key_names(64))
    assert len(calls) == 2 * torch_summary._CHUNKS_PER_THREAD  # the other groups still ran
