"""Record keys of the producer (producer.transport.kafka.record_key, ``partition_key``):
the run id by default; ``run_id/step`` for a StepSummary with ``partition_key="step"``, so
all ranks of one step share a partition while a run's steps spread over the partitions."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaConsumer
from kafka.admin import KafkaAdminClient, NewTopic

from producer import GradientProducer
from producer.settings import ProducerSettings
from producer.transport.kafka import RECORD_OVERHEAD, longest_key, record_key
from schemas.wire import RunFinished, RunStarted, StepSummary, decode_message
from tests.producer import grads, numel

STEPS = 40
PARTITIONS = 4


def test_record_key_by_run_and_by_step() -> None:
    assert record_key("run-1", "run", 7) == b"run-1"
    assert record_key("run-1", "step", 7) == b"run-1/7"
    assert record_key("run-1", "step") == b"run-1"  # start, finish, local view
    assert len(longest_key("r", "step")) == len(b"r/") + 20
    assert longest_key("r", "run") == b"r"


def test_partition_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ProducerSettings().partition_key == "run"
    monkeypatch.setenv("GRADSTREAM_PARTITION_KEY", "step")
    assert ProducerSettings().partition_key == "step"
    monkeypatch.setenv("GRADSTREAM_PARTITION_KEY", "layer")
    with pytest.raises(ValueError, match="partition_key"):
        ProducerSettings()


def _records(bootstrap: str, topic: str, expected: int) -> list:
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=2000)
    out: list = []
    deadline = time.monotonic() + 30
    while len(out) < expected and time.monotonic() < deadline:
        out.extend(consumer)
    consumer.close()
    return out


@pytest.mark.parametrize("partition_key", ["run", "step"])
def test_keys_on_the_wire(kafka_bootstrap: str, unique_name: str, partition_key: str) -> None:
    topic = f"keys-{partition_key}-{unique_name}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    admin.close()
    g = grads()
    producers = [GradientProducer(f"run-{unique_name}", rank=r, world_size=2,
                                  bootstrap_servers=kafka_bootstrap, topic=topic,
                                  partition_key=partition_key) for r in range(2)]
    for gp in producers:
        gp.start_run(numel(g))
    for step in range(STEPS):
        for gp in producers:
            gp.record_step(step, g)
    for gp in producers:
        gp.finish_run()
        gp.close()
        key = longest_key(gp.run_id, partition_key)  # type: ignore[arg-type]
        assert gp.value_limit is not None and gp.value_limit <= (
            gp.settings.max_request_size - RECORD_OVERHEAD - len(key))
    records = _records(kafka_bootstrap, topic, 2 * (STEPS + 2))
    assert len(records) == 2 * (STEPS + 2)
    run = f"run-{unique_name}".encode()
    step_partitions: dict[int, set[int]] = {}
    for record in records:
        message = decode_message(record.value)
        if isinstance(message, StepSummary):
            want = run + f"/{message.step}".encode() if partition_key == "step" else run
            step_partitions.setdefault(message.step, set()).add(record.partition)
        else:
            assert isinstance(message, RunStarted | RunFinished)
            want = run
        assert record.key == want
    assert all(len(p) == 1 for p in step_partitions.values())  # one frame, one partition
    used = set().union(*step_partitions.values())
    assert len(used) == (1 if partition_key == "run" else PARTITIONS)
