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

Training scalars: this rank's loss (the mean over the step's micro-batches of the loss
``training_step`` returned, read in ``on_before_backward``), the learning rate of each
parameter group of the optimiser, and with ``precision="16-mixed"`` the loss scale of the
precision plugin's ``GradScaler``.

``GradstreamCallback`` is created on first access, as a subclass of
``lightning.pytorch.Callback`` when the ``lightning`` package is installed, else of
``pytorch_lightning.Callback`` (use it with the matching ``Trainer``). Importing this module
works without either; accessing the class without them raises an ImportError naming the
package to install.
"""

from __future__ import annotations

from typing import Any

from producer.adapters.optional import lazy_class

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

    from producer.adapters.callbacks import RunRecorder, TapCallback

    class GradstreamCallback(TapCallback, base):  # type: ignore[misc, valid-type]
        """Lightning ``Callback`` sending one gradient summary per optimiser step.

        Args:
            producer: the rank's ``GradientProducer``; its ``rank`` and ``world_size`` must
                equal ``trainer.global_rank`` / ``trainer.world_size``.
            local_view: under ``strategy="ddp"``, register the tap's DDP communication hook
                on the wrapped model in ``on_train_start`` (``GradientTap.attach_ddp``), so
                that each summary carries this rank's own pre-all-reduce gradient (default
                False; ignored by strategies that do not wrap the model in DDP).
            **options: the options of :class:`~producer.adapters.callbacks.TapCallback`
                (``every_n_steps``, ``include``, ``exclude``, ``name_fn``, thresholds,
                ``config``, ``finish_run``, ``close_producer``, ``ignore_layers``); the
                callback adds ``framework`` to ``config`` (package, version,
                accumulate_grad_batches, gradient_clip_val).

        Raises:
            TypeError / ValueError: invalid ``every_n_steps``.
            ValueError: (in ``on_train_start``) producer rank/world size differ from the
                Trainer's, or the selection is empty.

        Attributes:
            tap: the ``GradientTap`` built in ``on_train_start`` (None before).
        """

        def __init__(self, producer: RunRecorder, *, local_view: bool = False,
                     **options: Any) -> None:
            super().__init__(producer, **options)
            self.local_view = local_view

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            """Build the tap on the LightningModule and announce the run (``start_run``);
            with ``local_view``, attach the DDP communication hook."""
            self.begin_run(
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
                self.tap.attach_ddp(wrapped)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if scaler is not None and hasattr(scaler, "get_scale"):
                self.tap.attach_scaler(scaler)

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            """Note this micro-batch's loss (the step's loss is their mean). Lightning
            hands over the loss already divided by ``accumulate_grad_batches`` (so that
            the accumulated gradient is a mean): multiplied back, it is the value
            ``training_step`` returned."""
            self.note_loss(loss * trainer.accumulate_grad_batches)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            """Summarise the accumulated gradients of optimiser step ``trainer.global_step``
            with the step's loss and the optimiser's learning rates."""
            self.note_optimizer(optimizer)
            self.record_step(trainer.global_step)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            """Finish the run (and close the producer when asked to)."""
            self.end_run()

    return GradstreamCallback


__getattr__ = lazy_class(globals(), "GradstreamCallback", _build_callback_class)
