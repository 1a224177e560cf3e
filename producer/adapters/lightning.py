"""PyTorch Lightning adapter: a ``Callback`` that streams gradient summaries.

Usage::

    from producer import GradientProducer
    from producer.adapters.lightning import GradstreamCallback

    producer = GradientProducer("run-42", rank=global_rank, world_size=world_size)
    trainer = lightning.pytorch.Trainer(callbacks=[GradstreamCallback(producer)], ...)
    trainer.fit(module, data)

``on_train_start`` builds a :class:`~producer.adapters.torch.GradientTap` on the
LightningModule and calls ``start_run``; ``on_before_optimizer_step`` summarises the
gradients once per optimiser step (after ``accumulate_grad_batches`` micro-batches; with
AMP after unscaling; before gradient clipping), numbered ``trainer.global_step``
(0-based); ``on_train_end`` calls ``finish_run``.

``GradstreamCallback`` is created on first access, as a subclass of
``lightning.pytorch.Callback`` when the ``lightning`` package is installed, else of
``pytorch_lightning.Callback`` (use it with the matching ``Trainer``). Importing this module
works without either; accessing the class without them raises an ImportError naming the
package to install.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GradstreamCallback"]  # noqa: F822 - created lazily by __getattr__

_PIP_HINT = "pip install lightning (or pip install 'gradstream[lightning]')"


def _lightning_base() -> tuple[type, str, str]:
    try:
        import lightning
        from lightning.pytorch import Callback

        return Callback, "lightning", lightning.__version__
    except ImportError:
        pass
    try:
        import pytorch_lightning
        from pytorch_lightning import Callback

        return Callback, "pytorch_lightning", pytorch_lightning.__version__
    except ImportError as exc:
        raise ImportError(
            f"producer.adapters.lightning.GradstreamCallback needs PyTorch Lightning: {_PIP_HINT}"
        ) from exc


def _build_callback_class() -> type:
    base, package, version = _lightning_base()

    from collections.abc import Callable, Iterable, Mapping

    from producer.adapters.callbacks import RunRecorder, TapSession
    from producer.adapters.naming import normalize_name

    class GradstreamCallback(base):  # type: ignore[misc, valid-type]
        """Lightning ``Callback`` sending one gradient summary per optimiser step.

        Args:
            producer: the rank's ``GradientProducer`` (or any object with ``start_run``,
                ``record_summaries``, ``finish_run``, ``close``); its ``rank`` and
                ``world_size`` must equal ``trainer.global_rank`` / ``trainer.world_size``.
            every_n_steps: summarise only steps whose number is a multiple of n (combined
                with the producer's own ``every_n_steps``, see ``GradientTap``).
            include: fnmatch pattern(s) on normalised parameter names to watch.
            exclude: fnmatch pattern(s) on normalised parameter names to leave out.
            name_fn: raw parameter name -> layer name (default ``normalize_name``).
            vanishing_threshold: mean |g| below which a layer is vanishing.
            exploding_threshold: max |g| above which a layer is exploding.
            config: extra JSON-serialisable run configuration for ``start_run``; the
                callback adds ``framework`` (package, version, accumulate_grad_batches,
                gradient_clip_val).
            finish_run: call ``producer.finish_run()`` in ``on_train_end`` (default True).
            close_producer: also call ``producer.close()`` there (default False).
            local_view: under ``strategy="ddp"``, register the tap's DDP communication hook
                on the wrapped model in ``on_train_start`` (``GradientTap.attach_ddp``), so
                that each summary carries this rank's own pre-all-reduce gradient (default
                False; ignored by strategies that do not wrap the model in DDP).

        Raises:
            TypeError / ValueError: invalid ``every_n_steps``.
            ValueError: (in ``on_train_start``) producer rank/world size differ from the
                Trainer's, or the selection is empty.

        Attributes:
            tap: the ``GradientTap`` built in ``on_train_start`` (None before).
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
            local_view: bool = False,
        ) -> None:
            super().__init__()
            self.local_view = local_view
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
            )

        @property
        def tap(self) -> Any:
            """The ``GradientTap`` of the current run, or None before ``on_train_start``."""
            return self._session.tap

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            """Build the tap on the LightningModule and announce the run (``start_run``);
            with ``local_view``, attach the DDP communication hook."""
            self._session.begin(
                pl_module,
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                framework={
                    "name": package,
                    "version": version,
                    "accumulate_grad_batches": trainer.accumulate_grad_batches,
                    "gradient_clip_val": trainer.gradient_clip_val,
                },
            )
            wrapped = getattr(trainer.strategy, "model", None)
            if self.local_view and hasattr(wrapped, "register_comm_hook"):
                self._session.tap.attach_ddp(wrapped)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            """Summarise the accumulated gradients of optimiser step ``trainer.global_step``."""
            self._session.step(trainer.global_step)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            """Finish the run (and close the producer when asked to)."""
            self._session.end()

    GradstreamCallback.__module__ = __name__
    GradstreamCallback.__qualname__ = "GradstreamCallback"
    return GradstreamCallback


def __getattr__(name: str) -> Any:
    """Create ``GradstreamCallback`` on first access (imports Lightning then).

    Raises:
        ImportError: neither ``lightning`` nor ``pytorch_lightning`` is installed.
        AttributeError: any other name.
    """
    if name == "GradstreamCallback":
        cls = _build_callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
