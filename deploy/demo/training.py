"""Data-parallel training of the demo MLP across N OS processes, with per-rank telemetry.

This is what ``gradstream demo`` really runs. Each rank is a separate process (multiprocessing,
``"spawn"`` context, like one process per GPU under ``torchrun``):

1. every rank builds the same initial parameters from the seed;
2. at step ``s`` every rank draws the same global minibatch (indices from ``(seed, s)``) and
   takes its own shard, rows ``rank::world_size``;
3. it computes the loss and gradients of its shard (:func:`deploy.demo.mlp.forward_backward`),
   its *local* gradients;
4. it sends the local gradients to the parent process (the coordinator) through a
   :func:`multiprocessing.Pipe`; the parent averages them, weighted by shard size (an all-reduce
   emulation: with equal shards this is the plain mean that ``DistributedDataParallel`` uses,
   and in every case it equals the gradient of the mean loss over the whole global batch), and
   sends the average back;
5. it hands its telemetry the averaged gradient, the one SGD applies and the same (bit for
   bit) on every rank, together with its local gradients as the per-rank local view (in the
   real demo: the gradstream producer SDK, which sends the averaged gradient as a replicated
   layout, counted once by the consumer, and the local view apart);
6. every rank applies the same SGD update to the same parameters, so the replicas stay
   bit-identical (checked at the end by comparing a checksum of every rank's parameters).

The pathologies of the :data:`SCENARIOS` come from the training itself: nothing in here
invents or post-processes a gradient. In ``bad-rank`` one rank's *input data* is corrupted
(:meth:`Scenario.shard_inputs`); what its gradients and everyone's update do follows from the
backpropagation and the all-reduce.

Failure handling: an exception in a rank is sent to the parent and re-raised there as
:class:`RankError` naming the rank; a rank that dies without reporting is detected through its
pipe and process sentinel. On any error, and on :class:`KeyboardInterrupt` in the parent, the
parent closes the pipes (ranks blocked on them exit), waits briefly, then terminates and finally
kills what is left, so no process outlives :func:`run_data_parallel`. Ranks ignore SIGINT:
Ctrl-C in a terminal reaches the whole process group, and the parent alone decides the shutdown.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from deploy.demo.mlp import (
    Activation,
    Init,
    Params,
    forward_backward,
    init_params,
    load_digits_dataset,
    sgd_update,
)

__all__ = [
    "SCENARIOS",
    "FailingTelemetry",
    "KafkaTelemetry",
    "NullTelemetry",
    "RankError",
    "Recording",
    "RecordingTelemetry",
    "Scenario",
    "Telemetry",
    "TrainingResult",
    "kafka_telemetry",
    "load_recording",
    "params_checksum",
    "run_data_parallel",
]


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """A training configuration whose gradient health follows from its hyper-parameters.

    Attributes:
        name: registry key.
        description: one line for humans (CLI help, progress bars, ``RunStarted.config``).
        expected: the pathology the training produces with the default thresholds
            (``"healthy"``, ``"vanishing"``, ``"exploding"`` or ``"nonfinite"``);
            documentation, not an input.
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
        to decode). Labels are untouched.

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
    )
}
"""The demo scenarios, by name. Measured on seed 0 (averaged gradients, 2 ranks): see the
tests."""

for _scenario in SCENARIOS.values():  # fail at import, not in a child process
    Init.parse(_scenario.init)
del _scenario


# --------------------------------------------------------------------------------------------
# Telemetry
# --------------------------------------------------------------------------------------------


@runtime_checkable
class Telemetry(Protocol):
    """What a rank does with its gradients; created inside the rank process.

    Lifecycle: :meth:`start` once, :meth:`step` once per optimiser step (steps ``0, 1, ...``),
    :meth:`finish` once after the last step. If training is cut short (an error in any rank, or
    an interrupt), :meth:`finish` is *not* called; instead, if the object has an ``abort()``
    method, it is called (best effort) so that it can release resources.
    """

    def start(self, layer_numel: dict[str, int]) -> None:
        """Called once before the first step.

        Args:
            layer_numel: number of elements of every full parameter, names in model order.
        """
        ...

    def step(
        self, step: int, grads: dict[str, np.ndarray],
        weights: Mapping[str, np.ndarray] | None = None,
        local: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Called once per optimiser step, after the all-reduce and before the update.

        Args:
            step: optimiser step (0-based).
            grads: name -> float32 *averaged* gradient of the parameter's full shape, model
                order: the gradient SGD applies, bit-identical on every rank; may contain
                inf/nan. Valid during the call only (views of the received buffer).
            weights: name -> float32 parameters that produced the gradients (before this
                step's update), the whole replica every rank holds. Valid during the call
                only: the caller updates them in place afterwards.
            local: name -> float32 *local* gradient of this rank's shard before the
                all-reduce (same names and shapes as ``grads``), or None. The arrays are not
                reused by the caller after this call.
        """
        ...

    def finish(self) -> None:
        """Called once after the last step."""
        ...


class NullTelemetry:
    """Telemetry that does nothing; the class itself is a valid ``make_telemetry``.

    Args:
        rank: this rank (ignored).
        world_size: number of ranks (ignored).
    """

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size

    def start(self, layer_numel: dict[str, int]) -> None:
        """Do nothing."""

    def step(
        self, step: int, grads: dict[str, np.ndarray],
        weights: Mapping[str, np.ndarray] | None = None,
        local: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Do nothing."""

    def finish(self) -> None:
        """Do nothing."""


class RecordingTelemetry:
    """Telemetry for tests: keeps every gradient it is given and writes them to one ``.npz``.

    Use ``functools.partial(RecordingTelemetry, directory)`` as ``make_telemetry``. On
    :meth:`finish`, ``<directory>/rank<rank>.npz`` is written atomically (temporary file, then
    rename) with the arrays ``steps`` (int64, ``(T,)``), ``layer_names`` (str, ``(L,)``, model
    order), ``layer_numel`` (int64, ``(L,)``), ``world_size`` and, for every parameter ``name``,
    ``grad/<name>`` (the averaged gradient applied) and, when every step came with a local
    view, ``local/<name>`` (this rank's local gradient), each of shape ``(T, *param_shape)``
    in float32. Read it with :func:`load_recording`. Memory is ``2 x T x (number of
    parameters) x 4`` bytes.

    Args:
        directory: an existing directory, shared by all ranks.
        rank: this rank.
        world_size: number of ranks.
    """

    def __init__(self, directory: str | os.PathLike[str], rank: int, world_size: int) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self._numel: dict[str, int] = {}
        self._steps: list[int] = []
        self._grads: list[dict[str, np.ndarray]] = []
        self._local: list[dict[str, np.ndarray] | None] = []

    def start(self, layer_numel: dict[str, int]) -> None:
        """Remember the layer list."""
        self._numel = dict(layer_numel)

    def step(
        self, step: int, grads: dict[str, np.ndarray],
        weights: Mapping[str, np.ndarray] | None = None,
        local: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Keep a copy of the averaged and the local gradients of ``step`` (``weights`` are
        not recorded).

        Raises:
            ValueError: if a gradient's (or local gradient's) name or size disagrees with
                ``start``.
        """
        for what, arrays in (("gradient", grads), ("local gradient", local)):
            if arrays is None:
                continue
            if list(arrays) != list(self._numel):
                raise ValueError(f"step {step}: {what} names differ from the layer list")
            for name, g in arrays.items():
                if g.size != self._numel[name]:
                    raise ValueError(f"step {step}: {what} {name} has {g.size} elements")
        self._steps.append(step)
        self._grads.append({name: np.array(g, dtype=np.float32) for name, g in grads.items()})
        self._local.append(
            None if local is None
            else {name: np.array(g, dtype=np.float32) for name, g in local.items()}
        )

    def finish(self) -> None:
        """Write ``rank<rank>.npz``."""
        names = list(self._numel)
        arrays: dict[str, np.ndarray] = {
            "steps": np.asarray(self._steps, dtype=np.int64),
            "layer_names": np.asarray(names, dtype=str),
            "layer_numel": np.asarray([self._numel[n] for n in names], dtype=np.int64),
            "world_size": np.asarray(self.world_size, dtype=np.int64),
        }
        for name in names:
            arrays[f"grad/{name}"] = (
                np.stack([g[name] for g in self._grads])
                if self._grads
                else np.zeros((0, self._numel[name]), dtype=np.float32)
            )
        local = [g for g in self._local if g is not None]
        if local and len(local) == len(self._local):
            for name in names:
                arrays[f"local/{name}"] = np.stack([g[name] for g in local])
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".npz.tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **arrays)  # type: ignore[arg-type]
            os.replace(tmp, self.directory / f"rank{self.rank}.npz")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


@dataclass(frozen=True)
class Recording:
    """What one rank's :class:`RecordingTelemetry` received.

    Attributes:
        rank: the rank.
        world_size: number of ranks.
        steps: int64 ``(T,)`` optimiser steps.
        layer_names: parameter names in model order.
        layer_numel: elements per parameter, model order.
        grads: name -> float32 ``(T, *param_shape)`` averaged gradients (what SGD applied).
        local: name -> float32 ``(T, *param_shape)`` this rank's local gradients, or None if
            the steps came without a local view.
    """

    rank: int
    world_size: int
    steps: np.ndarray
    layer_names: list[str]
    layer_numel: list[int]
    grads: dict[str, np.ndarray]
    local: dict[str, np.ndarray] | None = None


def load_recording(directory: str | os.PathLike[str], rank: int) -> Recording:
    """Read ``<directory>/rank<rank>.npz`` written by :class:`RecordingTelemetry`.

    Args:
        directory: the directory given to :class:`RecordingTelemetry`.
        rank: which rank's file.

    Returns:
        The recording.

    Raises:
        FileNotFoundError: if that rank never finished.
    """
    with np.load(Path(directory) / f"rank{rank}.npz") as data:
        names = [str(n) for n in data["layer_names"]]
        return Recording(
            rank=rank,
            world_size=int(data["world_size"]),
            steps=data["steps"],
            layer_names=names,
            layer_numel=[int(n) for n in data["layer_numel"]],
            grads={n: data[f"grad/{n}"] for n in names},
            local=(
                {n: data[f"local/{n}"] for n in names}
                if names and f"local/{names[0]}" in data.files else None
            ),
        )


class FailingTelemetry:
    """Fault injection for tests and demos of failure handling.

    On rank ``fail_rank`` at step ``fail_step`` it either raises ``RuntimeError`` (``mode =
    "raise"``) or kills its process with ``os._exit(3)`` without any report (``mode = "exit"``).
    Every other call does nothing. Use ``functools.partial(FailingTelemetry, fail_rank=1,
    fail_step=2)`` as ``make_telemetry``.

    Args:
        rank: this rank.
        world_size: number of ranks.
        fail_rank: the rank that fails.
        fail_step: the optimiser step at which it fails.
        mode: ``"raise"`` or ``"exit"``.

    Raises:
        ValueError: for an unknown ``mode``.
    """

    def __init__(
        self, rank: int, world_size: int, *, fail_rank: int, fail_step: int, mode: str = "raise"
    ) -> None:
        if mode not in ("raise", "exit"):
            raise ValueError(f"mode must be 'raise' or 'exit', got {mode!r}")
        self.rank = rank
        self.world_size = world_size
        self.fail_rank = fail_rank
        self.fail_step = fail_step
        self.mode = mode

    def start(self, layer_numel: dict[str, int]) -> None:
        """Do nothing."""

    def step(
        self, step: int, grads: dict[str, np.ndarray],
        weights: Mapping[str, np.ndarray] | None = None,
        local: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Fail if this is the chosen rank and step.

        Raises:
            RuntimeError: ``"injected failure on rank R at step S"`` in mode ``"raise"``.
        """
        if self.rank == self.fail_rank and step == self.fail_step:
            if self.mode == "exit":
                os._exit(3)
            raise RuntimeError(f"injected failure on rank {self.rank} at step {step}")

    def finish(self) -> None:
        """Do nothing."""


class KafkaTelemetry:
    """Telemetry through the gradstream producer SDK (:class:`producer.GradientProducer`).

    Built by :func:`kafka_telemetry` inside the rank process. ``start`` -> ``start_run``,
    ``step`` -> ``record_step`` (non-blocking) of the averaged gradient with
    ``replicated=True`` (every rank sends the same gradient: the consumer counts it once and
    checks that the ranks agree) and, with ``local_view``, the rank's local gradient as
    ``local_gradients``; ``finish`` -> ``finish_run`` then ``close`` (which waits for
    delivery), ``abort`` -> ``close`` without ``finish_run``.

    Args:
        producer: a ``GradientProducer`` for this rank.
        vanishing_threshold: mean |g| below which a layer is vanishing (sent in ``RunStarted``).
        exploding_threshold: max |g| above which a layer is exploding (sent in ``RunStarted``).
        config: free-form run configuration for ``RunStarted``.
        local_view: also send the rank's local gradient (the per-rank local view, stored in
            ``local_layer_stats``; it names the rank where NaN/Inf or an explosion started).
    """

    def __init__(
        self,
        producer: Any,
        *,
        vanishing_threshold: float = 1e-7,
        exploding_threshold: float = 1e3,
        config: Mapping[str, Any] | None = None,
        local_view: bool = True,
    ) -> None:
        self.producer = producer
        self.vanishing_threshold = vanishing_threshold
        self.exploding_threshold = exploding_threshold
        self.config = dict(config or {})
        self.local_view = local_view
        self._closed = False

    def start(self, layer_numel: dict[str, int]) -> None:
        """``producer.start_run(layer_numel, thresholds, config)``."""
        self.producer.start_run(
            layer_numel,
            vanishing_threshold=self.vanishing_threshold,
            exploding_threshold=self.exploding_threshold,
            config=self.config,
        )

    def step(
        self, step: int, grads: dict[str, np.ndarray],
        weights: Mapping[str, np.ndarray] | None = None,
        local: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """``producer.record_step(step, grads, weights=weights, replicated=True,
        local_gradients=local if local_view else None)``; the producer uses the weights only
        with its ``weight_stats`` setting.

        Raises:
            Exception: whatever ``record_step`` raises (see ``GradientProducer``).
        """
        self.producer.record_step(
            step, grads, weights=weights, replicated=True,
            local_gradients=local if self.local_view else None,
        )

    def finish(self) -> None:
        """``producer.finish_run()`` then ``producer.close()`` (waits for delivery)."""
        try:
            self.producer.finish_run()
        finally:
            self._close()

    def abort(self) -> None:
        """``producer.close()`` without ``finish_run`` (the run did not finish)."""
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self.producer.close()


def kafka_telemetry(
    rank: int,
    world_size: int,
    *,
    run_id: str,
    bootstrap_servers: str | Sequence[str],
    topic: str,
    vanishing_threshold: float = 1e-7,
    exploding_threshold: float = 1e3,
    config: Mapping[str, Any] | None = None,
    weight_stats: bool = True,
    local_view: bool = True,
) -> Telemetry:
    """A ``make_telemetry`` that sends each rank's summaries to Kafka.

    Use it as ``functools.partial(kafka_telemetry, run_id=..., bootstrap_servers=...,
    topic=...)``. ``producer`` is imported here, inside the rank process, so that the training
    itself does not depend on it.

    Args:
        rank: this rank.
        world_size: number of ranks.
        run_id: the run id (the Kafka key; identical on every rank).
        bootstrap_servers: Kafka bootstrap servers, ``"host:port[,host:port]"`` or a list.
        topic: the summaries topic.
        vanishing_threshold: mean |g| threshold for ``RunStarted`` (default 1e-7).
        exploding_threshold: max |g| threshold for ``RunStarted`` (default 1e3).
        config: free-form configuration for ``RunStarted`` (e.g. :meth:`Scenario.config`).
        weight_stats: also send the weight statistics of every step (the producer's
            ``weight_stats``; each rank sends its replica, which the replicated layout
            makes the consumer count once, see ``schemas.tables``), which
            ``gradstream analyze --kind weights`` reads.
        local_view: also send each rank's local (pre-all-reduce) gradient, see
            :class:`KafkaTelemetry`; on by default in the demo.

    Returns:
        A :class:`KafkaTelemetry`.

    Raises:
        ImportError: if the producer SDK is not importable.
        Exception: whatever ``GradientProducer`` raises for bad arguments or an unreachable
            broker (the training reports it as a :class:`RankError`).
    """
    from producer import GradientProducer

    servers = (
        bootstrap_servers if isinstance(bootstrap_servers, str) else ",".join(bootstrap_servers)
    )
    producer = GradientProducer(
        run_id,
        rank=rank,
        world_size=world_size,
        bootstrap_servers=servers,
        topic=topic,
        weight_stats=weight_stats,
    )
    return KafkaTelemetry(
        producer,
        vanishing_threshold=vanishing_threshold,
        exploding_threshold=exploding_threshold,
        config=config,
        local_view=local_view,
    )


# --------------------------------------------------------------------------------------------
# Data-parallel training
# --------------------------------------------------------------------------------------------


class RankError(RuntimeError):
    """A training rank failed; raised in the parent by :func:`run_data_parallel`.

    Attributes:
        rank: the failed rank.
        step: the optimiser step at which it failed, or None if unknown.
        exitcode: the process exit code if it died without a report, else None.
        remote_traceback: the formatted traceback from the rank, or ``""``.
    """

    def __init__(
        self,
        rank: int,
        message: str,
        *,
        step: int | None = None,
        exitcode: int | None = None,
        remote_traceback: str = "",
    ) -> None:
        where = f"rank {rank}" + (f" at step {step}" if step is not None else "")
        text = f"{where} failed: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback in {where} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)
        self.rank = rank
        self.step = step
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback


@dataclass
class TrainingResult:
    """The outcome of :func:`run_data_parallel`.

    Attributes:
        scenario: scenario name.
        world_size: number of ranks.
        steps: optimiser steps completed.
        losses: global loss per step (shard losses weighted by shard size, i.e. the mean
            cross-entropy over the global batch); may contain inf/nan.
        params_checksum: :func:`params_checksum` of the final parameters of rank 0.
        rank_checksums: the same checksum from every rank, index = rank.
        wall_time_s: seconds from the first process start to the last rank's report.
        final_params: rank 0's final parameters (float32, model order).
    """

    scenario: str
    world_size: int
    steps: int
    losses: list[float]
    params_checksum: str
    rank_checksums: list[str]
    wall_time_s: float
    final_params: Params = field(repr=False)

    @property
    def params_identical(self) -> bool:
        """True if every rank ended with bit-identical parameters."""
        return all(c == self.params_checksum for c in self.rank_checksums)


def params_checksum(params: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the names, dtypes, shapes and raw bytes of the parameters, in order.

    Args:
        params: name -> array.

    Returns:
        Hex digest; equal for bit-identical parameters (nan payloads included).
    """
    digest = hashlib.sha256()
    for name, p in params.items():
        arr = np.ascontiguousarray(p)
        digest.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
        digest.update(arr.tobytes())
    return digest.hexdigest()


class _CoordinatorGoneError(Exception):
    """The parent closed the pipe (it is shutting down)."""


def _call_abort(telemetry: object) -> None:
    abort = getattr(telemetry, "abort", None)
    if callable(abort):
        with contextlib.suppress(Exception):  # best effort while shutting down
            abort()


def _rank_main(
    rank: int,
    world_size: int,
    scenario_name: str,
    steps: int,
    seed: int,
    x: np.ndarray,
    y: np.ndarray,
    make_telemetry: Callable[[int, int], Telemetry],
    conn: multiprocessing.connection.Connection,
) -> None:
    """Body of one rank process (see the module docstring). Protocol over ``conn``:

    rank -> parent: ``("grads", step, loss, n_rows, flat_float32)`` each step, then
    ``("done", checksum, params_or_None)``, or ``("error", step, "Type: msg", traceback)``.
    parent -> rank: ``("avg", step, flat_float32)``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides the shutdown
    telemetry: Telemetry | None = None
    step = -1

    def send(msg: tuple[Any, ...]) -> None:
        try:
            conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise _CoordinatorGoneError from exc

    def recv() -> Any:
        try:
            return conn.recv()
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise _CoordinatorGoneError from exc

    try:
        scenario = SCENARIOS[scenario_name]
        params = scenario.init_params(seed)
        names = list(params)
        shapes = [params[n].shape for n in names]
        sizes = [params[n].size for n in names]
        offsets = np.cumsum([0, *sizes])
        tel = telemetry = make_telemetry(rank, world_size)
        tel.start({n: int(s) for n, s in zip(names, sizes, strict=True)})
        for step in range(steps):
            rows = scenario.batch_indices(step, seed, len(x))[rank::world_size]
            xs = scenario.shard_inputs(x, rows, rank, world_size, step)
            loss, grads = forward_backward(params, xs, y[rows], scenario.activation)
            flat = np.concatenate([grads[n].ravel() for n in names])
            send(("grads", step, loss, len(rows), flat))
            tag, avg_step, avg = recv()
            if tag != "avg" or avg_step != step:
                raise RuntimeError(f"protocol error: expected avg of step {step}, got {tag}")
            applied = {
                n: avg[offsets[i] : offsets[i + 1]].reshape(shapes[i])
                for i, n in enumerate(names)
            }
            tel.step(step, applied, weights=params, local=grads)
            sgd_update(params, applied, scenario.lr_at(step))
        step = -1  # a failure from here on is not tied to a step
        telemetry = None  # finish() was called: no abort() on a failure in it
        tel.finish()
        send(("done", params_checksum(params), params if rank == 0 else None))
    except _CoordinatorGoneError:
        _call_abort(telemetry)
    except BaseException as exc:
        _call_abort(telemetry)
        with contextlib.suppress(Exception):  # the parent may be gone already
            conn.send(
                (
                    "error",
                    step if step >= 0 else None,
                    f"{type(exc).__name__}: {exc}",
                    traceback.format_exc(),
                )
            )
        raise SystemExit(1) from None
    finally:
        conn.close()


def _receive_all(
    conns: list[multiprocessing.connection.Connection],
    procs: list[Any],
    expected: str,
    step: int | None,
    timeout: float | None,
) -> list[tuple[Any, ...]]:
    """One message from every rank, failing fast on the first rank that errors or dies."""
    pending = set(range(len(conns)))
    messages: list[tuple[Any, ...] | None] = [None] * len(conns)
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        wait_for: list[Any] = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait(wait_for, timeout=remaining)
        if not ready:
            rank = min(pending)
            raise RankError(
                rank, f"no {expected!r} message within {timeout:g} s (hung?)", step=step
            )
        for rank in sorted(pending):
            conn, proc = conns[rank], procs[rank]
            if conn.poll():
                try:
                    msg = conn.recv()
                except (EOFError, ConnectionResetError, OSError):
                    proc.join(timeout=5)
                    raise RankError(
                        rank,
                        f"process exited (exit code {proc.exitcode}) without reporting",
                        step=step,
                        exitcode=proc.exitcode,
                    ) from None
                if msg[0] == "error":
                    _, err_step, text, tb = msg
                    raise RankError(rank, text, step=err_step, remote_traceback=tb)
                if msg[0] != expected or (step is not None and msg[1] != step):
                    raise RankError(rank, f"protocol error: got {msg[0]!r}, expected {expected!r}")
                messages[rank] = msg
                pending.discard(rank)
            elif not proc.is_alive():
                raise RankError(
                    rank,
                    f"process exited (exit code {proc.exitcode}) without reporting",
                    step=step,
                    exitcode=proc.exitcode,
                )
    return [m for m in messages if m is not None]


def _send_avg(
    rank: int,
    conn: multiprocessing.connection.Connection,
    proc: Any,
    step: int,
    avg: np.ndarray,
) -> None:
    """Send the averaged gradient to one rank; a dead rank becomes a :class:`RankError`."""
    try:
        conn.send(("avg", step, avg))
    except (BrokenPipeError, ConnectionResetError, OSError):
        proc.join(timeout=5)
        raise RankError(
            rank,
            f"process exited (exit code {proc.exitcode}) before receiving the averaged gradient",
            step=step,
            exitcode=proc.exitcode,
        ) from None


def _shutdown(
    procs: list[Any], conns: list[multiprocessing.connection.Connection], grace: float
) -> None:
    """Close the pipes, give the ranks ``grace`` seconds, then terminate, then kill."""
    for conn in conns:
        conn.close()
    try:
        deadline = time.monotonic() + grace
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:  # also on a second Ctrl-C during the grace period
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()


def run_data_parallel(
    scenario: str,
    world_size: int,
    steps: int | None,
    make_telemetry: Callable[[int, int], Telemetry],
    on_step: Callable[[int, float], None] | None = None,
    seed: int = 0,
    *,
    rank_timeout: float | None = 300.0,
    shutdown_grace: float = 10.0,
) -> TrainingResult:
    """Train ``scenario`` data-parallel on ``world_size`` processes; each rank emits telemetry.

    Args:
        scenario: a key of :data:`SCENARIOS`.
        world_size: number of rank processes, ``1 <= world_size <= batch_size``.
        steps: optimiser steps (>= 0); None for the scenario's default.
        make_telemetry: ``make_telemetry(rank, world_size) -> Telemetry``, called inside each
            rank process; it must be picklable (a module-level function or class, or a
            ``functools.partial`` of one), e.g. ``NullTelemetry``,
            ``partial(RecordingTelemetry, directory)`` or ``partial(kafka_telemetry, ...)``.
        on_step: called in the parent as ``on_step(step, loss)`` after the gradients of
            ``step`` have been averaged (global batch loss; may be nan). An exception in it
            (including KeyboardInterrupt) stops the training and is re-raised.
        seed: run seed (initial parameters and minibatch order).
        rank_timeout: seconds to wait for any expected message from the ranks before giving up
            (None: forever); the first report includes process start-up and the data transfer.
        shutdown_grace: seconds the ranks get to exit by themselves after an error or an
            interrupt (e.g. to close a Kafka producer) before they are terminated.

    Returns:
        A :class:`TrainingResult`.

    Raises:
        ValueError: unknown scenario, ``world_size``/``steps`` out of range, or a scenario
            whose corrupted rank a run of ``world_size`` ranks does not have.
        TypeError: ``make_telemetry`` cannot be pickled.
        ImportError: scikit-learn (the data set) is missing.
        RankError: a rank raised an exception, died, hung beyond ``rank_timeout`` or ended with
            parameters different from rank 0's. Every rank process has been ended and joined
            before this (or any other exception, including KeyboardInterrupt) propagates.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {sorted(SCENARIOS)}")
    sc = SCENARIOS[scenario]
    n_steps = sc.steps if steps is None else int(steps)
    if n_steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not 1 <= world_size <= sc.batch_size:
        raise ValueError(f"world_size must be in [1, {sc.batch_size}], got {world_size}")
    sc.corrupted_rank(world_size)  # the corrupted rank must exist
    try:
        pickle.dumps(make_telemetry)
    except Exception as exc:
        raise TypeError(
            "make_telemetry must be picklable (a module-level function/class or a "
            f"functools.partial of one): {exc}"
        ) from exc
    x, y = load_digits_dataset(np.float32)
    x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)

    ctx = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    conns: list[multiprocessing.connection.Connection] = []
    losses: list[float] = []
    start = time.perf_counter()
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            conns.append(parent_end)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, world_size, scenario, n_steps, seed, x, y, make_telemetry, child_end),
                name=f"gradstream-demo-rank{rank}",
                daemon=True,
            )
            procs.append(proc)
            proc.start()
            child_end.close()  # the child holds its end; a dead child then reads as EOF here
        for step in range(n_steps):
            msgs = _receive_all(conns, procs, "grads", step, rank_timeout)
            rows = np.array([m[3] for m in msgs], dtype=np.float64)
            weights = rows / rows.sum()
            with np.errstate(all="ignore"):
                avg64 = np.zeros(msgs[0][4].shape, dtype=np.float64)
                for w, m in zip(weights, msgs, strict=True):
                    avg64 += w * m[4]
                avg = avg64.astype(np.float32)
                loss = float(sum(w * m[2] for w, m in zip(weights, msgs, strict=True)))
            for rank, conn in enumerate(conns):
                _send_avg(rank, conn, procs[rank], step, avg)
            losses.append(loss)
            if on_step is not None:
                on_step(step, loss)
        done = _receive_all(conns, procs, "done", None, rank_timeout)
        wall = time.perf_counter() - start
    finally:
        _shutdown(procs, conns, shutdown_grace)

    checksums = [m[1] for m in done]
    for rank, checksum in enumerate(checksums):
        if checksum != checksums[0]:
            raise RankError(rank, "parameters differ from rank 0's after training")
    return TrainingResult(
        scenario=scenario,
        world_size=world_size,
        steps=n_steps,
        losses=losses,
        params_checksum=checksums[0],
        rank_checksums=checksums,
        wall_time_s=wall,
        final_params=done[0][2],
    )
