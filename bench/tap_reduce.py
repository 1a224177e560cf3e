"""How much of the gradient a DDP rank's tap reads, and what the in-band reduction costs,
at W = 1, 2, 4 ranks (real ``torch.distributed`` with gloo on CPU).

Each of W processes trains the same float32 MLP of ``--layers`` Linear(``--width``,
``--width``) layers under ``DistributedDataParallel`` for ``--steps`` optimiser steps with a
:class:`producer.adapters.torch.GradientTap` in its default configuration (in-band
reduction when W > 1, ``producer.adapters.torch_reduce``). The tap hands its summaries to a
recorder that keeps them in memory (the producer's own cost is ``bench/producer_overhead.py``'s
subject), so the figures are the tap's alone. Per W it prints, for rank 0 (rank 0 also
sends): the share of the gradient's elements the tap read per step (owned pieces plus the
rotating cross-check), the tap's wall time per step (``tap.step`` inside
``optimizer.step()``'s pre-hook), of which the in-band reduction (building the buffers,
launching the two asynchronous all-reduces and waiting for the previous step's), and
the tap's CPU time per step (``time.thread_time`` of the training thread: on a machine with
fewer cores than ranks the wall time mostly measures the ranks waiting for each other) and
its ratio to the W = 1 tap's.

Run: ``python bench/tap_reduce.py [--world 1,2,4] [--layers N] [--width N] [--steps N]``.
Last line: ``share_w1=X share_w2=X share_w4=X tap_cpu_ms_w1=X tap_cpu_ms_w2=X
tap_cpu_ms_w4=X reduce_ms_w4=X`` (for the world sizes given).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time
from typing import Any


class KeepingRecorder:
    """A tap's producer that keeps the summaries in memory (``SummaryRecorder``)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.steps = 0

    def start_run(self, layer_numel: Any, **_: Any) -> None:
        """Nothing to announce."""

    def record_summaries(self, step: int, summaries: Any, **scalars: Any) -> None:
        """Count the summary (its training scalars are not looked at)."""
        self.steps += 1


def _rank(rank: int, world: int, port: int, layers: int, width: int, steps: int,
          queue: Any) -> None:
    """One DDP rank: train, time the tap, report rank 0's figures."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from producer.adapters.torch import GradientTap

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
        tap = GradientTap(net, KeepingRecorder(world))
        tap.start_run()
        reduce_s = [0.0]
        if tap.reducer is not None:  # time the reduction's own part of the tap
            red = tap.reducer
            for name in ("launch", "collect"):
                inner = getattr(red, name)

                def timed(*a: Any, _inner: Any = inner, **k: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return _inner(*a, **k)
                    finally:
                        reduce_s[0] += time.perf_counter() - t0

                setattr(red, name, timed)
        tap_s = [0.0, 0.0]  # wall, this thread's CPU
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)

        def pre_hook(*_: Any) -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            tap.step()
            tap_s[0] += time.perf_counter() - t0
            tap_s[1] += time.thread_time() - c0

        opt.register_step_pre_hook(pre_hook)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(16, width, generator=gen)
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        tap.flush()
        total = sum(p.numel() for p in model.parameters())
        read = (tap.reducer.elements_summarised if tap.reducer is not None
                else total * tap.steps_recorded)
        if rank == 0:
            queue.put({"share": read / (total * steps), "tap_ms": tap_s[0] / steps * 1e3,
                       "tap_cpu_ms": tap_s[1] / steps * 1e3,
                       "reduce_ms": reduce_s[0] / steps * 1e3})
        dist.barrier()  # no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()
    # gloo can abort the interpreter's shutdown after the teardown ("terminate called
    # without an active exception"): a rank that finished exits 0 at once
    queue.close()
    queue.join_thread()
    os._exit(0)


def measure(world: int, layers: int, width: int, steps: int) -> dict[str, float]:
    """Run a W-rank job and return rank 0's figures."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, layers, width, steps, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(120)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank failed: {[p.exitcode for p in procs]}")
    return result


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, measure each world size, print the table and the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", default="1,2,4", help="world sizes (default 1,2,4)")
    parser.add_argument("--layers", type=int, default=32, help="Linear layers (default 32)")
    parser.add_argument("--width", type=int, default=256, help="layer width (default 256)")
    parser.add_argument("--steps", type=int, default=30, help="optimiser steps (default 30)")
    args = parser.parse_args(argv)
    sizes = [int(w) for w in args.world.split(",")]
    results = {w: measure(w, args.layers, args.width, args.steps) for w in sizes}
    base_cpu = results[sizes[0]]["tap_cpu_ms"]
    print(f"{'W':>3} {'share read':>10} {'1/W':>6} {'tap ms/step':>11} {'tap CPU ms':>10} "
          f"{'reduction ms':>12} {'CPU vs W=' + str(sizes[0]):>10}")
    for w, r in results.items():
        print(f"{w:3d} {r['share']:10.3f} {1 / w:6.3f} {r['tap_ms']:11.3f} "
              f"{r['tap_cpu_ms']:10.3f} {r['reduce_ms']:12.3f} "
              f"{r['tap_cpu_ms'] / base_cpu:10.2f}")
    parts = [f"share_w{w}={r['share']:.3f}" for w, r in results.items()]
    parts += [f"tap_cpu_ms_w{w}={r['tap_cpu_ms']:.3f}" for w, r in results.items()]
    parts.append(f"reduce_ms_w{sizes[-1]}={results[sizes[-1]]['reduce_ms']:.3f}")
    print(" ".join(parts))


if __name__ == "__main__":
    main()
