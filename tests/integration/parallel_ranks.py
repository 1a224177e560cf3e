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
import os
import sys
from contextlib import nullcontext
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from producer import GradientProducer
from producer.adapters.torch import GradientTap

IN, HIDDEN, OUT = 6, 16, 4
STEPS = 3
MICRO = 2


def leave(queue: Any) -> NoReturn:
    """End a spawned rank that did all its work: flush ``queue``, then exit 0 at once.

    A gloo process group can abort the interpreter's own shutdown after
    ``destroy_process_group`` ("terminate called without an active exception": one of
    gloo's C++ worker threads still joinable while Python finalises), which turns a rank
    that finished into a random nonzero exit code. A rank calls this only after its work
    and the teardown returned, so a rank that raised still exits nonzero.
    """
    queue.close()
    queue.join_thread()  # everything put on the queue is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


def values(grad: torch.Tensor) -> dict[str, Any]:
    """Torch's values of one full gradient, in float64 (see the module docstring)."""
    g = grad.detach().double()
    finite = torch.isfinite(g)
    clean = torch.where(finite, g, torch.zeros_like(g))
    return {
        "numel": g.numel(),
        "nonfinite": int((~finite).sum()),
        "mean_abs": float(clean.abs().sum() / g.numel()),
        "max_abs": float(clean.abs().max()),
        "norm": float(torch.linalg.vector_norm(clean)),
    }


def reference(names: list[str], params: list[nn.Parameter]) -> dict[str, Any]:
    """Torch's values of the full gradients and of ``clip_grad_norm_`` (collective for
    DTensors: every rank calls it)."""
    layers = {name: values(full(p.grad)) for name, p in zip(names, params, strict=True)}
    total = nn.utils.clip_grad_norm_(params, max_norm=math.inf)
    return {"layers": layers, "total_norm": float(full(total))}


def fsdp1_full_gradients(net: nn.Module) -> dict[str, torch.Tensor]:
    """Torch's full gradient of every original parameter of an FSDP v1 model, by
    normalised name (collective: every rank calls it). ``use_orig_params=True``:
    ``summon_full_params(with_grads=True)``; flat parameters: each unit's sharded flat
    gradient all-gathered, its padding cut off and split by the flat parameter's own
    per-parameter sizes (``_numels``, in ``_param_infos`` order)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = [u for u in FullyShardedDataParallel.fsdp_modules(net) if u._handle is not None]
    if units[0]._handle._use_orig_params:
        with FullyShardedDataParallel.summon_full_params(net, with_grads=True, writeback=False):
            return {_normalised(n): p.grad.detach().clone()
                    for n, p in net.named_parameters()}
    paths = {id(m): p for p, m in net.named_modules()}
    out = {}
    for unit in units:
        flat = unit._handle.flat_param
        parts = [torch.empty_like(flat.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, flat.grad.contiguous())
        whole = torch.cat(parts)[: flat._unpadded_unsharded_size.numel()]
        for info, piece in zip(flat._param_infos, torch.split(whole, list(flat._numels)),
                               strict=True):
            out[_normalised(f"{paths[id(info.module)]}.{info.param_name}")] = piece.clone()
    return out


def fsdp1_reference(net: nn.Module, names: list[str]) -> dict[str, Any]:
    """:func:`reference` for an FSDP v1 model: the original parameters' full gradients and
    the total norm FSDP's own ``clip_grad_norm_`` returns (collective)."""
    grads = fsdp1_full_gradients(net)
    layers = {name: values(grads[name]) for name in names}
    return {"layers": layers, "total_norm": float(net.clip_grad_norm_(math.inf))}


def run_rank(kind: str, rank: int, world: int, init: str, bootstrap: str, topic: str,
             run_id: str, queue: Any, options: dict[str, Any]) -> None:
    """One rank of a ``kind`` job ("ddp", "fsdp2", "hsdp", "tp", "fsdp1_orig",
    "fsdp1_flat": FSDP v1 with ``use_orig_params`` True / False, the last Linear a nested
    unit and the root unit's flat parameter holding the first).

    Options: ``nan_step`` (DDP: the last rank's input holds a NaN at this step),
    ``diverge_step`` (DDP: from this step on, the last rank perturbs its all-reduced
    gradient of the first layer), ``steps`` (default :data:`STEPS`), ``reduce`` and
    ``check_slices`` (the tap's), ``local_view`` (the producer's setting). Rank 0 also
    reports the elements its tap read (``elements``, in-band mode).
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
        elif kind in ("fsdp1_orig", "fsdp1_flat"):
            from torch.distributed.fsdp import FullyShardedDataParallel

            orig, cpu = kind == "fsdp1_orig", torch.device("cpu")
            net[2] = FullyShardedDataParallel(net[2], use_orig_params=orig, device_id=cpu)
            net = FullyShardedDataParallel(net, use_orig_params=orig, device_id=cpu)
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
        producer_options = {k: options[k] for k in ("local_view",) if k in options}
        producer = GradientProducer(run_id, rank=rank, world_size=world,
                                    bootstrap_servers=bootstrap, topic=topic,
                                    **producer_options)
        tap = GradientTap(net, producer, **{k: options[k] for k in ("reduce", "check_slices")
                                            if k in options})
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
                if step_no["step"] >= options["diverge_step"]:
                    params[0].grad.add_(1e-3)
            optimizer.register_step_pre_hook(perturb)
        tap.attach_optimizer(optimizer)
        records: list[dict[str, Any]] = []
        if kind.startswith("fsdp1"):
            optimizer.register_step_pre_hook(
                lambda *_: records.append(fsdp1_reference(net, names)))
        else:
            optimizer.register_step_pre_hook(
                lambda *_: records.append(reference(names, params)))
        for step in range(options.get("steps", STEPS)):
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
            elements = None if tap.reducer is None else tap.reducer.elements_summarised
            queue.put({"names": names, "records": records, "elements": elements})
        dist.barrier()  # no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()
    leave(queue)


def _normalised(raw: str) -> str:
    from producer.adapters.naming import normalize_name

    return normalize_name(raw)


# -- Hugging Face Trainer and Lightning under DDP ------------------------------------------


class _Regressor(nn.Module):
    """The MLP behind a Trainer-style ``forward(x, labels) -> {"loss": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(n, IN, generator=gen), torch.randn(n, OUT, generator=gen)
    return [{"x": xs[i], "labels": ys[i]} for i in range(n)]


def _torch_reference(module: nn.Module, records: list[dict[str, Any]]) -> list[str]:
    named = [(_normalised(raw), p) for raw, p in module.named_parameters()]
    names = [n for n, _ in named]
    records.append(reference(names, [p for _, p in named]))
    return names


def run_framework_rank(kind: str, rank: int, world: int, port: int, bootstrap: str,
                       topic: str, run_id: str, out_dir: str, queue: Any) -> None:
    """One rank of a Hugging Face ``Trainer`` (``kind="hf"``) or Lightning
    ``strategy="ddp"`` (``kind="lightning"``) job on CPU, started the way ``torchrun``
    starts ranks (environment variables); gradient accumulation over 2 micro-batches."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    # Lightning's local view (the DDP hook) every step, so the test sees every rank's.
    producer = GradientProducer(run_id, rank=rank, world_size=world,
                                bootstrap_servers=bootstrap, topic=topic,
                                local_view="every_step" if kind == "lightning" else "recorder")
    records: list[dict[str, Any]] = []
    names: list[str] = []
    data = _rows(8 * world * STEPS * MICRO)
    if kind == "hf":
        from transformers import Trainer, TrainerCallback, TrainingArguments

        from producer.adapters.hf import GradstreamCallback

        class Reference(TrainerCallback):
            def on_pre_optimizer_step(self, args: Any, state: Any, control: Any,
                                      **kwargs: Any) -> None:
                names[:] = _torch_reference(kwargs["model"], records)

        args = TrainingArguments(
            output_dir=out_dir, use_cpu=True, ddp_backend="gloo", max_steps=STEPS,
            per_device_train_batch_size=8, gradient_accumulation_steps=MICRO,
            learning_rate=0.05, report_to=[], save_strategy="no", logging_strategy="no",
            dataloader_num_workers=0, seed=0,
        )
        trainer = Trainer(model=_Regressor(), args=args, train_dataset=data,
                          callbacks=[GradstreamCallback(producer), Reference()])
        trainer.train()
    else:
        import lightning.pytorch as pl

        from producer.adapters.lightning import GradstreamCallback as LightningCallback

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = model()

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                return nn.functional.mse_loss(self.net(batch["x"]), batch["labels"])

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.05)

        class LightningReference(pl.Callback):
            def on_before_optimizer_step(self, trainer: Any, pl_module: Any,
                                         optimizer: Any) -> None:
                names[:] = _torch_reference(pl_module, records)

        trainer = pl.Trainer(
            accelerator="cpu", devices=world, strategy="ddp", max_steps=STEPS,
            accumulate_grad_batches=MICRO, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[LightningCallback(producer, local_view=True), LightningReference()],
            default_root_dir=out_dir,
        )
        loader = torch.utils.data.DataLoader(data, batch_size=8)
        trainer.fit(Module(), loader)
    producer.close()
    if rank == 0:
        queue.put({"names": names, "records": records})


# -- pipeline parallelism: each stage's ranks build the tap on their own stage -------------


def run_pipeline_rank(rank: int, world: int, dp: int, init: str, bootstrap: str, topic: str,
                      run_id: str, queue: Any, options: dict[str, Any]) -> None:
    """One rank of a 2-stage pipeline of :func:`model` (stage 0: ``0`` and ``1``, stage 1:
    ``2``, named as in the unsplit model), ``dp`` data-parallel ranks per stage (DDP over
    the stage's own gloo group), ranks ``[s * dp, (s + 1) * dp)`` holding stage s.

    Activations go forward and their gradients back by point-to-point ``send`` /
    ``recv`` between the ranks of equal data-parallel coordinate; gradient accumulation
    over :data:`MICRO` micro-batches (``no_sync`` under DDP). Each rank's tap declares its
    stage's layers only. The first rank of each stage puts torch's values of its stage's
    full gradients on ``queue`` (with the stage's total norm). Option ``reduce`` (the
    tap's).
    """
    from collections import OrderedDict

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        stage, dp_rank = divmod(rank, dp)
        whole = model()
        parts = ([("0", whole[0]), ("1", whole[1])] if stage == 0 else [("2", whole[2])])
        net: nn.Module = nn.Sequential(OrderedDict(parts))
        groups = [dist.new_group(list(range(s * dp, (s + 1) * dp))) for s in range(2)]
        if dp > 1:
            net = nn.parallel.DistributedDataParallel(net, process_group=groups[stage])
        producer = GradientProducer(run_id, rank=rank, world_size=world,
                                    bootstrap_servers=bootstrap, topic=topic)
        tap = GradientTap(net, producer, **{k: options[k] for k in ("reduce",) if k in options})
        tap.start_run()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        named = dict(net.named_parameters())
        names = tap.layer_names
        params = [named[raw] for raw in named if _normalised(raw) in names]
        tap.attach_optimizer(optimizer)
        records: list[dict[str, Any]] = []
        optimizer.register_step_pre_hook(
            lambda *_: records.append(reference(names, params)))
        peer = rank + dp if stage == 0 else rank - dp
        for step in range(STEPS):
            for micro in range(MICRO):
                x, y = batch(step, micro, dp_rank)
                sync = net.no_sync() if dp > 1 and micro < MICRO - 1 else nullcontext()
                with sync:
                    if stage == 0:
                        h = net(x)
                        dist.send(h.detach().contiguous(), peer)
                        grad_h = torch.empty_like(h)
                        dist.recv(grad_h, peer)
                        h.backward(grad_h)
                    else:
                        h = torch.empty(x.shape[0], HIDDEN)
                        dist.recv(h, peer)
                        h.requires_grad_(True)
                        nn.functional.mse_loss(net(h), y).backward()
                        dist.send(h.grad.contiguous(), peer)
            optimizer.step()
            optimizer.zero_grad()
        assert producer.finish_run(timeout=60)
        producer.close()
        if dp_rank == 0:
            queue.put({"stage": stage, "names": names, "records": records,
                       "layers": list(tap.run_layers.names) if tap.run_layers else None})
        dist.barrier()  # no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()
    leave(queue)
