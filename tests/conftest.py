"""Shared pytest fixtures: a real Kafka for the tests, and unique names.

Where Kafka comes from (first match wins):

1. ``KAFKA_BOOTSTRAP_SERVERS`` is set: that cluster is used as is.
2. A Docker engine answers: testcontainers' Kafka module starts a container.
3. Otherwise: gradstream's own :class:`deploy.broker.LocalBroker` (real Kafka resolved
   from Maven Central, KRaft, no Docker) in a temporary directory.

There is no fake broker.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from deploy.broker import LocalBroker


def _docker_available() -> bool:
    """Whether a Docker engine answers (testcontainers can then be used)."""
    try:
        import docker

        client = docker.from_env(timeout=5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address (``host:port``) of a real Kafka cluster for the whole session.

    ``KAFKA_BOOTSTRAP_SERVERS`` if set; else a testcontainers Kafka when Docker runs; else
    a :class:`~deploy.broker.LocalBroker` in a temporary directory, stopped at the end of
    the session. Topics are shared across tests: use :func:`unique_name` in topic names.
    """
    env = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip()
    if env:
        yield env
        return

    if _docker_available():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as container:
            yield container.get_bootstrap_server()
        return

    broker = LocalBroker(tmp_path_factory.mktemp("kafka-session"))
    try:
        yield broker.start(timeout=120.0)
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def local_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    """A running :class:`~deploy.broker.LocalBroker` of its own (own state dir and ports).

    For tests that stop and restart a broker (e.g. "data survives a broker restart"); it
    is separate from :func:`kafka_bootstrap`. It is session-scoped and shared: a test that
    stops it must start it again (``local_broker.start()`` is idempotent and returns the
    bootstrap address, so call it at the beginning of every test using this fixture). It is
    stopped at the end of the session.
    """
    broker = LocalBroker(tmp_path_factory.mktemp("kafka-local-broker"))
    broker.start(timeout=120.0)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def unique_name() -> str:
    """A short unique string (10 hex characters) for topic names, run ids, group ids."""
    return uuid.uuid4().hex[:10]
