"""Framework adapters of the producer SDK: PyTorch, JAX, Hugging Face and Lightning.

* :mod:`producer.adapters.torch`: :class:`GradientTap` (one summary per optimiser step,
  computed on the gradients' device, one small host transfer);
  :mod:`producer.adapters.torch_summary`: :func:`summarize_tensors` (host threads or
  batched device reductions, :mod:`producer.adapters.torch_device`);
  :mod:`producer.adapters.torch_layout`: which piece of a parameter a rank holds under
  ``torch.distributed``, and the layouts refused.
* :mod:`producer.adapters.jax`: :func:`flatten_gradients` / :func:`layer_numel` turn
  pytrees into the ``{name: array}`` mappings of ``GradientProducer.record_step``.
* :mod:`producer.adapters.hf` / :mod:`producer.adapters.lightning`: ``GradstreamCallback``
  for the Hugging Face ``Trainer`` and the Lightning ``Trainer``, both on
  :class:`~producer.adapters.callbacks.TapCallback`.
* :mod:`producer.adapters.naming`: :func:`normalize_name` removes DDP / FSDP /
  ``torch.compile`` / checkpoint-wrapper components from parameter names.

Importing this package (or any of its modules) imports neither torch, jax, transformers
nor lightning: each is imported when a function or class that needs it is used, and a
missing one raises an ImportError naming the pip package (:mod:`producer.adapters.optional`).
"""

from producer.adapters.jax import flatten_gradients, layer_numel
from producer.adapters.naming import normalize_name
from producer.adapters.torch import GradientTap
from producer.adapters.torch_summary import summarize_tensors

__all__ = [
    "GradientTap",
    "flatten_gradients",
    "layer_numel",
    "normalize_name",
    "summarize_tensors",
]
