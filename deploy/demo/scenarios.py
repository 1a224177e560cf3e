"""The demo scenarios: an MLP on the digits dataset and the training settings that make it
healthy, vanishing, exploding, send NaN from one rank, spike its loss on one bad batch or
slow one rank down (:data:`SCENARIOS`).

The pathologies come from the training itself: nothing invents or post-processes a
gradient. In ``bad-rank`` one rank's *input data* is corrupted (:meth:`Scenario.shard_inputs`);
what its gradients and everyone's update do follows from the backpropagation and the
all-reduce of :func:`deploy.demo.training.run_data_parallel`.
"""


from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from deploy.demo.mlp import (
    Activation,
    Init,
    Params,
    init_params,
)


@dataclass(frozen=True)
class Scenario:
    """A training configuration whose gradient health follows from its hyper-parameters.

    Attributes:
        name: registry key.
        description: one line for humans (CLI help, progress bars, ``RunStarted.config``).
        expected: the pathology the training produces with the default thresholds
            (``"healthy"``, ``"vanishing"``, ``"exploding"``, ``"nonfinite"``, or the alert
            rule it fires: ``"loss_spike"``, ``"straggler"``); documentation, not an input.
        layer_sizes: widths ``(64, hidden..., 10)`` of the MLP on the digits data set.
        activation: hidden activation, ``"relu"`` or ``"sigmoid"``.
        init: weight initialisation, ``"he"``, ``"xavier"`` or ``"normal(std)"``
            (see :class:`deploy.demo.mlp.Init`).
        lr: SGD (peak) learning rate.
        warmup_steps: linear learning-rate warm-up length; 0 for a constant ``lr``
            (see :meth:`lr_at`).
        batch_size: global minibatch size, split across the ranks (120 divides evenly by
            1, 2, 3, 4, 5, 6 and 8 ranks).
        steps: default number of optimiser steps.
        corrupt_rank: the rank whose data shard is corrupted, as a Python-style index into
            the ranks (``-1``: the last rank, ``world_size - 1``); None: clean data
            (see :meth:`shard_inputs`).
        corrupt_from_step: first optimiser step whose shard is corrupted (>= 0).
        corrupt_value: what every feature of the corrupted sample reads as (e.g. NaN, a
            record that failed to decode).
        spike_step: the optimiser step whose global batch reaches every rank with its
            labels shifted by one class (a misaligned join in the data pipeline: every
            sample carries its neighbour class's label); None: none (see
            :meth:`shard_labels`).
        slow_rank: the rank that computes slowly (a Python-style index into the ranks, as
            ``corrupt_rank``), for ``slow_steps`` steps from ``slow_from_step``, each
            taking ``slow_s`` seconds longer (a thermally throttled GPU, a noisy
            neighbour); None: none (see :meth:`compute_delay`).
    """

    name: str
    description: str
    expected: str
    layer_sizes: tuple[int, ...]
    activation: Activation
    init: str
    lr: float
    warmup_steps: int = 0
    batch_size: int = 120
    steps: int = 100
    corrupt_rank: int | None = None
    corrupt_from_step: int = 0
    corrupt_value: float = float("nan")
    spike_step: int | None = None
    slow_rank: int | None = None
    slow_from_step: int = 0
    slow_steps: int = 0
    slow_s: float = 0.0

    def lr_at(self, step: int) -> float:
        """Learning rate of optimiser step ``step``.

        Linear warm-up (Goyal et al. 2017, "Accurate, Large Minibatch SGD", sec. 2.2):
        ``lr * min(1, (step + 1) / warmup_steps)``, or ``lr`` when ``warmup_steps == 0``.

        Args:
            step: optimiser step (>= 0).

        Returns:
            The learning rate.
        """
        if self.warmup_steps <= 0:
            return self.lr
        return self.lr * min(1.0, (step + 1) / self.warmup_steps)

    @property
    def num_layers(self) -> int:
        """Number of linear layers (``len(layer_sizes) - 1``)."""
        return len(self.layer_sizes) - 1

    def init_params(self, seed: int = 0, dtype: Any = np.float32) -> Params:
        """The initial parameters; identical (bit for bit) for the same ``seed``.

        Args:
            seed: run seed; the initialisation stream is ``default_rng([seed, 0])``.
            dtype: floating dtype of the arrays.

        Returns:
            Parameters in model order (see :func:`deploy.demo.mlp.init_params`).
        """
        return init_params(
            self.layer_sizes, self.init, seed=np.random.default_rng([seed, 0]), dtype=dtype
        )

    def layer_numel(self) -> dict[str, int]:
        """Number of elements of every parameter, in model order.

        Returns:
            ``{"layers.0.weight": out_0 * in_0, "layers.0.bias": out_0, ...}``.
        """
        numel: dict[str, int] = {}
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(self.layer_sizes)):
            numel[f"layers.{i}.weight"] = fan_in * fan_out
            numel[f"layers.{i}.bias"] = fan_out
        return numel

    def batch_indices(self, step: int, seed: int, n_samples: int) -> np.ndarray:
        """Row indices of the global minibatch of optimiser step ``step``.

        Every rank calls this with the same arguments and gets the same indices, then keeps
        ``indices[rank::world_size]``. Sampling is uniform without replacement from the stream
        ``default_rng([seed, 1, step])``.

        Args:
            step: optimiser step (>= 0).
            seed: run seed.
            n_samples: size of the data set (>= ``batch_size``).

        Returns:
            int64 array of shape ``(batch_size,)``.
        """
        rng = np.random.default_rng([seed, 1, step])
        return rng.choice(n_samples, size=self.batch_size, replace=False).astype(np.int64)

    def corrupted_rank(self, world_size: int) -> int | None:
        """The rank whose data shard is corrupted in a run of ``world_size`` ranks.

        Args:
            world_size: number of ranks (>= 1).

        Returns:
            ``corrupt_rank`` resolved like a Python index into ``range(world_size)``, or
            None when the scenario's data is clean.

        Raises:
            ValueError: ``corrupt_rank`` is outside ``[-world_size, world_size)``.
        """
        if self.corrupt_rank is None:
            return None
        if not -world_size <= self.corrupt_rank < world_size:
            raise ValueError(
                f"scenario {self.name!r} corrupts rank {self.corrupt_rank}, which a run of "
                f"{world_size} rank(s) does not have"
            )
        return self.corrupt_rank % world_size

    def shard_inputs(
        self, x: np.ndarray, rows: np.ndarray, rank: int, world_size: int, step: int
    ) -> np.ndarray:
        """The input features of ``rank``'s shard at optimiser step ``step``.

        ``x[rows]``; on the corrupted rank (:meth:`corrupted_rank`) from
        ``corrupt_from_step`` on, the first sample of the shard has every feature replaced
        by ``corrupt_value`` (a corrupted record in that rank's data, e.g. one that failed
        to decode). Labels are untouched (:meth:`shard_labels`).

        Args:
            x: float32 ``(n_samples, n_features)`` data set.
            rows: int64 ``(n,)`` row indices of the shard (``n >= 1``).
            rank: this rank. world_size: number of ranks. step: optimiser step.

        Returns:
            float32 ``(n, n_features)``, a new array.

        Raises:
            ValueError: see :meth:`corrupted_rank`.
        """
        xs = x[rows]
        if rank == self.corrupted_rank(world_size) and step >= self.corrupt_from_step:
            xs[0, :] = self.corrupt_value
        return xs

    def shard_labels(self, y: np.ndarray, rows: np.ndarray, step: int,
                     classes: int) -> np.ndarray:
        """The labels of a shard at optimiser step ``step``: ``y[rows]``, shifted by one
        class (``(y + 1) mod classes``) at ``spike_step``.

        Args:
            y: int64 ``(n_samples,)`` labels in ``[0, classes)``. rows: the shard's row
                indices. step: optimiser step. classes: number of classes.

        Returns:
            int64 ``(len(rows),)``, a new array.
        """
        ys = y[rows]
        return (ys + 1) % classes if step == self.spike_step else ys

    def compute_delay(self, rank: int, world_size: int, step: int) -> float:
        """Extra seconds ``rank`` computes at optimiser ``step``: ``slow_s`` on the slow
        rank during its slow steps, else 0.

        Raises:
            ValueError: ``slow_rank`` is outside ``[-world_size, world_size)``.
        """
        if self.slow_rank is None:
            return 0.0
        if not -world_size <= self.slow_rank < world_size:
            raise ValueError(f"scenario {self.name!r} slows rank {self.slow_rank}, which a "
                             f"run of {world_size} rank(s) does not have")
        slow = (rank == self.slow_rank % world_size
                and self.slow_from_step <= step < self.slow_from_step + self.slow_steps)
        return self.slow_s if slow else 0.0

    def config(self) -> dict[str, Any]:
        """The hyper-parameters as a JSON-able dict (for ``RunStarted.config``); with a
        corrupted rank also ``corrupt_rank``, ``corrupt_from_step`` and ``corrupt_value``
        (a string: JSON has no NaN)."""
        corruption: dict[str, Any] = {}
        if self.corrupt_rank is not None:
            corruption = {
                "corrupt_rank": self.corrupt_rank,
                "corrupt_from_step": self.corrupt_from_step,
                "corrupt_value": repr(self.corrupt_value),
            }
        if self.spike_step is not None:
            corruption.update(spike_step=self.spike_step)
        if self.slow_rank is not None:
            corruption.update(slow_rank=self.slow_rank, slow_from_step=self.slow_from_step,
                              slow_steps=self.slow_steps, slow_s=self.slow_s)
        return {
            "scenario": self.name,
            "expected": self.expected,
            "dataset": "sklearn.datasets.load_digits (standardised)",
            "layer_sizes": list(self.layer_sizes),
            "activation": self.activation,
            "init": self.init,
            "optimizer": "sgd",
            "lr": self.lr,
            "warmup_steps": self.warmup_steps,
            "batch_size": self.batch_size,
            **corruption,
        }


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="healthy",
            description="ReLU MLP 64-128-64-10, He init, SGD lr 0.1: trains to ~97% accuracy",
            expected="healthy",
            layer_sizes=(64, 128, 64, 10),
            activation="relu",
            init="he",
            lr=0.1,
            steps=100,
        ),
        Scenario(
            name="vanishing",
            description=(
                "12 sigmoid hidden layers of width 32, Xavier init: gradients shrink ~4-5x per "
                "layer on the way back, the first layers get < 1e-7"
            ),
            expected="vanishing",
            layer_sizes=(64, *([32] * 12), 10),
            activation="sigmoid",
            init="xavier",
            lr=0.1,
            steps=100,
        ),
        Scenario(
            name="exploding",
            description=(
                "4 ReLU hidden layers of width 64, He init, SGD with the learning rate warmed up "
                "linearly to 4.0 over 30 steps: trains for ~15 steps, then diverges, gradients "
                "> 1e3, then inf/nan"
            ),
            expected="exploding",
            layer_sizes=(64, *([64] * 4), 10),
            activation="relu",
            init="he",
            lr=4.0,
            warmup_steps=30,
            steps=60,
        ),
        Scenario(
            name="bad-rank",
            description=(
                "the healthy MLP, but from step 20 the last rank's data shard holds a corrupted "
                "sample (NaN features): that rank's local gradient turns NaN first, the "
                "all-reduce hands the NaN to every rank's update"
            ),
            expected="nonfinite",
            layer_sizes=(64, 128, 64, 10),
            activation="relu",
            init="he",
            lr=0.1,
            steps=40,
            corrupt_rank=-1,
            corrupt_from_step=20,
        ),
        Scenario(
            name="loss-spike",
            description=(
                "the healthy MLP, but the batch of step 22 reaches every rank with its "
                "labels shifted by one class (a misaligned join): the loss jumps, and so "
                "do the gradients of that step"
            ),
            expected="loss_spike",
            layer_sizes=(64, 128, 64, 10),
            activation="relu",
            init="he",
            lr=0.1,
            steps=40,
            spike_step=22,
        ),
        Scenario(
            name="straggler",
            description=(
                "the healthy MLP, but the last rank computes 60 ms longer per step from "
                "step 5 to 19: every rank's step time grows alike (the all-reduce waits "
                "for it), only its own compute time names it"
            ),
            expected="straggler",
            layer_sizes=(64, 128, 64, 10),
            activation="relu",
            init="he",
            lr=0.1,
            steps=30,
            slow_rank=-1,
            slow_from_step=5,
            slow_steps=15,
            slow_s=0.06,
        ),
    )
}
"""The demo scenarios, by name. Measured on seed 0 (averaged gradients, 2 ranks): see the
tests."""

for _scenario in SCENARIOS.values():  # fail at import, not in a child process
    Init.parse(_scenario.init)
del _scenario
