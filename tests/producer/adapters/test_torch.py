"""GradientTap and summarize_tensors against real PyTorch (CPU).

Reference values come from ``producer.summary.summarize`` over the same gradients as NumPy
arrays; sums must agree to 1e-9 relative, counts and maxima exactly.
"""

from __future__ import annotations

import math
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from producer.adapters.torch import GradientTap
from producer.adapters.torch_layout import gradient_piece
from producer.adapters.torch_summary import summarize_tensors
from producer.summary import LayerSummaries, summarize
from tests.integration.parallel_ranks import leave
from tests.producer.adapters import FakeProducer, FakeSettings

nn = torch.nn

REL = 1e-9


def assert_same(got: LayerSummaries, want: LayerSummaries) -> None:
    assert got.names == want.names
    np.testing.assert_array_equal(got.numel, want.numel)
    np.testing.assert_array_equal(got.nonfinite, want.nonfinite)
    np.testing.assert_allclose(got.sum_abs, want.sum_abs, rtol=REL, atol=0)
    np.testing.assert_allclose(got.sum_sq, want.sum_sq, rtol=REL, atol=0)
    np.testing.assert_array_equal(got.max_abs, want.max_abs)
    if got.nan is not None and want.nan is not None:  # the NaN among the non-finite
        np.testing.assert_array_equal(got.nan, want.nan)
    for arr in (got.sum_abs, got.sum_sq, got.max_abs):
        assert arr.dtype == np.float64
    for arr in (got.numel, got.nonfinite):
        assert arr.dtype == np.int64


def grads_of(model: nn.Module, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """The model's current .grad as NumPy copies, keyed like the tap (DDP prefix removed)."""
    out = {}
    for raw, p in model.named_parameters():
        name = raw.removeprefix("module.").removeprefix("_orig_mod.")
        if p.grad is not None and (names is None or name in names):
            out[name] = p.grad.detach().cpu().numpy().copy()
    return out


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def train(model: nn.Module, optimizer: Any, steps: int, micro: int = 1, seed: int = 1,
          before_step: Any = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(micro):
            x = torch.randn(8, 6, generator=gen)
            y = torch.randn(8, 3, generator=gen)
            (nn.functional.mse_loss(model(x), y) / micro).backward()
        if before_step is not None:
            before_step()
        optimizer.step()


# -- summarize_tensors -------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    arrays(
        st.sampled_from([np.float16, np.float32, np.float64]),
        st.integers(1, 300),
        elements=st.one_of(
            st.floats(-1e4, 1e4, width=16),
            st.floats(allow_nan=True, allow_infinity=True, width=16),
        ),
    )
)
def test_summarize_tensors_matches_numpy(values: np.ndarray) -> None:
    want = summarize({"g": values})
    assert_same(summarize_tensors({"g": torch.from_numpy(values)}, host_numpy=False), want)
    assert_same(summarize_tensors({"g": torch.from_numpy(values)}), want)


@settings(max_examples=100, deadline=None)
@given(
    arrays(
        np.float64, st.integers(1, 50),
        elements=st.floats(allow_nan=True, allow_infinity=True, width=64),
    )
)
def test_summarize_tensors_float64_extremes_overflow_like_numpy(values: np.ndarray) -> None:
    want = summarize({"g": values})
    assert_same(summarize_tensors({"g": torch.from_numpy(values)}, host_numpy=False), want)


@pytest.mark.parametrize("host_numpy", [False, True])
def test_nan_inf_counted_and_left_out(host_numpy: bool) -> None:
    g = torch.tensor([[1.0, -2.0], [math.nan, math.inf], [-math.inf, 0.5]])
    s = summarize_tensors({"w": g, "ok": torch.ones(3)}, host_numpy=host_numpy)
    assert s.numel.tolist() == [6, 3] and s.nonfinite.tolist() == [3, 0]
    assert s.sum_abs.tolist() == [3.5, 3.0]
    assert s.sum_sq.tolist() == pytest.approx([5.25, 3.0], rel=1e-15)  # sqrt(sum g^2)^2
    assert s.max_abs.tolist() == [2.0, 1.0]
    bad = summarize_tensors({"all": torch.full((4,), math.nan)}, host_numpy=host_numpy)
    assert bad.nonfinite[0] == 4 and bad.sum_abs[0] == bad.sum_sq[0] == bad.max_abs[0] == 0.0


def test_bfloat16_accumulates_in_float64() -> None:
    torch.manual_seed(0)
    g = (torch.randn(10_000) * 1e-3).to(torch.bfloat16)
    want = summarize({"g": g.float().numpy()})
    assert_same(summarize_tensors({"g": g}), want)
    assert_same(summarize_tensors({"g": g}, host_numpy=False), want)


def test_sparse_gradient_summarised_like_its_dense_form() -> None:
    emb = nn.Embedding(50, 4, sparse=True)
    emb(torch.tensor([[1, 2, 2, 7], [7, 7, 3, 1]])).pow(3).sum().backward()
    assert emb.weight.grad.is_sparse
    dense = emb.weight.grad.to_dense().numpy()
    want = summarize({"e": dense})
    assert_same(summarize_tensors({"e": emb.weight.grad}), want)
    assert_same(summarize_tensors({"e": emb.weight.grad}, host_numpy=False), want)


def test_one_host_transfer_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    original = torch.Tensor.cpu

    def counting_cpu(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("item() syncs"))
    grads = {f"l{i}": torch.randn(100 + i) for i in range(40)}
    summarize_tensors(grads, host_numpy=False)  # the accelerator path, on the CPU here
    assert calls == [(40, 3)]  # one small float64 tensor: 3 statistics x 40 layers
    calls.clear()
    grads["l7"][3] = math.nan
    s = summarize_tensors(grads, host_numpy=False)
    assert calls == [(40, 3), (1, 5)]  # the rare NaN/Inf case: one more for that layer
    assert s.nonfinite.tolist() == [0] * 7 + [1] + [0] * 32
    assert s.nan is not None and s.nan.tolist() == [0] * 7 + [1] + [0] * 32
    grads["l9"][0] = -math.inf  # an Inf counts as non-finite, not as NaN
    s = summarize_tensors(grads, host_numpy=False)
    assert s.nonfinite[9] == 1 and s.nan is not None and s.nan[9] == 0
    assert_same(summarize_tensors(grads), s)
    grads["l9"][0] = 1.0
    s = summarize_tensors(grads, host_numpy=False)
    calls.clear()
    assert_same(summarize_tensors(grads), s)  # CPU default: NumPy views, no copy at all
    assert calls == []


def test_summarize_tensors_errors() -> None:
    with pytest.raises(ValueError, match="empty mapping"):
        summarize_tensors({})
    with pytest.raises(ValueError, match=r"'z'.*empty"):
        summarize_tensors({"z": torch.ones(0)})
    with pytest.raises(TypeError, match=r"'i'.*int64"):
        summarize_tensors({"i": torch.ones(3, dtype=torch.int64)})
    with pytest.raises(TypeError, match=r"'n'.*ndarray"):
        summarize_tensors({"n": np.ones(3)})  # type: ignore[dict-item]


# -- GradientTap -----------------------------------------------------------------------


@pytest.mark.parametrize("host_numpy", [False, True])
def test_gradient_accumulation_gives_one_summary_per_optimizer_step(host_numpy: bool) -> None:
    model = mlp()
    fake = FakeProducer()
    tap = GradientTap(model, fake, host_numpy=host_numpy)
    tap.start_run(exploding_threshold=10.0, config={"lr": 0.1})
    assert fake.layer_numel == {
        "0.weight": 96, "0.bias": 16, "2.weight": 256, "2.bias": 16, "4.weight": 48, "4.bias": 3
    }
    assert fake.start_kwargs["exploding_threshold"] == 10.0
    assert fake.start_kwargs["config"] == {"lr": 0.1}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tap.attach_optimizer(opt)
    expected: list[LayerSummaries] = []
    train(model, opt, steps=3, micro=4, before_step=lambda: expected.append(
        summarize(grads_of(model))))
    assert [step for step, _ in fake.steps] == [0, 1, 2]
    for (_, got), want in zip(fake.steps, expected, strict=True):
        assert_same(got, want)
    assert tap.steps_recorded == 3 and tap.skipped_without_grad == 0 and tap.next_step == 3


@pytest.mark.parametrize("as_keyword", [False, True])
def test_closure_optimizer_summarised_after_the_closure_computes_gradients(
    as_keyword: bool,
) -> None:
    model = mlp()
    reference = mlp()  # same initial weights: its gradient is what step 0 must report
    gen = torch.Generator().manual_seed(9)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    nn.functional.mse_loss(reference(x), y).backward()
    want = summarize(grads_of(reference))

    fake = FakeProducer()
    tap = GradientTap(model, fake)
    tap.start_run()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=5)
    tap.attach_optimizer(opt)
    calls = []

    def closure() -> Any:
        calls.append(1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(2):
        if as_keyword:
            opt.step(closure=closure)
        else:
            opt.step(closure)
    assert len(calls) > 2  # LBFGS evaluates the closure several times per step
    assert [s for s, _ in fake.steps] == [0, 1]  # still one summary per step
    assert_same(fake.steps[0][1], want)


def test_ddp_style_wrapper_names_are_normalised() -> None:
    class Wrapper(nn.Module):  # what DistributedDataParallel / DataParallel look like
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, x: Any) -> Any:
            return self.module(x)

    plain_names = [n for n, _ in mlp().named_parameters()]
    model = Wrapper(mlp())
    assert next(iter(dict(model.named_parameters()))) == "module.0.weight"
    fake = FakeProducer()
    tap = GradientTap(model, fake)
    tap.start_run()
    assert list(fake.layer_numel or {}) == plain_names
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tap.attach_optimizer(opt)
    expected: list[LayerSummaries] = []
    train(model, opt, steps=2, before_step=lambda: expected.append(summarize(grads_of(model))))
    for (_, got), want in zip(fake.steps, expected, strict=True):
        assert_same(got, want)


def test_torch_compile_prefix_is_normalised() -> None:
    base = mlp()
    model = torch.compile(base, backend="eager")
    assert next(iter(dict(model.named_parameters()))) == "_orig_mod.0.weight"
    fake = FakeProducer()
    tap = GradientTap(model, fake)
    tap.start_run()
    assert list(fake.layer_numel or {}) == [n for n, _ in base.named_parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tap.attach_optimizer(opt)
    expected: list[LayerSummaries] = []
    train(model, opt, steps=2, before_step=lambda: expected.append(summarize(grads_of(base))))
    assert len(fake.steps) == 2
    for (_, got), want in zip(fake.steps, expected, strict=True):
        assert_same(got, want)


def test_real_ddp_single_process(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1
    )
    try:
        model = nn.parallel.DistributedDataParallel(mlp())
        assert next(iter(dict(model.named_parameters()))) == "module.0.weight"
        fake = FakeProducer()
        tap = GradientTap(model, fake)
        tap.start_run()
        assert list(fake.layer_numel or {}) == [n for n, _ in mlp().named_parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tap.attach_optimizer(opt)
        expected: list[LayerSummaries] = []
        train(model, opt, steps=2, micro=2,
              before_step=lambda: expected.append(summarize(grads_of(model))))
        assert [s for s, _ in fake.steps] == [0, 1]
        for (_, got), want in zip(fake.steps, expected, strict=True):
            assert_same(got, want)
        dist.barrier()  # no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()


def test_frozen_parameter_listed_then_picked_up_when_unfrozen() -> None:
    model = mlp()
    model[0].weight.requires_grad_(False)
    fake = FakeProducer()
    tap = GradientTap(model, fake)
    tap.start_run()
    assert "0.weight" in (fake.layer_numel or {})  # frozen at attach time, still listed
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tap.attach_optimizer(opt)
    train(model, opt, steps=1)
    assert "0.weight" not in fake.steps[0][1].names
    assert tap.skipped_without_grad == 1
    model[0].weight.requires_grad_(True)
    expected: list[LayerSummaries] = []
    train(model, opt, steps=1, before_step=lambda: expected.append(summarize(grads_of(model))))
    step, got = fake.steps[1]
    assert step == 1 and got.names[0] == "0.weight"
    assert_same(got, expected[0])
    assert tap.skipped_without_grad == 1


def test_parameters_without_grad_are_skipped_and_counted() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(6, 4)
            self.used = nn.Linear(4, 3)
            self.unused = nn.Linear(4, 3)  # never in the graph: .grad stays None

        def forward(self, x: Any) -> Any:
            return self.used(self.body(x))

    model = TwoHeads()
    fake = FakeProducer()
    tap = GradientTap(model, fake)
    tap.start_run()
    assert list(fake.layer_numel or {}) == [
        "body.weight", "body.bias", "used.weight", "used.bias", "unused.weight", "unused.bias"
    ]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tap.attach_optimizer(opt)
    expected: list[LayerSummaries] = []
    train(model, opt, steps=3, before_step=lambda: expected.append(summarize(grads_of(model))))
    assert tap.skipped_without_grad == 2 * 3
    for (_, got), want in zip(fake.steps, expected, strict=True):
        assert got.names == ("body.weight", "body.bias", "used.weight", "used.bias")
        assert_same(got, want)


def test_no_gradient_at_all_sends_nothing() -> None:
    model = mlp()
    fake = FakeProducer()
    tap = GradientTap(model, fake)
    tap.start_run()
    assert tap.step() is None
    assert fake.steps == [] and tap.steps_without_gradients == 1
    assert tap.skipped_without_grad == 6 and tap.next_step == 1


def test_include_exclude_globs_on_normalised_names() -> None:
    model = nn.Sequential(mlp())  # names "0.0.weight", ...
    fake = FakeProducer()
    tap = GradientTap(model, fake, include=["0.2.*", "0.4.*"], exclude="*.bias")
    tap.start_run()
    assert list(fake.layer_numel or {}) == ["0.2.weight", "0.4.weight"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tap.attach_optimizer(opt)
    expected: list[LayerSummaries] = []
    train(model, opt, steps=2, before_step=lambda: expected.append(
        summarize({n.removeprefix("module."): g for n, g in grads_of(model).items()
                   if n in ("0.2.weight", "0.4.weight")})))
    for (_, got), want in zip(fake.steps, expected, strict=True):
        assert_same(got, want)
    with pytest.raises(ValueError, match="no parameters selected"):
        GradientTap(model, fake, include="nothing.*")


def test_producer_selection_settings_are_honoured() -> None:
    fake = FakeProducer(settings=FakeSettings(include=["2.*", "4.*"], exclude=["*.weight"]))
    tap = GradientTap(mlp(), fake, exclude="4.*")
    assert tap.layer_names == ["2.bias"]


@pytest.mark.parametrize(
    ("tap_n", "producer_n", "sent"),
    [(1, 1, [0, 1, 2, 3, 4, 5, 6]), (3, 1, [0, 3, 6]), (None, 2, [0, 2, 4, 6]),
     (3, 2, [0, 6]), (None, 1, [0, 1, 2, 3, 4, 5, 6])],
)
def test_every_n_steps(tap_n: int | None, producer_n: int, sent: list[int]) -> None:
    model = mlp()
    fake = FakeProducer(settings=FakeSettings(every_n_steps=producer_n))
    tap = GradientTap(model, fake, every_n_steps=tap_n)
    tap.start_run()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tap.attach_optimizer(opt)
    train(model, opt, steps=7)
    assert [s for s, _ in fake.steps] == sent
    assert tap.next_step == 7 and tap.steps_recorded == len(sent)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        GradientTap(mlp(), FakeProducer(), every_n_steps=0)
    with pytest.raises(TypeError, match="int"):
        GradientTap(mlp(), FakeProducer(), every_n_steps=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        GradientTap(object(), FakeProducer())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="register_step_pre_hook"):
        GradientTap(mlp(), FakeProducer()).attach_optimizer(object())  # type: ignore[arg-type]


def test_manual_step_numbers_and_detach() -> None:
    model = mlp()
    fake = FakeProducer()
    tap = GradientTap(model, fake)
    tap.start_run()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tap.attach_optimizer(opt)
    train(model, opt, steps=1)
    tap.detach()
    train(model, opt, steps=1)
    assert [s for s, _ in fake.steps] == [0]
    summaries = tap.step(step=10)
    assert summaries is fake.steps[-1][1] and tap.next_step == 11
    tap.step()
    assert [s for s, _ in fake.steps] == [0, 10, 11]
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="step"):
            tap.step(bad)  # type: ignore[arg-type]


def test_shared_parameters_listed_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    tap = GradientTap(Tied(), FakeProducer())
    assert tap.layer_numel() == {"embed.weight": 40}


def test_name_collision_needs_name_fn() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.module = nn.Module()
            self.module.a = nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"both normalise to 'a\.weight'"):
        GradientTap(Odd(), FakeProducer())
    tap = GradientTap(Odd(), FakeProducer(), name_fn=lambda n: n)
    assert tap.layer_names == ["a.weight", "a.bias", "module.a.weight", "module.a.bias"]


def test_record_errors_propagate_before_start_run() -> None:
    from producer import GradientProducer

    model = mlp()
    producer = GradientProducer("adapters-no-start", bootstrap_servers="127.0.0.1:9")
    try:
        tap = GradientTap(model, producer)
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1)
        with pytest.raises(RuntimeError, match="start_run"):
            tap.step()
    finally:
        producer.close(timeout=0.1)


# -- DTensor / FSDP2 across two processes ----------------------------------------------


def _refuses(dtensor: Any) -> str:
    try:
        summarize_tensors({"d": dtensor})
    except TypeError as exc:
        return str(exc)
    return ""


def _fsdp_rank(rank: int, world: int, init: str, queue: Any) -> None:
    """One rank of a 2-process FSDP2 (fully_shard) job on CPU/gloo."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = mlp()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        fake = FakeProducer(rank=rank, world_size=world)
        tap = GradientTap(model, fake, reduce="off")  # each rank's own pieces
        tap.start_run()
        gen = torch.Generator().manual_seed(5)  # the same batch on both ranks
        nn.functional.mse_loss(model(torch.randn(8, 6, generator=gen)),
                               torch.randn(8, 3, generator=gen)).backward()
        tap.step()
        _, s = fake.steps[0]
        mesh = init_device_mesh("cpu", (world,))
        replicated = distribute_tensor(torch.ones(3), mesh, [Replicate()])
        partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        queue.put({
            "rank": rank,
            "layer_numel": fake.layer_numel,
            "names": s.names,
            "numel": s.numel.tolist(),
            "sum_abs": s.sum_abs.tolist(),
            "sum_sq": s.sum_sq.tolist(),
            "max_abs": s.max_abs.tolist(),
            "nonfinite": s.nonfinite.tolist(),
            "layout": (s.shard_index.tolist(), s.shard_count.tolist()),
            "replica_piece": gradient_piece(replicated)[1:],  # type: ignore[index]
            "partial_reported": gradient_piece(partial) is not None,
            "dtensor_refused": _refuses(replicated),
        })
        dist.barrier()  # no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()
    leave(queue)


def test_fsdp2_shards_merge_to_full_tensor_statistics(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'pg'}"
    procs = [ctx.Process(target=_fsdp_rank, args=(r, 2, init, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted((queue.get(timeout=240) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)

    reference = mlp()  # the same model and batch in one process, no sharding
    gen = torch.Generator().manual_seed(5)
    nn.functional.mse_loss(reference(torch.randn(8, 6, generator=gen)),
                           torch.randn(8, 3, generator=gen)).backward()
    want = summarize(grads_of(reference))
    full_numel = {n: p.numel() for n, p in reference.named_parameters()}
    for r in results:
        assert r["layer_numel"] == full_numel  # start_run announces full sizes on every rank
        assert list(r["names"]) == list(want.names)
    # Merge the way the consumer does: numel/sums/counts add, max takes the max.
    numel = np.add(results[0]["numel"], results[1]["numel"])
    assert (np.asarray(results[0]["numel"]) < want.numel).all()  # really sharded
    np.testing.assert_array_equal(numel, want.numel)
    for key, merge in (("sum_abs", np.add), ("sum_sq", np.add), ("max_abs", np.maximum)):
        merged = merge(results[0][key], results[1][key])
        np.testing.assert_allclose(merged, getattr(want, key), rtol=1e-6)  # float32 all-reduce
    # Every layer is cut in 2 pieces (Shard(0) on a 1-D mesh of 2): rank r holds piece r.
    for r in results:
        n = len(r["names"])
        assert r["layout"] == ([r["rank"]] * n, [2] * n)
    assert [r["replica_piece"] for r in results] == [(0, 1), (0, 1)]  # replicas: one piece
    assert [r["partial_reported"] for r in results] == [False, False]
    assert all("DTensor" in r["dtensor_refused"] for r in results)


# -- the real GradientProducer through a real Kafka broker -------------------------------


def test_tap_through_real_gradient_producer_and_kafka(
    kafka_bootstrap: str, unique_name: str
) -> None:
    from kafka import KafkaConsumer

    from producer import GradientProducer
    from schemas.wire import RunFinished, RunStarted, StepSummary, decode_message

    topic = f"adapters-{unique_name}"
    run_id = f"tap-{unique_name}"
    model = nn.Sequential(nn.Identity(), mlp())  # names "1.0.weight", ...
    expected: list[LayerSummaries] = []
    with GradientProducer(run_id, bootstrap_servers=kafka_bootstrap, topic=topic) as producer:
        tap = GradientTap(model, producer, exclude="1.4.*")
        tap.start_run(config={"test": "adapters"})
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        tap.attach_optimizer(opt)
        train(model, opt, steps=3, micro=2, before_step=lambda: expected.append(
            summarize({n: g for n, g in grads_of(model).items() if not n.startswith("1.4.")})))
        assert producer.finish_run(timeout=60)
        stats = producer.stats()
    assert stats.recorded == 3 and stats.dropped == 0 and stats.failed == 0

    consumer = KafkaConsumer(topic, bootstrap_servers=kafka_bootstrap,
                             auto_offset_reset="earliest", consumer_timeout_ms=30_000)
    messages: list[Any] = []
    for record in consumer:
        messages.append(decode_message(record.value))
        if isinstance(messages[-1], RunFinished):
            break
    consumer.close()
    assert isinstance(messages[0], RunStarted) and isinstance(messages[-1], RunFinished)
    started = messages[0]
    assert started.layer_names == ["1.0.weight", "1.0.bias", "1.2.weight", "1.2.bias"]
    assert started.numel == [96, 16, 256, 16]
    steps = [m for m in messages if isinstance(m, StepSummary)]
    assert [m.step for m in steps] == [0, 1, 2]
    for message, want in zip(steps, expected, strict=True):
        np.testing.assert_array_equal(message.layer_indices, [0, 1, 2, 3])
        got = LayerSummaries(
            tuple(started.layer_names[i] for i in message.layer_indices),
            np.asarray(message.numel, dtype=np.int64),
            np.asarray(message.sum_abs), np.asarray(message.sum_sq),
            np.asarray(message.max_abs), np.asarray(message.nonfinite, dtype=np.int64),
        )
        assert_same(got, want)


@pytest.mark.parametrize("host_numpy", [True, False])
def test_norms_mode_sends_only_the_norm_and_nonfinite(host_numpy: bool) -> None:
    g = torch.tensor([3.0, -4.0, float("nan"), 0.0])
    got = summarize_tensors({"g": g}, host_numpy=host_numpy, norms_only=True)
    assert got.sum_abs is None and got.max_abs is None
    assert got.sum_sq.tolist() == pytest.approx([25.0], rel=1e-12)
    assert got.nonfinite.tolist() == [1]
    clean = summarize_tensors({"g": torch.tensor([1.0, 2.0])}, host_numpy=host_numpy,
                              norms_only=True)
    assert clean.sum_sq.tolist() == pytest.approx([5.0], rel=1e-12)
    assert clean.nonfinite.tolist() == [0]


def test_tap_follows_the_producers_norms_mode() -> None:
    model = mlp()
    producer = FakeProducer(settings=FakeSettings(mode="norms"))
    tap = GradientTap(model, producer)
    tap.start_run()
    model(torch.ones(2, 6)).sum().backward()
    tap.step(0)
    (_, summaries), = producer.steps
    assert summaries.sum_abs is None and summaries.max_abs is None
    assert (summaries.sum_sq > 0).all()
