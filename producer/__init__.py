"""gradstream producer SDK: runs inside every training rank.

``summarize`` turns a mapping of gradients into per-layer statistics;
``GradientProducer`` sends them to Kafka off the training thread. Importing this package
loads NumPy, pydantic and (lazily) kafka-python only: no DuckDB, no torch, no jax.

Layout:

- :mod:`producer.client`: the run API (``GradientProducer``: start a run, record steps,
  finish, close, counters); :mod:`producer.settings`: its settings;
  :mod:`producer.selection`: which layers are watched.
- :mod:`producer.summary` (gradients) and :mod:`producer.weights` (weights): the
  statistics, computed by the numba kernels (:mod:`producer.kernels`) or NumPy, as
  :mod:`producer.backend` chose once.
- :mod:`producer.transport`: the bounded queue and sender thread, the Kafka connection,
  the message encoding.
- :mod:`producer.adapters`: PyTorch, JAX, Hugging Face and Lightning.
"""

from producer.client import GradientProducer, ProducerStats
from producer.settings import ProducerSettings
from producer.summary import LayerSummaries, summarize

__all__ = ["GradientProducer", "LayerSummaries", "ProducerSettings", "ProducerStats", "summarize"]
