"""What the framework callbacks (Hugging Face, Lightning) share: a tap built at train
start, one summary per optimiser step with the step's training scalars, the run finished at
train end.

The step's loss is this rank's mean over the micro-batches of the optimiser step: each
framework hands every micro-batch's loss to :meth:`TapCallback.note_loss` (kept as a tensor,
so no device synchronisation happens before the tap reads it), and :meth:`TapCallback.
record_step` gives the mean to the tap with the learning rates of the optimiser
(:meth:`TapCallback.note_optimizer`)."""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from producer.adapters.naming import normalize_name
from producer.adapters.torch import GradientTap, SummaryRecorder, check_every_n_steps
from producer.summary import LayerSummaries


class RunRecorder(SummaryRecorder, Protocol):
    """What the framework callbacks need from a producer: a :class:`SummaryRecorder` that
    can also finish the run and close (``GradientProducer`` satisfies it)."""

    def finish_run(self, timeout: float | None = ...) -> bool:
        """Send the run's end and flush (see ``GradientProducer.finish_run``)."""

    def close(self, timeout: float | None = ...) -> Any:
        """Flush and stop the producer (see ``GradientProducer.close``)."""


class TapCallback:
    """Base of the framework callbacks. A callback class derives from it and from its
    framework's callback class and calls :meth:`begin_run`, :meth:`record_step` and
    :meth:`end_run` from the framework's hooks.

    Args:
        producer: the rank's ``GradientProducer`` (or any :class:`RunRecorder`); its
            ``rank`` and ``world_size`` must equal the trainer's.
        every_n_steps: summarise only steps whose number is a multiple of n (combined
            with the producer's own ``every_n_steps``, see ``GradientTap``).
        include: fnmatch pattern(s) on normalised parameter names to watch.
        exclude: fnmatch pattern(s) on normalised parameter names to leave out.
        name_fn: raw parameter name -> layer name (default ``normalize_name``).
        vanishing_threshold: mean |g| below which a layer is vanishing.
        exploding_threshold: max |g| above which a layer is exploding.
        config: extra JSON-serialisable run configuration for ``start_run``; the
            callback adds ``framework`` (the framework's name, version and training
            settings).
        finish_run: call ``producer.finish_run()`` at train end (default True).
        close_producer: also call ``producer.close()`` there (default False).
        ignore_layers: layer-name patterns the run leaves out of its health, explicitly
            (``GradientProducer.start_run``).
        structural_ignore: model -> parameters to leave out of the health as well, found
            from the model's structure (never from their magnitude), or None.
        structural_reason: why, recorded in the run's config
            (``ignore_layers_structural.reason``).

    Raises:
        TypeError / ValueError: invalid ``every_n_steps``.

    Attributes:
        tap: the ``GradientTap`` of the current run, None before :meth:`begin_run`.
    """

    def __init__(
        self,
        producer: RunRecorder,
        *,
        every_n_steps: int | None = None,
        include: str | Iterable[str] | None = None,
        exclude: str | Iterable[str] | None = None,
        name_fn: Callable[[str], str] = normalize_name,
        vanishing_threshold: float = 1e-7,
        exploding_threshold: float = 1e3,
        config: Mapping[str, Any] | None = None,
        finish_run: bool = True,
        close_producer: bool = False,
        ignore_layers: Iterable[str] = (),
        structural_ignore: Callable[[Any], Iterable[Any]] | None = None,
        structural_reason: str = "",
    ) -> None:
        super().__init__()
        if every_n_steps is not None:
            check_every_n_steps(every_n_steps)
        if isinstance(ignore_layers, str):
            ignore_layers = [ignore_layers]
        self.producer = producer
        self._tap_options: dict[str, Any] = {
            "every_n_steps": every_n_steps, "include": include, "exclude": exclude,
            "name_fn": name_fn,
        }
        self._thresholds = {"vanishing_threshold": vanishing_threshold,
                            "exploding_threshold": exploding_threshold}
        self._config = dict(config or {})
        self._finish_run = finish_run
        self._close_producer = close_producer
        self._ignore_layers = list(ignore_layers)
        self._structural_ignore = structural_ignore
        self._structural_reason = structural_reason
        self.tap: GradientTap | None = None
        self._loss_sum: Any = None
        self._loss_count = 0
        self._optimizer: Any = None

    def begin_run(
        self, model: Any, *, rank: int, world_size: int, framework: Mapping[str, Any]
    ) -> GradientTap:
        """Build the tap on ``model`` and announce the run (``start_run``).

        Args:
            model: the ``torch.nn.Module`` being trained.
            rank, world_size: the trainer's.
            framework: the run config's ``framework`` entry.

        Returns:
            The tap (also :attr:`tap`).

        Raises:
            ValueError: no model, or the producer's rank / world size differ from the
                trainer's.
            RuntimeError: this callback already started a run.
        """
        if model is None:
            raise ValueError("the trainer passed no model to the gradstream callback")
        for what, mine, theirs in (
            ("world_size", getattr(self.producer, "world_size", None), world_size),
            ("rank", getattr(self.producer, "rank", None), rank),
        ):
            if mine is not None and int(mine) != int(theirs):
                raise ValueError(
                    f"the producer's {what} is {mine} but the trainer's is {theirs}: build "
                    f"the GradientProducer with rank={rank}, world_size={world_size}"
                )
        if self.tap is not None:
            raise RuntimeError("this gradstream callback already started a run; use one "
                               "callback and one producer per training run")
        tap = GradientTap(model, self.producer, **self._tap_options)
        config = {"framework": dict(framework), **self._config}
        ignore = list(self._ignore_layers)
        if self._structural_ignore is not None:
            # Named exactly: glob.escape keeps [, *, ? in names literal.
            names = [n for n in map(tap.layer_name_of, self._structural_ignore(model))
                     if n is not None]
            ignore += [glob.escape(n) for n in names]
            config.setdefault("ignore_layers_structural", {
                "reason": self._structural_reason, "layers": names})
        tap.start_run(**self._thresholds, config=config, ignore_layers=ignore)
        self.tap = tap
        return tap

    def note_loss(self, loss: Any) -> None:
        """Add one micro-batch's loss (a 0-d tensor or a number) to the current step's."""
        value = loss.detach() if hasattr(loss, "detach") else float(loss)
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def note_optimizer(self, optimizer: Any) -> None:
        """Send the learning rates of ``optimizer``'s parameter groups with every step (and
        time the steps from its ``step()``: ``GradientTap.attach_optimizer``'s scalars);
        the first optimiser noted is kept."""
        if optimizer is None or self._optimizer is not None or self.tap is None:
            return
        self._optimizer = optimizer
        self.tap.scalars.attach_optimizer(optimizer)

    def record_step(self, step: int) -> LayerSummaries | None:
        """Summarise the accumulated gradients of optimiser step ``step``, with the mean of
        the losses noted since the previous step.

        Raises:
            RuntimeError: before :meth:`begin_run`.
        """
        if self.tap is None:
            raise RuntimeError("gradstream callback: optimiser step before the train start hook")
        if self._loss_count:
            self.tap.record_scalars(loss=self._loss_sum / self._loss_count)
            self._loss_sum, self._loss_count = None, 0
        return self.tap.step(int(step))

    def end_run(self) -> None:
        """Flush the tap, finish the run and close the producer, as configured."""
        if self.tap is None:
            return
        self.tap.flush()
        if self._finish_run:
            self.producer.finish_run()
        if self._close_producer:
            self.producer.close()
