"""Hugging Face ``transformers`` adapter: a ``TrainerCallback`` that streams gradient summaries.

Usage::

    from producer import GradientProducer
    from producer.adapters.hf import GradstreamCallback

    producer = GradientProducer("run-42", rank=args.process_index, world_size=args.world_size)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[GradstreamCallback(producer, close_producer=True)])
    trainer.train()

``on_train_begin`` builds a :class:`~producer.adapters.torch.GradientTap` on the model and
calls ``start_run``; ``on_pre_optimizer_step`` summarises the accumulated gradients once
per optimiser step (gradient accumulation gives one summary, numbered
``state.global_step``, 0-based); ``on_train_end`` calls ``finish_run``.

The Trainer calls ``on_pre_optimizer_step`` after it clipped the gradients
(``TrainingArguments.max_grad_norm``, default 1.0): the statistics are those of the
gradients the optimiser receives, so with clipping active the total norm seen is at most
``max_grad_norm`` (the run's config records ``max_grad_norm``). NaN/Inf still show, and a
layer's share of the norm is unaffected. DeepSpeed keeps gradients outside ``.grad`` and
is not supported.

``GradstreamCallback`` is created on first access, as a subclass of
``transformers.TrainerCallback``: importing this module works without transformers, and
accessing the class without it raises an ImportError naming the package to install.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GradstreamCallback"]  # noqa: F822 - created lazily by __getattr__

_PIP_HINT = "pip install 'transformers>=4.47' accelerate (or pip install 'gradstream[hf]')"


def _build_callback_class() -> type:
    try:
        import transformers
        from transformers import TrainerCallback
    except ImportError as exc:
        raise ImportError(
            f"producer.adapters.hf.GradstreamCallback needs Hugging Face transformers: {_PIP_HINT}"
        ) from exc
    if not hasattr(TrainerCallback, "on_pre_optimizer_step"):
        raise ImportError(
            f"transformers {transformers.__version__} has no TrainerCallback."
            f"on_pre_optimizer_step; gradstream needs a newer one: {_PIP_HINT}"
        )

    from collections.abc import Callable, Iterable, Mapping

    from producer.adapters.naming import normalize_name
    from producer.adapters.torch import RunRecorder, _TapSession

    class GradstreamCallback(TrainerCallback):  # type: ignore[misc, valid-type]
        """Hugging Face ``TrainerCallback`` sending one gradient summary per optimiser step.

        Args:
            producer: the rank's ``GradientProducer`` (or any object with ``start_run``,
                ``record_summaries``, ``finish_run``, ``close``); its ``rank`` and
                ``world_size`` must equal ``args.process_index`` / ``args.world_size``.
            every_n_steps: summarise only steps whose number is a multiple of n (combined
                with the producer's own ``every_n_steps``, see ``GradientTap``).
            include: fnmatch pattern(s) on normalised parameter names to watch.
            exclude: fnmatch pattern(s) on normalised parameter names to leave out.
            name_fn: raw parameter name -> layer name (default ``normalize_name``).
            vanishing_threshold: mean |g| below which a layer is vanishing.
            exploding_threshold: max |g| above which a layer is exploding.
            config: extra JSON-serialisable run configuration for ``start_run``; the
                callback adds ``framework`` (transformers version,
                gradient_accumulation_steps, max_grad_norm, learning_rate).
            finish_run: call ``producer.finish_run()`` in ``on_train_end`` (default True).
            close_producer: also call ``producer.close()`` there (default False).

        Raises:
            TypeError / ValueError: invalid ``every_n_steps``.
            ValueError: (in ``on_train_begin``) producer rank/world size differ from the
                Trainer's, or the selection is empty.

        Attributes:
            tap: the ``GradientTap`` built in ``on_train_begin`` (None before), with its
                counters (``steps_recorded``, ``skipped_without_grad``, ...).
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
        ) -> None:
            self._session = _TapSession(
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
            )

        @property
        def tap(self) -> Any:
            """The ``GradientTap`` of the current run, or None before ``on_train_begin``."""
            return self._session.tap

        def on_train_begin(
            self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
        ) -> None:
            """Build the tap on ``model`` and announce the run (``start_run``)."""
            self._session.begin(
                model,
                rank=args.process_index,
                world_size=args.world_size,
                framework={
                    "name": "transformers",
                    "version": transformers.__version__,
                    "gradient_accumulation_steps": args.gradient_accumulation_steps,
                    "max_grad_norm": args.max_grad_norm,
                    "learning_rate": args.learning_rate,
                },
            )

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """Summarise the accumulated gradients of optimiser step ``state.global_step``."""
            self._session.step(state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """Finish the run (and close the producer when asked to)."""
            self._session.end()

    GradstreamCallback.__module__ = __name__
    GradstreamCallback.__qualname__ = "GradstreamCallback"
    return GradstreamCallback


def __getattr__(name: str) -> Any:
    """Create ``GradstreamCallback`` on first access (imports transformers then).

    Raises:
        ImportError: transformers is missing or too old (names the pip package).
        AttributeError: any other name.
    """
    if name == "GradstreamCallback":
        cls = _build_callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
