"""What the framework callbacks (Hugging Face, Lightning) share: a tap built at train
start, one summary per optimiser step, the run finished at train end."""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from producer.adapters.naming import normalize_name
from producer.adapters.torch import GradientTap, SummaryRecorder
from producer.summary import LayerSummaries


class RunRecorder(SummaryRecorder, Protocol):
    """What the framework callbacks need from a producer: a :class:`SummaryRecorder` that
    can also finish the run and close (``GradientProducer`` satisfies it)."""

    def finish_run(self, timeout: float | None = ...) -> bool:
        """Send the run's end and flush (see ``GradientProducer.finish_run``)."""

    def close(self, timeout: float | None = ...) -> Any:
        """Flush and stop the producer (see ``GradientProducer.close``)."""


class TapSession:
    """Shared logic of the framework callbacks (Hugging Face, Lightning): build the tap at
    train start, one summary per optimiser step, finish the run at train end."""

    def __init__(
        self,
        producer: RunRecorder,
        *,
        every_n_steps: int | None,
        include: str | Iterable[str] | None,
        exclude: str | Iterable[str] | None,
        name_fn: Callable[[str], str],
        vanishing_threshold: float,
        exploding_threshold: float,
        config: Mapping[str, Any] | None,
        finish_run: bool,
        close_producer: bool,
        ignore_layers: Iterable[str] = (),
        structural_ignore: Callable[[Any], Iterable[Any]] | None = None,
        structural_reason: str = "",
    ) -> None:
        if isinstance(ignore_layers, str):
            ignore_layers = [ignore_layers]
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
        ):
            raise TypeError(f"every_n_steps must be an int, got {every_n_steps!r}")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.producer = producer
        self.every_n_steps = every_n_steps
        self.include = include
        self.exclude = exclude
        self.name_fn = name_fn
        self.vanishing_threshold = vanishing_threshold
        self.exploding_threshold = exploding_threshold
        self.config = dict(config or {})
        self.finish_run = finish_run
        self.close_producer = close_producer
        self.ignore_layers = list(ignore_layers)
        self.structural_ignore = structural_ignore
        self.structural_reason = structural_reason
        self.tap: GradientTap | None = None

    def begin(
        self, model: Any, *, rank: int, world_size: int, framework: Mapping[str, Any]
    ) -> GradientTap:
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
        tap = GradientTap(
            model,
            self.producer,
            every_n_steps=self.every_n_steps,
            include=self.include,
            exclude=self.exclude,
            name_fn=self.name_fn,
        )
        config = {"framework": dict(framework), **self.config}
        ignore = list(self.ignore_layers)
        if self.structural_ignore is not None:
            # Parameters the adapter knows by the model's structure, never by magnitude:
            # named exactly (glob.escape keeps [, *, ? in names literal).
            names = [n for n in map(tap.layer_name_of, self.structural_ignore(model))
                     if n is not None]
            ignore += [glob.escape(n) for n in names]
            config.setdefault("ignore_layers_structural", {
                "reason": self.structural_reason, "layers": names})
        tap.start_run(
            vanishing_threshold=self.vanishing_threshold,
            exploding_threshold=self.exploding_threshold,
            config=config,
            ignore_layers=ignore,
        )
        self.tap = tap
        return tap

    def step(self, step: int) -> LayerSummaries | None:
        if self.tap is None:
            raise RuntimeError("gradstream callback: optimiser step before the train start hook")
        return self.tap.step(int(step))

    def end(self) -> None:
        if self.tap is None:
            return
        self.tap.flush()
        if self.finish_run:
            self.producer.finish_run()
        if self.close_producer:
            self.producer.close()


class TapCallback:
    """Base of the framework callbacks: holds their :class:`TapSession`.

    A callback class derives from it and from its framework's callback class, calls the
    session's ``begin`` / ``step`` / ``end`` from its hooks and passes its own options
    (keyword arguments of :class:`TapSession`) on to this constructor.

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
        **session: further :class:`TapSession` options (``structural_ignore``,
            ``structural_reason``).

    Raises:
        TypeError / ValueError: invalid ``every_n_steps``.
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
        **session: Any,
    ) -> None:
        super().__init__()
        self._session = TapSession(
            producer,
            every_n_steps=every_n_steps,
            include=include,
            exclude=exclude,
            name_fn=name_fn,
            vanishing_threshold=vanishing_threshold,
            exploding_threshold=exploding_threshold,
            config=config,
            finish_run=finish_run,
            close_producer=close_producer,
            ignore_layers=ignore_layers,
            **session,
        )

    @property
    def tap(self) -> GradientTap | None:
        """The ``GradientTap`` of the current run, or None before the train start hook."""
        return self._session.tap
