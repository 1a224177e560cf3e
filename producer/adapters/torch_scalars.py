"""The training scalars a torch tap sends beside the gradients (``schemas.scalars``).

:class:`StepScalars` collects, for each optimiser step of one rank:

- what the framework holds: the learning rate of every parameter group of the attached
  optimiser (``lr``, ``lr/1``, ...) and the AMP ``GradScaler``'s scale (``loss_scale``);
- what the training loop gives (:meth:`StepScalars.give`): the rank's ``loss``, its
  ``tokens`` and ``samples``, any other name;
- what it measures itself:

  - ``step_time_s``: wall seconds between this rank's consecutive summarised optimiser
    steps, divided by the steps between them. Under data parallelism the gradient
    all-reduce makes every rank wait for the slowest, so this is about the same on every
    rank: it shows that the run is slow, not which rank.
  - ``compute_time_s``: seconds from the end of this rank's previous optimiser step (the
    optimiser's step post-hook; the previous :meth:`StepScalars.take` without an attached
    optimiser; the first step has none) to the moment the last of the *timed parameters*
    received its gradient
    in this step's backward pass (a ``register_post_accumulate_grad_hook``). The timed
    parameters are the first ``timed_parameters`` of the model order: in a sequential
    model backward reaches them last, so the time covers the data loading, the forward
    and the backward computation of this rank, but not the final wait in which DDP's
    reducer (or any collective after backward) lets the slowest rank catch up. A
    straggler's compute time stays high while every rank's step time is the same. On a
    CUDA device both ends are CUDA events recorded on the current stream, read
    when the step is taken: the time the device took, not the host's launch time.
    Under FSDP a sharded parameter's gradient arrives after its reduce-scatter, so the
    time then also holds that collective.

The hooks cost one Python call per timed parameter and micro-batch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from producer.adapters.optional import import_torch
from schemas.scalars import (
    COMPUTE_TIME,
    LEARNING_RATE,
    LOSS_SCALE,
    STEP_TIME,
    as_scalar,
    check_scalar_names,
)

DEFAULT_TIMED_PARAMETERS = 2
"""How many parameters, first in model order, time the end of a rank's backward pass: two,
so that a first parameter without a gradient at some step (frozen, unused) still leaves one
that ends the backward pass."""


def learning_rate_names(groups: int) -> list[str]:
    """The scalar names of ``groups`` parameter groups' learning rates: ``lr``, ``lr/1``,
    ``lr/2``, ...

    >>> learning_rate_names(3)
    ['lr', 'lr/1', 'lr/2']
    """
    return [LEARNING_RATE if i == 0 else f"{LEARNING_RATE}/{i}" for i in range(groups)]


class StepScalars:
    """One rank's training scalars of each optimiser step (module docstring).

    Args:
        parameters: the model's parameters in model order (the first
            ``timed_parameters`` of them that require a gradient time the backward pass).
        timed_parameters: how many (>= 0; 0 = no ``compute_time_s``).

    Raises:
        ValueError: ``timed_parameters < 0``.
    """

    def __init__(self, parameters: Sequence[Any],
                 timed_parameters: int = DEFAULT_TIMED_PARAMETERS) -> None:
        if timed_parameters < 0:
            raise ValueError(f"timed_parameters must be >= 0, got {timed_parameters}")
        self.optimizer: Any = None
        self.scaler: Any = None
        self._given: dict[str, Any] = {}
        self._handles: list[Any] = []
        self._last_step: tuple[int, float] | None = None  # (step, perf_counter)
        self._started: Any = None  # perf_counter float or CUDA event: this step's start
        self._ended: Any = None  # the last timed gradient of this step
        timed = [p for p in parameters if getattr(p, "requires_grad", False)]
        for param in timed[:timed_parameters]:
            register = getattr(param, "register_post_accumulate_grad_hook", None)
            if register is not None:
                self._handles.append(register(self._gradient_arrived))

    def _now(self, like: Any) -> Any:
        """A timestamp where ``like`` lives: a recorded CUDA event for a CUDA tensor, else
        ``time.perf_counter()``."""
        if like is not None and getattr(getattr(like, "device", None), "type", "cpu") == "cuda":
            torch = import_torch()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _gradient_arrived(self, param: Any) -> None:
        self._ended = self._now(param)

    def mark_start(self, like: Any = None) -> None:
        """The end of an optimiser step: the next step's compute time starts now (the
        optimiser's step post-hook; ``like``: a parameter, to time on its device)."""
        self._started = self._now(like)
        self._ended = None

    def attach_optimizer(self, optimizer: Any) -> Any:
        """Read the learning rates of ``optimizer``'s parameter groups and start each step's
        compute time when its ``step()`` returns (a step post-hook). Returns the hook
        handle, or None when the optimiser has no ``register_step_post_hook``. A wrapper
        holding the torch optimiser as ``.optimizer`` (accelerate's ``AcceleratedOptimizer``,
        Lightning's ``LightningOptimizer``) is unwrapped first."""
        inner = getattr(optimizer, "optimizer", None)
        while inner is not None and hasattr(inner, "param_groups"):
            optimizer, inner = inner, getattr(inner, "optimizer", None)
        self.optimizer = optimizer
        register = getattr(optimizer, "register_step_post_hook", None)
        if register is None:
            return None
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        handle = register(lambda *_: self.mark_start(first))
        self._handles.append(handle)
        return handle

    def attach_scaler(self, scaler: Any) -> None:
        """Read the loss scale of an AMP ``GradScaler`` (``get_scale()``) at every step."""
        if not hasattr(scaler, "get_scale"):
            raise TypeError(f"{type(scaler).__name__} has no get_scale(): not a GradScaler")
        self.scaler = scaler

    def give(self, values: Mapping[str, Any]) -> None:
        """Scalars of the current step from the training loop (``loss``, ``tokens``, any
        name; a 0-d tensor is read when the step is taken, so giving it costs no device
        synchronisation).

        Raises:
            ValueError: an invalid name (``schemas.scalars.SCALAR_NAME_PATTERN``).
        """
        check_scalar_names(values)
        self._given.update(values)

    def take(self, step: int) -> dict[str, float]:
        """Every scalar of optimiser ``step`` (name -> float), and start the next step.

        Raises:
            TypeError: a given value is not a real number.
        """
        now = time.perf_counter()
        values: dict[str, float] = {}
        if self.optimizer is not None:
            groups = self.optimizer.param_groups
            for name, group in zip(learning_rate_names(len(groups)), groups, strict=True):
                if "lr" in group:
                    values[name] = as_scalar(name, group["lr"])
        if self.scaler is not None and getattr(self.scaler, "is_enabled", lambda: True)():
            values[LOSS_SCALE] = as_scalar(LOSS_SCALE, self.scaler.get_scale())
        for name, value in self._given.items():
            values[name] = as_scalar(name, value)
        self._given = {}
        if self._last_step is not None and step > self._last_step[0]:
            values[STEP_TIME] = (now - self._last_step[1]) / (step - self._last_step[0])
        self._last_step = (step, now)
        compute = self._compute_time()
        if compute is not None:
            values[COMPUTE_TIME] = compute
        if self.optimizer is None or not hasattr(self.optimizer, "register_step_post_hook"):
            self.mark_start()  # no post-hook: the next step starts now
        return values

    def _compute_time(self) -> float | None:
        """This step's compute time in seconds, or None when no timed gradient arrived
        (or its two ends lie on different clocks). On CUDA the host waits for the end
        event: for the backward pass, which the tap's own reading of the gradients waits
        for anyway."""
        started, ended = self._started, self._ended
        if started is None or ended is None or isinstance(started, float) != isinstance(
                ended, float):
            return None
        if isinstance(ended, float):
            return max(ended - started, 0.0)
        ended.synchronize()
        return started.elapsed_time(ended) / 1e3  # ms -> s

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
