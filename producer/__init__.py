"""gradstream producer SDK: runs inside every training rank.

``summarize`` turns a mapping of gradients into per-layer statistics;
``GradientProducer`` sends them to Kafka off the training thread. Importing this package
loads NumPy, pydantic and (lazily) kafka-python only: no DuckDB, no torch, no jax.
"""

from producer.client import GradientProducer, ProducerStats
from producer.settings import ProducerSettings
from producer.summary import LayerSummaries, summarize

__all__ = ["GradientProducer", "LayerSummaries", "ProducerSettings", "ProducerStats", "summarize"]
