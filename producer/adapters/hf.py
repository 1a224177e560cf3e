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

Training scalars: the learning rate of each parameter group of the Trainer's optimiser,
and this rank's loss, the mean over the step's micro-batches of the model output's
``loss`` (a forward hook on the model: a Hugging Face model computes it when given
labels; a model whose output has no ``loss`` sends none). The loss scale stays inside
``accelerate`` and is not sent.

The Trainer calls ``on_pre_optimizer_step`` after it clipped the gradients
(``TrainingArguments.max_grad_norm``, default 1.0): the statistics are those of the
gradients the optimiser receives, so with clipping active the total norm seen is at most
``max_grad_norm`` (the run's config records ``max_grad_norm``). NaN/Inf still show, and a
layer's share of the norm is unaffected. DeepSpeed keeps gradients outside ``.grad`` and
is not supported.

Structural exclusion (``ignore_attention_key_bias``, off by default). The key bias of a
softmax self-attention gets a gradient that is zero by construction: it adds ``q . b_k``,
the same constant, to every score of a query's row, and softmax is invariant to that
shift, so its gradient is the rounding residue of an exact cancellation, below the
vanishing threshold at every step. By default such a layer counts as vanishing, as in the
reference (trustformers-debug, gradient_flow), and the report lists it as a finding
("gradient at rounding level since step 0"), so a BERT run is not Healthy. With
``ignore_attention_key_bias=True`` the callback finds those parameters from the model's
structure (:func:`attention_key_biases`: every module whose class name ends with
``SelfAttention`` holding a ``key`` ``nn.Linear`` with a bias, as ``BertSelfAttention``,
``RobertaSelfAttention``, ``ViTSelfAttention``), never from their magnitude, and sends
their exact layer names as the run's ``ignore_layers``: the run records them, the health
leaves their vanishing / exploding flags out, and the report names them ("excluded by run
setting"). Fused projections (GPT-2's ``c_attn``) hold the key bias in a slice of one
parameter and are not excluded.

``GradstreamCallback`` is created on first access, as a subclass of
``transformers.TrainerCallback``: importing this module works without transformers, and
accessing the class without it raises an ImportError naming the package to install.
"""

from __future__ import annotations

from typing import Any

from producer.adapters.optional import lazy_class

__all__ = ["GradstreamCallback", "attention_key_biases"]  # noqa: F822 - lazy class

KEY_BIAS_REASON = (
    "key bias of softmax self-attention: zero gradient by construction (softmax is "
    "invariant to the row-constant shift q . b_k)"
)
"""Why :func:`attention_key_biases` are excluded; recorded in the run's config
(``ignore_layers_structural.reason``)."""


def attention_key_biases(model: Any) -> list[Any]:
    """The key-projection biases of a model's softmax self-attention modules, by structure.

    A module counts when its class name ends with ``SelfAttention`` (Hugging Face's
    ``BertSelfAttention``, ``RobertaSelfAttention``, ``ViTSelfAttention``, ...) and it has a
    child ``key`` that is a ``torch.nn.Linear`` with a bias. Nothing is measured.

    Args:
        model: a ``torch.nn.Module``.

    Returns:
        The bias ``Parameter`` objects, in ``named_modules`` order (each once).
    """
    import torch

    found: list[Any] = []
    seen: set[int] = set()
    for _, module in model.named_modules():
        if not type(module).__name__.endswith("SelfAttention"):
            continue
        key = getattr(module, "key", None)
        bias = getattr(key, "bias", None) if isinstance(key, torch.nn.Linear) else None
        if bias is not None and id(bias) not in seen:
            seen.add(id(bias))
            found.append(bias)
    return found

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

    from producer.adapters.callbacks import RunRecorder, TapCallback

    class GradstreamCallback(TapCallback, TrainerCallback):  # type: ignore[misc, valid-type]
        """Hugging Face ``TrainerCallback`` sending one gradient summary per optimiser step.

        Args:
            producer: the rank's ``GradientProducer``; its ``rank`` and ``world_size`` must
                equal ``args.process_index`` / ``args.world_size``.
            ignore_attention_key_bias: also exclude the key biases of softmax
                self-attention, found from the model's structure (module doc,
                :func:`attention_key_biases`). Off by default: they count as vanishing,
                as in the reference, and the report lists them as a finding.
            **options: the options of :class:`~producer.adapters.callbacks.TapCallback`
                (``every_n_steps``, ``include``, ``exclude``, ``name_fn``, thresholds,
                ``config``, ``finish_run``, ``close_producer``, ``ignore_layers``); the
                callback adds ``framework`` to ``config`` (transformers version,
                gradient_accumulation_steps, max_grad_norm, learning_rate).

        Raises:
            TypeError / ValueError: invalid ``every_n_steps``.
            ValueError: (in ``on_train_begin``) producer rank/world size differ from the
                Trainer's, or the selection is empty.

        Attributes:
            tap: the ``GradientTap`` built in ``on_train_begin`` (None before), with its
                counters (``steps_recorded``, ``skipped_without_grad``, ...).
        """

        def __init__(
            self, producer: RunRecorder, *, ignore_attention_key_bias: bool = False,
            **options: Any,
        ) -> None:
            super().__init__(
                producer,
                structural_ignore=attention_key_biases if ignore_attention_key_bias else None,
                structural_reason=KEY_BIAS_REASON,
                **options,
            )

        def on_train_begin(
            self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
        ) -> None:
            """Build the tap on ``model`` and announce the run (``start_run``)."""
            self.begin_run(
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
            self._loss_hook = model.register_forward_hook(self._output_loss)
            self.note_optimizer(kwargs.get("optimizer"))

        def _output_loss(self, module: Any, inputs: Any, output: Any) -> None:
            """Forward hook: note the micro-batch's ``output.loss`` in training mode."""
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, dict):
                loss = output.get("loss")
            if loss is not None and module.training and getattr(loss, "ndim", 1) == 0:
                self.note_loss(loss)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """Summarise the accumulated gradients of optimiser step ``state.global_step``."""
            self.note_optimizer(kwargs.get("optimizer"))
            self.record_step(state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """Finish the run (and close the producer when asked to)."""
            hook = getattr(self, "_loss_hook", None)
            if hook is not None:
                hook.remove()
            self.end_run()

    return GradstreamCallback


__getattr__ = lazy_class(globals(), "GradstreamCallback", _build_callback_class)
