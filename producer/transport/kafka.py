"""The Kafka connection of a producer: the kafka-python client and the record size limit."""

from __future__ import annotations

import logging
from typing import Any, Literal, NamedTuple

from producer.settings import ProducerSettings

log = logging.getLogger("gradstream.producer")

RECORD_OVERHEAD = 512
"""Bytes kept free below the message limit for the record batch and record headers
(61 + about 30 bytes in Kafka's v2 format) besides the key."""


STEP_KEY_DIGITS = 20
"""Decimal digits of the largest step a ``"step"`` key is sized for (steps below 10**20;
an int64 step has at most 19): the value limit counts the longest key a sender sends."""


def record_key(run_id: str, partition_key: Literal["run", "step"],
               step: int | None = None) -> bytes:
    """The Kafka record key of a message of ``run_id`` (UTF-8 bytes).

    ``partition_key="run"`` (the default of :class:`producer.settings.ProducerSettings`):
    the run id, so every message of the run lands in one partition, in order per rank,
    and one worker merges the whole run. ``"step"``: a StepSummary (``step`` given) is
    keyed ``f"{run_id}/{step}"``, so every rank and part of one step share a partition
    (one worker merges each frame) while the steps of one run spread over the partitions
    (scale-out workers, ``gradstream consume --frames-topic``); run start / finish and
    local-view messages (``step`` None) keep the run-id key.

    Args:
        run_id: the run's id. partition_key: the producer's setting.
        step: the optimiser step of a StepSummary; None for any other message.

    Returns:
        The key bytes.
    """
    if partition_key == "step" and step is not None:
        return f"{run_id}/{step}".encode()
    return run_id.encode()


def longest_key(run_id: str, partition_key: Literal["run", "step"]) -> bytes:
    """The longest key :func:`record_key` gives a run's messages (a step of
    :data:`STEP_KEY_DIGITS` digits): what the record size limit must leave room for."""
    return record_key(run_id, partition_key, 10 ** STEP_KEY_DIGITS - 1)


class KafkaConnection(NamedTuple):
    """A connected kafka-python ``KafkaProducer`` and the largest record value it may send.

    Attributes:
        client: the ``kafka.KafkaProducer``.
        value_limit: bytes: the cluster's message limit (:func:`topic_message_limit`,
            at most ``settings.max_request_size``) less :data:`RECORD_OVERHEAD` and the key.
    """

    client: Any
    value_limit: int


def connect(settings: ProducerSettings, key: bytes) -> KafkaConnection:
    """Create the Kafka client of ``settings`` and size its batches below the cluster's
    message limit.

    The client connects first (an unreachable broker fails here, once); then the limit is
    read and, when it is below the configured batch size, the client is made again with
    batches of the limit (a batch larger than the limit is refused as a whole).

    Args:
        settings: the producer's settings (bootstrap servers, security, acks, ...).
        key: the record key every message carries (its length counts against the limit).

    Returns:
        The :class:`KafkaConnection`.

    Raises:
        Exception: whatever kafka-python raises when the broker cannot be reached.
    """
    from kafka import KafkaProducer

    s = settings

    def producer(batch_size: int) -> Any:
        return KafkaProducer(
            **s.kafka_kwargs(),
            acks=-1 if s.acks == "all" else int(s.acks),
            enable_idempotence=s.enable_idempotence,
            compression_type=None if s.compression_type == "none" else s.compression_type,
            linger_ms=s.linger_ms,
            batch_size=batch_size,
            max_request_size=s.max_request_size,
            delivery_timeout_ms=s.delivery_timeout_ms,
            request_timeout_ms=s.request_timeout_ms,
            max_block_ms=s.max_block_ms,
        )

    batch_size = min(s.batch_size, s.message_max_bytes, s.max_request_size)
    client = producer(batch_size)
    limit = min(topic_message_limit(s), s.max_request_size)
    if limit < batch_size:
        client.close(timeout=0)
        client = producer(limit)
    return KafkaConnection(client, limit - RECORD_OVERHEAD - len(key))


def topic_message_limit(settings: ProducerSettings) -> int:
    """The topic's ``max.message.bytes`` (its own or the broker's default), read with the
    admin client; ``settings.message_max_bytes`` when it cannot be read (no
    DescribeConfigs permission, topic not created yet).

    Returns:
        The limit in bytes.
    """
    s = settings
    try:
        from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

        admin = KafkaAdminClient(**s.kafka_kwargs(),
                                 request_timeout_ms=min(s.request_timeout_ms, 10_000))
        try:
            found = admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, s.topic, ["max.message.bytes"])],
                config_filter="all",
            )
        finally:
            admin.close()
        entry = found["topic"][s.topic]["max.message.bytes"]
        value = int(entry["value"] if isinstance(entry, dict) else entry)
        log.debug("topic %s: max.message.bytes = %d", s.topic, value)
        return value
    except Exception as exc:  # any failure: the documented fallback
        log.info("cannot read max.message.bytes of %s (%s); assuming %d bytes", s.topic,
                 exc, s.message_max_bytes)
        return s.message_max_bytes
