"""Kafka connection settings shared by producers and consumers (pydantic-settings).

Every field can be given as an argument or through the environment:
``KAFKA_BOOTSTRAP_SERVERS`` for the bootstrap servers, ``GRADSTREAM_<FIELD>`` for the rest
(e.g. ``GRADSTREAM_SECURITY_PROTOCOL=SASL_SSL``). Arguments win over the environment.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_BOOTSTRAP_SERVERS = "127.0.0.1:9092"


class KafkaClientSettings(BaseSettings):
    """Connection and security settings passed through to kafka-python clients.

    ``bootstrap_servers`` is a comma-separated ``host:port`` list. Security fields map
    one-to-one to kafka-python's options of the same name (SSL, SASL_PLAINTEXT, SASL_SSL).
    """

    model_config = SettingsConfigDict(
        env_prefix="GRADSTREAM_", extra="ignore", populate_by_name=True
    )

    bootstrap_servers: str = Field(
        default=DEFAULT_BOOTSTRAP_SERVERS,
        validation_alias=AliasChoices(
            "bootstrap_servers", "KAFKA_BOOTSTRAP_SERVERS", "GRADSTREAM_BOOTSTRAP_SERVERS"
        ),
    )
    client_id: str | None = None
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True

    @field_validator("bootstrap_servers")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        servers = [s.strip() for s in value.split(",") if s.strip()]
        if not servers:
            raise ValueError("bootstrap_servers is empty: give host:port[,host:port...]")
        return ",".join(servers)

    def kafka_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for kafka-python's KafkaProducer/KafkaConsumer/KafkaAdminClient
        (connection and security only; ``None`` values left out)."""
        keys = (
            "client_id", "security_protocol", "sasl_mechanism", "sasl_plain_username",
            "sasl_plain_password", "ssl_cafile", "ssl_certfile", "ssl_keyfile",
            "ssl_check_hostname",
        )
        kwargs: dict[str, Any] = {"bootstrap_servers": self.bootstrap_servers.split(",")}
        for key in keys:
            value = getattr(self, key)
            if value is not None:
                kwargs[key] = value
        return kwargs


class TopicCreationSettings(KafkaClientSettings):
    """Kafka settings of a process that creates the topics it needs when they are absent
    (workers and the store; :func:`consumer.topic_admin.ensure_topics`).

    Attributes:
        partitions: partitions of a topic the process creates.
        replication_factor: replication factor of a topic the process creates.
    """

    partitions: int = Field(default=4, gt=0)
    replication_factor: int = Field(default=1, gt=0)
