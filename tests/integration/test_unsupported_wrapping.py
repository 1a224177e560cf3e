"""Wrapping gradstream does not support yet is refused at ``start_run``, never summarised
into wrong numbers: real ``torch.distributed`` ranks (gloo, CPU processes), the real
``GradientTap`` and ``GradientProducer`` pointed at the real broker.

- a tap built on the module inside an FSDP v1 root unit (its flat parameter's unit is
  outside the model given, so where the original parameters lie cannot be read);
- pipeline stages that each build the tap on a stage module whose names reuse another
  stage's names for other parameters (rank 1's ``0.weight`` is not rank 0's): the run's
  layer list is the union of the stages' names, so a name must mean one parameter
  (stages named as in the unsplit model are accepted: ``tests/integration/test_pipeline.py``).

Every rank gets :class:`UnsupportedParallelismError` from ``start_run`` with a message that
says what to do, and its producer has sent nothing. FSDP v1 itself, with flat parameters
and with ``use_orig_params=True`` (whose ``named_parameters()`` are each rank's own
slices), is accepted: both ranks announce the original parameters
(``tests/integration/test_fsdp1.py`` checks the values).
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from producer import GradientProducer
from producer.adapters.torch import GradientTap
from producer.adapters.torch_layout import UnsupportedParallelismError
from tests.integration.parallel_ranks import leave

CASES = ("fsdp1", "fsdp1_orig_params", "fsdp1_inner", "pipeline")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def refusal_rank(rank: int, world: int, init: str, bootstrap: str, topic: str, run_id: str,
                 queue: Any) -> None:
    """Build each case's model on this rank, try ``start_run``, report what happened."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out: dict[str, Any] = {}
        for case in CASES:
            net: nn.Module = _model()
            if case.startswith("fsdp1"):
                net = FullyShardedDataParallel(net, use_orig_params=case.endswith("params"),
                                               device_id=torch.device("cpu"))
                if case == "fsdp1_inner":  # the wrapped module, its root unit left outside
                    net = net.module
            else:  # pipeline: rank 1's stage is built anew, its Linear named "0" again
                net = net[:2] if rank == 0 else nn.Sequential(nn.Linear(16, 4))
            producer = GradientProducer(f"{run_id}-{case}", rank=rank, world_size=world,
                                        bootstrap_servers=bootstrap, topic=topic)
            tap = GradientTap(net, producer)
            try:
                tap.start_run()
                error = None
            except UnsupportedParallelismError as exc:
                error = str(exc)
            stats = producer.stats()
            out[case] = {"error": error, "built_with_reason": tap.unsupported is not None,
                         "layers": tap.layer_names,
                         "sent": stats.sent + stats.queued + stats.in_flight}
            producer.close()
        queue.put((rank, out))
        dist.barrier()  # no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()
    leave(queue)


def test_unresolvable_fsdp1_and_per_rank_layer_lists_are_refused_at_start_run(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=refusal_rank, args=(
        r, 2, f"file://{tmp_path / 'pg'}", kafka_bootstrap, f"refuse-{unique_name}",
        f"refuse-{unique_name}", queue)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 240
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                rank, out = queue.get(timeout=1)
                results[rank] = out
            except queue_module.Empty:
                assert not any(p.exitcode not in (None, 0) for p in procs), \
                    [p.exitcode for p in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert sorted(results) == [0, 1] and all(p.exitcode == 0 for p in procs)

    for rank, out in results.items():
        for case in ("fsdp1", "fsdp1_orig_params"):  # accepted: the original parameters
            got = out[case]
            assert got["error"] is None and not got["built_with_reason"], (rank, case, got)
            assert got["layers"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        inner = out["fsdp1_inner"]
        assert inner["built_with_reason"] and inner["sent"] == 0, (rank, inner)
        assert "FSDP v1" in inner["error"] and "not inside the model given to the tap" \
            in inner["error"]
        assert "build the tap on the FSDP-wrapped model itself" in inner["error"]
        pipe = out["pipeline"]
        assert not pipe["built_with_reason"] and pipe["sent"] == 0
        assert "rank 1 declares layer '0.weight' as 64 elements (float32), rank 0 as 96" \
            in pipe["error"]
        assert "a layer name must mean one parameter across the ranks" in pipe["error"]
