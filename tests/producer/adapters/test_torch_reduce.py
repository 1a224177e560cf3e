"""The in-band reduction's pure parts: who owns a layer, who cross-checks it when, and the
bound on how long a diverging replica can go unchecked (the collectives themselves run in
tests/integration/test_parallelism.py with real gloo ranks)."""

from __future__ import annotations

import numpy as np
import pytest

from producer.adapters.torch_reduce import (
    InBandReducer,
    ReplicaLayout,
    assign_owners,
    check_slices_of,
)
from producer.adapters.torch_run_layers import RunLayers, gather_run_layers, replica_group


def test_owners_balance_the_elements_each_replica_reads():
    rng = np.random.default_rng(0)
    weights = rng.integers(1, 10_000, size=1000)
    for replicas in (2, 3, 8, 64):
        owner = assign_owners(weights, np.full(1000, replicas))
        load = np.bincount(owner, weights=weights, minlength=replicas)
        # LPT: no slot exceeds the mean by more than the largest layer.
        assert load.max() <= weights.sum() / replicas + weights.max()
        assert set(owner.tolist()) == set(range(replicas))


def test_owners_are_assigned_per_replica_count_and_unreplicated_layers_to_slot_zero():
    owner = assign_owners(np.array([5, 5, 5, 5]), np.array([1, 2, 2, 1]))
    assert owner.tolist() == [0, 0, 1, 0]


def test_check_slices_cycle_through_each_owners_layers():
    owner = np.array([0, 1, 0, 0, 1, 0])
    assert check_slices_of(owner, np.full(6, 2), 2).tolist() == [0, 0, 1, 0, 1, 1]


def _reducer(replicas: int, layers: int, slot: int, check_slices: int) -> InBandReducer:
    """A reducer of ``layers`` plain (DDP) parameters as rank ``slot`` of ``replicas``,
    built without a process group (select() needs none)."""
    ranks = np.arange(replicas).reshape(1, -1)
    run = RunLayers(
        names=tuple(f"l{i}" for i in range(layers)), numel=np.arange(1, layers + 1),
        dtypes=("float32",) * layers, replicas=np.full(layers, replicas),
        groups=np.full(layers, replica_group(ranks)), positions=np.arange(layers),
        declared_by=(tuple(range(replicas)),) * layers)
    layouts = [ReplicaLayout(ranks, slot)] * layers
    return InBandReducer(run, layouts, group=None, rank=slot, world_size=replicas,
                         check_slices=check_slices)


@pytest.mark.parametrize("replicas,layers,slices", [(2, 4, 1), (3, 7, 2), (4, 10, 4),
                                                   (5, 3, 3)])
def test_every_copy_of_every_layer_is_compared_within_the_documented_bound(
        replicas, layers, slices):
    reducers = [_reducer(replicas, layers, r, slices) for r in range(replicas)]
    bound = slices * (replicas - 1)
    compared = np.zeros((layers, replicas), bool)  # (layer, rank) whose copy was compared
    owned_total = np.zeros(layers, int)
    for step in range(bound):
        checked_by = np.zeros(layers, int)
        for rank, red in enumerate(reducers):
            owned, checked = red.select(step)
            owned_total += owned
            checked_by += checked
            compared[checked, rank] = True
            compared[owned & red._checked_layers(step), rank] = True
        # each layer checked this step is checked by exactly one replica, never its owner
        assert (checked_by == reducers[0]._checked_layers(step)).all()
    assert compared.all()  # within C (R - 1) steps every replica's copy was compared
    assert (owned_total == bound).all()  # exactly one owner per layer and step


def test_each_rank_reads_about_one_replica_share_plus_a_bounded_check():
    replicas, layers, slices = 4, 400, 4
    reducers = [_reducer(replicas, layers, r, slices) for r in range(replicas)]
    numel = np.arange(1, layers + 1)
    for step in range(6):
        for red in reducers:
            owned, checked = red.select(step)
            share = numel[owned | checked].sum() / numel.sum()
            assert share <= 1 / replicas * (1 + 1 / slices) * 1.1


def test_owners_are_balanced_within_each_replica_set():
    # Two pipeline stages of two replicas each: same R, different rank sets.
    a, b = replica_group(np.array([[0, 1]])), replica_group(np.array([[2, 3]]))
    owner = assign_owners(np.array([8, 8, 8, 8]), np.full(4, 2), np.array([a, a, b, b]))
    assert owner.tolist() == [0, 1, 0, 1]


def test_the_run_layers_of_one_rank_are_its_own_list():
    run = gather_run_layers(["a", "b"], [3, 4], ["float32"] * 2, [None, None], 0, 1)
    assert run.names == ("a", "b") and run.numel.tolist() == [3, 4]
    assert run.positions.tolist() == [0, 1] and run.replicas.tolist() == [1, 1]
