"""Kafka topics: creating those a process needs (workers and the store writer), naming a
partition, and the error of a topic that does not exist."""

from __future__ import annotations

import contextlib
from typing import Any

from schemas.kafka_settings import TopicCreationSettings

__all__ = ["PartitionKey", "TopicMissingError", "ensure_topics", "subscribe_with_metadata"]

PartitionKey = tuple[str, int]
"""(topic, partition)."""


class TopicMissingError(RuntimeError):
    """A topic a reader was pointed at does not exist (no worker has created it yet)."""


def ensure_topics(
    settings: TopicCreationSettings, topics: list[str], compacted: bool = False
) -> None:
    """Create ``topics`` with ``settings.partitions`` partitions if they do not exist
    (``compacted``: with ``cleanup.policy=compact``, one retained record per key), and
    return only once the new topics are in the brokers' metadata with a leader for every
    partition: a consumer subscribing earlier would be assigned no partitions and keep
    that empty assignment until its next metadata refresh (minutes).

    Raises:
        kafka.errors.KafkaError: the cluster cannot be reached or refuses.
        kafka.errors.KafkaTimeoutError: a topic has no leader after 30 s.
    """
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(**settings.kafka_kwargs())
    try:
        existing = set(admin.list_topics())
        missing = [t for t in topics if t not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics([
                    NewTopic(t, settings.partitions, settings.replication_factor,
                             topic_configs={"cleanup.policy": "compact"} if compacted else {})
                    for t in missing
                ])
        admin.wait_for_topics(topics, timeout_ms=30_000)
    finally:
        admin.close()


def subscribe_with_metadata(consumer: Any, topics: list[str], listener: Any) -> None:
    """Subscribe ``consumer`` (a kafka-python ``KafkaConsumer``) to ``topics`` once its
    metadata cache knows their partitions.

    Subscribing with an empty cache lets the group join before the topics' partitions are
    known: the member is assigned no partition, and kafka-python 3.0 does not always
    rejoin when the metadata arrives, which leaves it idle until its next metadata refresh
    (``metadata_max_age_ms``, 5 minutes). ``partitions_for_topic`` fills the cache first.

    Raises:
        kafka.errors.KafkaError: the cluster cannot be reached.
    """
    for topic in topics:
        consumer.partitions_for_topic(topic)
    consumer.subscribe(topics, listener=listener)
