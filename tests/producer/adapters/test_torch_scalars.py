"""The torch tap's training scalars: learning rates, loss scale, the loop's loss, and the
step and compute times it measures, alone and gathered in-band from real gloo DDP ranks.

What the compute time must mean: the time a rank computes (forward and backward), not the
time it then waits for the others. A rank made slow in its forward shows a larger compute
time, while under DDP every rank's step time is the same."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from producer.adapters.torch import GradientTap
from producer.adapters.torch_scalars import StepScalars, learning_rate_names
from tests.integration.parallel_ranks import leave
from tests.producer.adapters import FakeProducer

nn = torch.nn
SLOW_S = 0.3
"""How much longer the slow rank's forward takes in the DDP test (s)."""


class Slow(nn.Module):
    """A linear layer whose forward takes at least ``delay_s`` (a slow rank)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.body(x)


def test_learning_rates_loss_scale_loss_and_times_of_each_step() -> None:
    model = Slow(0.03)
    fake = FakeProducer()
    tap = GradientTap(model, fake, reduce="off")
    tap.start_run()
    opt = torch.optim.SGD([{"params": model.body[0].parameters(), "lr": 0.1},
                           {"params": model.body[2].parameters(), "lr": 0.01}])
    tap.attach_optimizer(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    tap.attach_scaler(scaler)
    wait_s = 0.2
    for _ in range(3):
        loss = model(torch.ones(2, 4)).pow(2).mean()
        scaler.scale(loss).backward()
        tap.record_scalars(loss=loss.detach(), tokens=8)
        time.sleep(wait_s)  # after backward: waiting, not computing
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert [s for s, _, _ in fake.scalars] == [0, 1, 2]
    for step, values, _ in fake.scalars:
        assert values["lr"] == 0.1 and values["lr/1"] == 0.01
        assert values["loss_scale"] == 1024.0
        assert values["tokens"] == 8.0 and values["loss"] > 0
        if step:
            # the forward's 30 ms are computing; the 200 ms after backward are not: the
            # step time holds both, the compute time the first only (whatever the load)
            assert values["compute_time_s"] >= 0.03
            assert values["compute_time_s"] <= values["step_time_s"] - wait_s
    # the first step has no previous step to time from
    assert "step_time_s" not in fake.scalars[0][1]
    assert "compute_time_s" not in fake.scalars[0][1]
    tap.detach()


def test_names_and_errors() -> None:
    assert learning_rate_names(2) == ["lr", "lr/1"]
    with pytest.raises(ValueError, match="scalar name"):
        StepScalars([]).give({"bad name": 1.0})
    with pytest.raises(TypeError, match="real number"):
        scalars = StepScalars([])
        scalars.give({"loss": "high"})
        scalars.take(0)
    with pytest.raises(TypeError, match="GradScaler"):
        StepScalars([]).attach_scaler(object())


def _rank(rank: int, world: int, init: str, queue: Any) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = Slow(SLOW_S if rank == 1 else 0.0)
        ddp = DistributedDataParallel(model)
        fake = FakeProducer(rank=rank, world_size=world)
        tap = GradientTap(ddp, fake)  # in-band: torch.distributed runs the world
        tap.start_run()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        tap.attach_optimizer(opt)
        for _ in range(4):
            loss = ddp(torch.full((2, 4), float(rank + 1))).pow(2).mean()
            loss.backward()  # DDP's all-reduce: rank 0 waits here for the slow rank 1
            tap.record_scalars(loss=loss.detach())
            opt.step()
            opt.zero_grad()
        tap.flush()
        queue.put({"rank": rank, "scalars": [
            (step, values, None if rows is None else (
                list(rows.names), rows.rank.tolist(), rows.name_index.tolist(),
                rows.value.tolist()))
            for step, values, rows in fake.scalars]})
        dist.barrier()  # no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()
    leave(queue)


def test_in_band_gathers_every_rank_and_the_straggler_computes_longer(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, f"file://{tmp_path / 'pg'}", queue))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {r["rank"]: r for r in (queue.get(timeout=240) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert results[1]["scalars"] == []  # only rank 0 sends in-band
    sent = results[0]["scalars"]
    assert [step for step, _, _ in sent] == [0, 1, 2, 3]
    for step, values, rows in sent:
        assert values == {"lr": 0.05}  # step scalars: the sender's
        names, ranks, index, value = rows
        got = {(r, names[i]): v for r, i, v in zip(ranks, index, value, strict=True)}
        assert {r for r, _ in got} == {0, 1}
        # each rank's own loss (inputs of rank + 1)
        assert got[(0, "loss")] != got[(1, "loss")]
        if step:
            # rank 1 computes 300 ms longer; rank 0's wait for it is not compute time (if
            # it were, both would be >= 300 ms): the difference stays, whatever the load
            assert got[(1, "compute_time_s")] >= SLOW_S
            assert got[(1, "compute_time_s")] - got[(0, "compute_time_s")] >= SLOW_S / 2
            # DDP evens out the step time: both ranks take the slow rank's time
            assert got[(0, "step_time_s")] >= SLOW_S and got[(1, "step_time_s")] >= SLOW_S
