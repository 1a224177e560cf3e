"""Rank bodies for the parallelism tests: real ``torch.distributed`` (gloo, CPU), the real
``GradientTap`` and ``GradientProducer`` sending to the real broker.

Each rank trains a small float32 model with gradient accumulation and, right before every
``optimizer.step()``, records torch's own values of the *full* gradient the optimiser
applies (``DTensor.full_tensor()`` for sharded parameters): numel, the NaN/Inf count, and
over the finite elements mean |g| (sum |g| / numel, every element counted, as a frame's),
max |g| and the L2 norm, all in float64; plus the total norm ``clip_grad_norm_`` returns.
Rank 0 puts them on a queue for the test to compare with the store.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from producer import GradientProducer
from producer.adapters.torch import GradientTap

IN, HIDDEN, OUT = 6, 16, 4
STEPS = 3
MICRO = 2


def model(seed: int = 0) -> nn.Sequential:
    """The same float32 MLP on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch of this rank's data shard (``rank`` = the data-parallel coordinate)."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(8, IN, generator=gen), torch.randn(8, OUT, generator=gen)


def full(grad: torch.Tensor) -> torch.Tensor:
    """The whole gradient: a DTensor gathered, a plain tensor as it is."""
    gather = getattr(grad, "full_tensor", None)
    return gather() if callable(gather) else grad


def reference(names: list[str], params: list[nn.Parameter]) -> dict[str, Any]:
    """Torch's values of the full gradients and of ``clip_grad_norm_`` (collective for
    DTensors: every rank calls it)."""
    layers = {}
    for name, p in zip(names, params, strict=True):
        g = full(p.grad).detach().double()
        finite = torch.isfinite(g)
        clean = torch.where(finite, g, torch.zeros_like(g))
        layers[name] = {
            "numel": g.numel(),
            "nonfinite": int((~finite).sum()),
            "mean_abs": float(clean.abs().sum() / g.numel()),
            "max_abs": float(clean.abs().max()),
            "norm": float(torch.linalg.vector_norm(clean)),
        }
    total = nn.utils.clip_grad_norm_(params, max_norm=math.inf)
    return {"layers": layers, "total_norm": float(full(total))}


def run_rank(kind: str, rank: int, world: int, init: str, bootstrap: str, topic: str,
             run_id: str, queue: Any, options: dict[str, Any]) -> None:
    """One rank of a ``kind`` job ("ddp", "fsdp2", "hsdp", "tp").

    Options: ``nan_step`` (DDP: the last rank's input holds a NaN at this step),
    ``diverge_step`` (DDP: the last rank perturbs its all-reduced gradient at this step).
    """
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        net: nn.Module = model()
        dp_rank = rank
        if kind == "ddp":
            net = nn.parallel.DistributedDataParallel(net)
        elif kind in ("fsdp2", "hsdp"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if kind == "fsdp2":
                mesh = init_device_mesh("cpu", (world,))
            else:  # HSDP: replicate x shard
                mesh = init_device_mesh("cpu", (2, world // 2),
                                        mesh_dim_names=("replicate", "shard"))
                dp_rank = rank  # both dimensions are data parallel
            for layer in net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
        elif kind == "tp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            mesh = init_device_mesh("cpu", (world,))
            net = parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            dp_rank = 0  # every tensor-parallel rank sees the same batch
        producer = GradientProducer(run_id, rank=rank, world_size=world,
                                    bootstrap_servers=bootstrap, topic=topic)
        tap = GradientTap(net, producer)
        tap.start_run()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        if kind == "ddp":
            tap.attach_ddp(net)
        named = dict(net.named_parameters())
        names = tap.layer_names
        params = [named[raw] for raw in named if _normalised(raw) in names]
        step_no = {"step": 0}
        if options.get("diverge_step") is not None and rank == world - 1:
            def perturb(*_: Any) -> None:
                if step_no["step"] == options["diverge_step"]:
                    params[0].grad.add_(1e-3)
            optimizer.register_step_pre_hook(perturb)
        tap.attach_optimizer(optimizer)
        records: list[dict[str, Any]] = []
        optimizer.register_step_pre_hook(
            lambda *_: records.append(reference(names, params)))
        for step in range(STEPS):
            step_no["step"] = step
            for micro in range(MICRO):
                x, y = batch(step, micro, dp_rank)
                if options.get("nan_step") == step and rank == world - 1 and micro == 0:
                    x[0, 0] = math.nan
                sync = net.no_sync() if kind == "ddp" and micro < MICRO - 1 else nullcontext()
                with sync:
                    nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert producer.finish_run(timeout=60)
        producer.close()
        if rank == 0:
            queue.put({"names": names, "records": records})
    finally:
        dist.destroy_process_group()


def _normalised(raw: str) -> str:
    from producer.adapters.naming import normalize_name

    return normalize_name(raw)
