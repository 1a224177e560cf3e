"""FSDP v1 resolved into the original parameters: real ``torch.distributed`` (gloo, CPU
processes), real ``FullyShardedDataParallel``, no Kafka.

The model nests one unit (``2``) inside the root unit, whose flat parameter holds ``0.*``
and ``4.*``: under flat parameters ``named_parameters()`` yields the root's flat parameter
first, so the model order must come from the module tree. Each rank's pieces, put together
in rank order, must be exactly torch's full gradient of each original parameter (from
``summon_full_params(with_grads=True)`` with ``use_orig_params=True``, from the all-gathered
flat gradient otherwise), padding excluded; and that gradient must be the mean of the
ranks' unsharded gradients (float32 reductions: relative 1e-5).
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from producer.adapters.naming import normalize_name
from producer.adapters.torch import GradientTap
from producer.adapters.torch_fsdp1 import original_parameters, unsupported_fsdp1
from tests.integration.parallel_ranks import fsdp1_full_gradients, leave
from tests.producer.adapters import FakeProducer

nn = torch.nn


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _rank(rank: int, world: int, init: str, orig: bool, queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cpu = torch.device("cpu")
        net = _mlp()
        net[2] = FullyShardedDataParallel(net[2], use_orig_params=orig, device_id=cpu)
        net = FullyShardedDataParallel(net, use_orig_params=orig, device_id=cpu)
        fake = FakeProducer(rank=rank, world_size=world)
        tap = GradientTap(net, fake, reduce="off")
        tap.start_run()
        x, y = _batch(rank)
        nn.functional.mse_loss(net(x), y).backward()
        tap.step()
        _, summaries = fake.steps[0]
        pieces = {}
        for slot in original_parameters(net) or []:
            piece = slot.piece(slot.tensor.grad)
            pieces[normalize_name(slot.raw_name)] = (
                None if piece is None else (piece[0].detach().numpy().copy(), piece[1],
                                            piece[2]))
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, pieces)
        full = {n: g.reshape(-1).numpy() for n, g in fsdp1_full_gradients(net).items()}
        queue.put({
            "rank": rank, "layer_numel": fake.layer_numel, "names": tap.layer_names,
            "dtypes": fake.start_kwargs["dtypes"], "unsupported": unsupported_fsdp1(net),
            "summary": (list(summaries.names), summaries.numel.tolist(),
                        summaries.shard_index.tolist(), summaries.shard_count.tolist()),
            "skipped_not_local": tap.skipped_not_local,
            "gathered": gathered if rank == 0 else None, "full": full,
            "flat_not_named": all(tap.layer_name_of(p) is None for p in net.parameters())
            if not orig else None,
        })
        dist.barrier()  # no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()
    leave(queue)


@pytest.mark.parametrize("orig,world", [(True, 2), (False, 2), (True, 3), (False, 3)])
def test_pieces_are_exactly_the_full_gradient(orig: bool, world: int, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'pg'}"
    procs = [ctx.Process(target=_rank, args=(r, world, init, orig, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted((queue.get(timeout=240) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)

    plain = _mlp()
    names = [n for n, _ in plain.named_parameters()]
    numel = {n: p.numel() for n, p in plain.named_parameters()}
    # The same step without FSDP: the mean of the ranks' gradients.
    grads = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in
             plain.named_parameters()}
    for r in range(world):
        plain.zero_grad()
        x, y = _batch(r)
        nn.functional.mse_loss(plain(x), y).backward()
        for n, p in plain.named_parameters():
            grads[n] += p.grad.reshape(-1).double() / world

    for r in results:
        assert r["unsupported"] is None
        assert r["names"] == names  # model order, on every rank
        assert r["layer_numel"] == numel  # full sizes, never a rank's slice or a flat size
        assert r["dtypes"] == dict.fromkeys(names, "float32")
        if r["flat_not_named"] is not None:
            assert r["flat_not_named"]  # a flat parameter is no layer's
        sent, sizes, index, count = r["summary"]
        assert set(count) == {world} and set(index) == {r["rank"]}
        assert 0 not in sizes
        # what the summary left out is what this rank holds none of
        assert r["skipped_not_local"] == len(names) - len(sent)
    total = {n: 0 for n in names}
    for r in results:
        sent, sizes, _, _ = r["summary"]
        for n, k in zip(sent, sizes, strict=True):
            total[n] += k
    assert total == numel  # the pieces add up, padding never counted
    if world == 3:  # 3 divides no flat size here: some rank holds none of some parameter
        assert any(r["skipped_not_local"] for r in results)

    gathered = results[0]["gathered"]
    for name in names:
        held = [g[name] for g in gathered if g[name] is not None]
        assert [h[1] for h in held] == sorted(h[1] for h in held)
        joined = np.concatenate([h[0] for h in held])
        for r in results:  # every rank's view of torch's full gradient
            np.testing.assert_array_equal(joined, r["full"][name], err_msg=name)
        np.testing.assert_allclose(joined, grads[name].numpy(), rtol=1e-5, atol=1e-7)


# -- the pure parts: one parameter's piece and replica layout ----------------------------


def _slot(**fields: Any) -> Any:
    from producer.adapters.torch_fsdp1 import OriginalParameter

    base = {"raw_name": "w", "numel": 10, "dtype": torch.float32, "tensor": None,
            "managed": True}
    return OriginalParameter(**{**base, **fields})


def test_flat_piece_is_the_parameter_range_of_the_chunk() -> None:
    chunk = torch.arange(8, dtype=torch.float32)  # e.g. [3 of w | 4 of v | 1 padding]
    slot = _slot(flat=True, offset=3, length=4, chunk=8, shard_index=1, shard_count=3)
    view, index, count = slot.piece(chunk)
    assert view.tolist() == [3.0, 4.0, 5.0, 6.0] and (index, count) == (1, 3)
    assert slot.piece(torch.zeros(24)) is None  # an unreduced (unsharded) gradient
    assert slot.piece(None) is None
    absent = _slot(flat=True, length=0, chunk=8, shard_index=1, shard_count=3)
    assert not absent.local and absent.piece(chunk) is None


def test_original_parameter_piece_is_its_own_slice() -> None:
    slot = _slot(offset=0, length=4, chunk=8, shard_index=0, shard_count=2)
    view, index, count = slot.piece(torch.ones(4))
    assert view.shape == (4,) and (index, count) == (0, 2)
    assert slot.piece(torch.ones(2, 5)) is None  # the unsharded gradient (no_sync)
    plain = _slot(managed=False, tensor=torch.ones(3))
    assert plain.local and plain.piece(torch.ones(3))[1:] == (0, 1)


@pytest.mark.parametrize("rank,shard,replica,table,slot", [
    (1, (0, 1, 2), (1,), [[0], [1], [2]], 0),  # FULL_SHARD: pieces, no replicas
    (3, (2, 3), (1, 3), [[0, 2], [1, 3]], 1),  # HYBRID_SHARD, 2 x 2
    (1, (1,), (0, 1), [[0, 1]], 1),  # NO_SHARD: one piece, every rank a replica
])
def test_replica_layout(rank: int, shard: tuple[int, ...], replica: tuple[int, ...],
                        table: list[list[int]], slot: int) -> None:
    got = _slot(shard_ranks=shard, replica_ranks=replica).replica_layout(rank, 4)
    assert got.ranks.tolist() == table and got.slot == slot
