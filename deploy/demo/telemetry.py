"""What a demo rank does with its gradients (:class:`Telemetry`), one class per job.

- :class:`NullTelemetry`: nothing (the training alone).
- :class:`RecordingTelemetry` / :func:`load_recording`: every gradient to ``.npz`` files, for
  the tests that check gradstream's frames against the gradients SGD applied.
- :class:`FailingTelemetry`: fails on one rank at one step (failure-handling tests).
- :class:`KafkaTelemetry` / :func:`kafka_telemetry`: the gradstream producer SDK, as a real
  training job uses it.
"""


from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np


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
        scalars: Mapping[str, float] | None = None,
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
            scalars: this rank's training scalars of the step (``schemas.scalars``): its
                shard's ``loss``, the step's ``lr``, its ``samples`` and the
                ``compute_time_s`` of its forward and backward pass, or None.
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
        scalars: Mapping[str, float] | None = None,
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
        scalars: Mapping[str, float] | None = None,
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


class FailingTelemetry(NullTelemetry):
    """Fault injection for tests and demos of failure handling.

    On rank ``fail_rank`` at step ``fail_step`` it either raises ``RuntimeError`` (``mode =
    "raise"``) or kills its process with ``os._exit(3)`` without any report (``mode = "exit"``).
    Every other call does nothing, as :class:`NullTelemetry`. Use
    ``functools.partial(FailingTelemetry, fail_rank=1, fail_step=2)`` as ``make_telemetry``.

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
        super().__init__(rank, world_size)
        self.fail_rank = fail_rank
        self.fail_step = fail_step
        self.mode = mode

    def step(
        self, step: int, grads: dict[str, np.ndarray],
        weights: Mapping[str, np.ndarray] | None = None,
        local: Mapping[str, np.ndarray] | None = None,
        scalars: Mapping[str, float] | None = None,
    ) -> None:
        """Fail if this is the chosen rank and step.

        Raises:
            RuntimeError: ``"injected failure on rank R at step S"`` in mode ``"raise"``.
        """
        if self.rank == self.fail_rank and step == self.fail_step:
            if self.mode == "exit":
                os._exit(3)
            raise RuntimeError(f"injected failure on rank {self.rank} at step {step}")


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
        local_view: also give the rank's local gradient (the per-rank local view, stored in
            ``local_layer_stats``; it names the rank where NaN/Inf or an explosion started).
            By default it goes to the rank's flight recorder and leaves the rank only when
            a local trigger fires (``ProducerSettings.local_view``).
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
        scalars: Mapping[str, float] | None = None,
    ) -> None:
        """``producer.record_step(step, grads, weights=weights, replicated=True,
        local_gradients=local if local_view else None, scalars=scalars)``; the producer
        uses the weights only with its ``weight_stats`` setting.

        Raises:
            Exception: whatever ``record_step`` raises (see ``GradientProducer``).
        """
        self.producer.record_step(
            step, grads, weights=weights, replicated=True,
            local_gradients=local if self.local_view else None, scalars=scalars,
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
