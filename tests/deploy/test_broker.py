"""Tests of the local Kafka broker (:mod:`deploy.broker`); its commands are tested in
:mod:`tests.deploy.cli.test_broker`.

Everything here runs a real Kafka (the locked jars from Maven Central, real JVM, real
sockets). The lock, the downloads and the choice of Java are tested in
:mod:`tests.deploy.test_kafka_runtime`; a machine without Java or Maven in
:mod:`tests.deploy.cli.test_broker_fresh_machine`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from deploy.broker import (
    KAFKA_VERSION,
    BrokerError,
    BrokerStatus,
    LocalBroker,
    resolve_kafka,
)
from deploy.kafka_runtime import load_lock

# ----------------------------------------------------------------------------- helpers


def _create_topic(bootstrap: str, topic: str, partitions: int = 4) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=30000)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    finally:
        admin.close()


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        futures = [producer.send(topic, value=v) for v in values]
        producer.flush(timeout=30)
        for f in futures:
            f.get(timeout=30)
    finally:
        producer.close(timeout=10)


def _consume_all(bootstrap: str, topic: str, expected: int, timeout: float = 60.0) -> list[bytes]:
    """Read every partition of ``topic`` from the beginning until ``expected`` messages."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    try:
        deadline = time.monotonic() + timeout
        partitions = None
        while not partitions and time.monotonic() < deadline:
            partitions = consumer.partitions_for_topic(topic)
            if not partitions:
                time.sleep(0.2)
        assert partitions, f"topic {topic} has no partitions"
        consumer.assign([TopicPartition(topic, p) for p in sorted(partitions)])
        consumer.seek_to_beginning()
        got: list[bytes] = []
        while len(got) < expected and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                got.extend(r.value for r in records)
        return got
    finally:
        consumer.close()


def file_repository(root: Path) -> str:
    """A ``file://`` Maven 2 layout repository under ``root`` holding the locked jars
    (symbolic links to the cached ones, resolved first), for offline resolutions."""
    libs = resolve_kafka(quiet=True)
    for jar in load_lock().jars:
        path = root / jar.repository_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(libs / jar.file_name)
    return root.as_uri()


# ----------------------------------------------------------------------------- resolve


def test_resolve_is_cached() -> None:
    first = resolve_kafka()
    start = time.monotonic()
    second = resolve_kafka()
    elapsed = time.monotonic() - start
    assert first == second
    assert elapsed < 0.5
    assert (first / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file()
    assert (first / f"kafka-clients-{KAFKA_VERSION}.jar").is_file()
    assert any(p.name.startswith("log4j-slf4j-impl-") for p in first.glob("*.jar"))


def test_resolve_fresh_cache_dir_concurrently(tmp_path: Path) -> None:
    """Two racing resolutions into an empty cache both succeed with the same result."""
    repository = file_repository(tmp_path / "repository")
    cache = tmp_path / "cache"
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(resolve_kafka(cache, repository=repository, quiet=True))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert len(results) == 2 and results[0] == results[1]
    libs = results[0]
    assert libs == cache / f"kafka-{KAFKA_VERSION}" / "libs"
    lock = load_lock()
    assert sorted(p.name for p in libs.glob("*.jar")) == sorted(j.file_name for j in lock.jars)
    assert all(not (libs / j.file_name).is_symlink() for j in lock.jars)  # copies
    # No temporary directories or partial files left behind.
    assert sorted(p.name for p in libs.parent.iterdir()) == ["libs"]
    assert not list(libs.glob(".*.part"))

    start = time.monotonic()
    assert resolve_kafka(cache, repository="file:///nonexistent", quiet=True) == libs
    assert time.monotonic() - start < 0.5


def test_resolve_uses_cache_env_and_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache directory whose marker records the current lock is returned as is: no
    download (the repository does not exist), no Java, no Maven."""
    libs = tmp_path / "cache" / f"kafka-{KAFKA_VERSION}" / "libs"
    libs.mkdir(parents=True)
    (libs / ".gradstream-complete").write_text(
        json.dumps({"lock_sha256": load_lock().digest}) + "\n"
    )
    monkeypatch.setenv("GRADSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GRADSTREAM_MAVEN_REPOSITORY", "file:///nonexistent")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert resolve_kafka() == libs


def test_maven_era_cache_is_kept_and_outdated_one_replaced(tmp_path: Path) -> None:
    """A cache completed by Maven before the lock existed (marker without a lock digest)
    holding exactly the locked files is kept without a download; one with a wrong file is
    replaced by a fresh download."""
    lock = load_lock()
    cached = resolve_kafka(quiet=True)
    libs = tmp_path / "cache" / f"kafka-{KAFKA_VERSION}" / "libs"
    libs.mkdir(parents=True)
    for jar in lock.jars:
        (libs / jar.file_name).write_bytes((cached / jar.file_name).read_bytes())
    marker = libs / ".gradstream-complete"
    marker.write_text(json.dumps({"kafka_version": KAFKA_VERSION, "jars": len(lock.jars)}) + "\n")

    assert resolve_kafka(tmp_path / "cache", repository="file:///nonexistent") == libs
    assert json.loads(marker.read_text())["lock_sha256"] == lock.digest

    # A file differing from the lock under a marker without digest: downloaded anew.
    marker.write_text("{}\n")
    victim = libs / lock.jars[0].file_name
    victim.write_bytes(b"not the jar")
    with pytest.raises(BrokerError, match="Cannot download"):
        resolve_kafka(tmp_path / "cache", repository="file:///nonexistent", quiet=True)
    repository = file_repository(tmp_path / "repository")
    assert resolve_kafka(tmp_path / "cache", repository=repository, quiet=True) == libs
    assert victim.read_bytes() == (cached / victim.name).read_bytes()
    assert json.loads(marker.read_text())["lock_sha256"] == lock.digest
    assert sorted(p.name for p in libs.parent.iterdir()) == ["libs"]


def test_resolve_needs_neither_java_nor_maven(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repository = file_repository(tmp_path / "repository")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    libs = resolve_kafka(tmp_path / "cache", repository=repository, quiet=True)
    assert (libs / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file()


def test_start_with_unusable_java_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolve_kafka(quiet=True)  # jars cached: only java is wrong
    monkeypatch.setenv("GRADSTREAM_JAVA", str(tmp_path / "no-such-java"))
    broker = LocalBroker(tmp_path / "state")
    with pytest.raises(BrokerError) as info:
        broker.start(timeout=10)
    message = str(info.value)
    assert "GRADSTREAM_JAVA" in message and "is not an executable file" in message
    assert "17 or 21" in message
    assert not broker.status().running


# ----------------------------------------------------------------------------- broker


def test_produce_and_consume_100_messages(local_broker: LocalBroker, unique_name: str) -> None:
    bootstrap = local_broker.start()
    assert bootstrap == f"127.0.0.1:{local_broker.port}"
    topic = f"test-roundtrip-{unique_name}"
    _create_topic(bootstrap, topic)
    values = [f"message-{i}".encode() for i in range(100)]
    _produce(bootstrap, topic, values)
    got = _consume_all(bootstrap, topic, expected=100)
    assert sorted(got) == sorted(values)


def test_auto_created_topic_and_large_message(local_broker: LocalBroker, unique_name: str) -> None:
    bootstrap = local_broker.start()
    topic = f"test-auto-{unique_name}"
    big = os.urandom(5 * 1024 * 1024)  # above Kafka's 1 MiB default, below our 20 MiB
    producer = KafkaProducer(bootstrap_servers=bootstrap, max_request_size=8 * 1024 * 1024)
    try:
        producer.send(topic, value=big).get(timeout=60)
    finally:
        producer.close(timeout=10)
    assert _consume_all(bootstrap, topic, expected=1) == [big]


def test_stop_and_restart_keeps_data(local_broker: LocalBroker, unique_name: str) -> None:
    bootstrap = local_broker.start()
    topic = f"test-restart-{unique_name}"
    _create_topic(bootstrap, topic)
    before = [f"before-{i}".encode() for i in range(50)]
    _produce(bootstrap, topic, before)

    local_broker.stop()
    stopped = local_broker.status()
    assert isinstance(stopped, BrokerStatus)
    assert not stopped.running
    assert stopped.pid is None
    assert stopped.bootstrap == bootstrap
    local_broker.stop()  # idempotent

    assert local_broker.start() == bootstrap  # same ports
    running = local_broker.status()
    assert running.running and running.pid is not None
    assert running.log == local_broker.state_dir / "broker.log"

    after = [f"after-{i}".encode() for i in range(10)]
    _produce(bootstrap, topic, after)
    got = _consume_all(bootstrap, topic, expected=60)
    assert sorted(got) == sorted(before + after)


def test_from_state_sees_and_controls_the_same_broker(local_broker: LocalBroker) -> None:
    bootstrap = local_broker.start()
    other = LocalBroker.from_state(local_broker.state_dir)
    status = other.status()
    assert status.running
    assert status.pid == local_broker.status().pid
    assert other.bootstrap == bootstrap
    assert other.start() == bootstrap  # already running: no second JVM
    assert other.status().pid == status.pid


def test_status_of_never_started_broker(tmp_path: Path) -> None:
    broker = LocalBroker(tmp_path)
    status = broker.status()
    assert status == BrokerStatus(running=False, pid=None, bootstrap=None, log=broker.log_path)
    broker.stop()  # nothing to stop: no error
    with pytest.raises(BrokerError):
        LocalBroker.from_state(tmp_path / "nothing-here")


def test_port_in_use_is_reported(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        broker = LocalBroker(tmp_path, port=port)
        with pytest.raises(BrokerError, match=f"127.0.0.1:{port} is already in use"):
            broker.start(timeout=30)
        assert not broker.status().running


def test_broker_that_exits_reports_its_log(tmp_path: Path) -> None:
    broker = LocalBroker(tmp_path, heap="not-a-size")  # the JVM refuses to start
    with pytest.raises(BrokerError) as info:
        broker.start(timeout=60)
    message = str(info.value)
    assert "exited during startup" in message
    assert str(tmp_path / "broker.log") in message
    assert "heap" in message.lower()
    assert not broker.status().running


def test_context_manager(tmp_path: Path, unique_name: str) -> None:
    with LocalBroker(tmp_path, heap="384m") as broker:
        assert broker.status().running
        topic = f"test-ctx-{unique_name}"
        _produce(broker.bootstrap, topic, [b"x"])
        assert _consume_all(broker.bootstrap, topic, expected=1) == [b"x"]
    assert not broker.status().running


def test_kafka_bootstrap_fixture_serves(kafka_bootstrap: str, unique_name: str) -> None:
    topic = f"test-fixture-{unique_name}"
    _produce(kafka_bootstrap, topic, [b"a", b"b", b"c"])
    assert sorted(_consume_all(kafka_bootstrap, topic, expected=3)) == [b"a", b"b", b"c"]


def test_cluster_id_starting_with_dash_formats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random cluster id may begin with '-' (base64url); formatting must still work."""
    import deploy.broker as broker_module

    monkeypatch.setattr(broker_module, "_new_cluster_id", lambda: "-AbCdEfGhIjKlMnOpQrStU")
    with LocalBroker(tmp_path / "dash") as broker:
        assert broker.status().running
