"""``gradstream dlq`` (:mod:`deploy.cli.dlq`, :mod:`consumer.dlq_reader`): dead letters
written by a real worker, listed from the real topic."""

from __future__ import annotations

import json
import threading
import time

import pytest
from kafka import KafkaProducer
from typer.testing import CliRunner

from consumer.dlq import dead_letter_headers
from consumer.settings import ConsumerSettings
from consumer.worker import Worker
from deploy.cli import app
from schemas.wire import RunFinished, encode_message

BAD = [b'{"type": "step_summary", oops', b"\xff\xfe binary \x00", None]


@pytest.fixture(scope="module")
def dead_letters(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory):
    """A DLQ topic filled by a worker: three bad records, one StepSummary of an unknown
    run. Returns (settings, offsets of the bad records in the summaries topic)."""
    tag = str(time.time_ns())[-10:]
    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"dlqcli-{tag}", dlq_topic=f"dlqcli-dlq-{tag}",
        alerts_topic=f"dlqcli-alerts-{tag}", group_id=f"dlqcli-{tag}",
        db=str(tmp_path_factory.mktemp("dlqcli") / "w.duckdb"), partitions=1,
    )
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert worker.wait_ready(60), worker.error
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
        offsets = [producer.send(settings.topic, key=b"run-x", value=v).get(30).offset
                   for v in BAD]
        unknown = encode_message(RunFinished(run_id="ghost", rank=0, world_size=1,
                                             last_step=3, end_time=1.0))  # never started
        offsets.append(producer.send(settings.topic, key=b"run-y", value=unknown)
                       .get(30).offset)
        producer.close()
        deadline = time.monotonic() + 30
        while worker.counters.dead_letters < 4:
            assert time.monotonic() < deadline, worker.counters
            time.sleep(0.1)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.error is None
    return settings, offsets


def run_cli(settings: ConsumerSettings, *args: str):
    return CliRunner().invoke(app, ["dlq", "--bootstrap-servers", settings.bootstrap_servers,
                                    "--topic", settings.dlq_topic, *args],
                              env={"COLUMNS": "250"})


def test_json_lists_every_dead_letter_with_reason_and_source(dead_letters) -> None:
    settings, offsets = dead_letters
    result = run_cli(settings, "--format", "json")
    assert result.exit_code == 0, result.output
    letters = [json.loads(line) for line in result.output.splitlines()]
    assert [d["source_offset"] for d in letters] == offsets
    assert {d["source_topic"] for d in letters} == {settings.topic}
    assert [d["error"] for d in letters] == ["invalid"] * 3 + ["unknown_run"]
    assert "Invalid JSON" in letters[0]["reason"]
    assert letters[0]["value"] == BAD[0].decode() and letters[0]["key"] == "run-x"
    assert "value" not in letters[1] and letters[1]["value_base64"]  # not UTF-8
    assert letters[2]["reason"] == "empty message (no value)" and letters[2]["value"] == ""
    assert "no RunStarted" in letters[3]["reason"] and letters[3]["key"] == "run-y"
    assert all(not d["truncated"] and d["timestamp"] > 1.6e9 for d in letters)


def test_limit_keeps_the_newest_and_table_shows_reasons(dead_letters) -> None:
    settings, offsets = dead_letters
    newest = run_cli(settings, "--format", "json", "--limit", "1")
    assert newest.exit_code == 0, newest.output
    assert [json.loads(x)["source_offset"] for x in newest.output.splitlines()] == offsets[-1:]
    table = run_cli(settings)
    assert table.exit_code == 0, table.output
    assert "4 dead letter(s)" in table.output
    assert "Invalid JSON" in table.output and "unknown_run" in table.output
    assert f"{settings.topic}[0]@{offsets[0]}" in table.output


def test_follow_prints_new_dead_letters(dead_letters) -> None:
    settings, _ = dead_letters

    def publish_later() -> None:
        time.sleep(1.5)
        producer = KafkaProducer(bootstrap_servers=settings.bootstrap_servers)
        producer.send(settings.dlq_topic, key=b"k", value=b"late",
                      headers=dead_letter_headers("late arrival", "src", 2, 99, "invalid"))
        producer.close()

    thread = threading.Thread(target=publish_later)
    thread.start()
    result = run_cli(settings, "--follow", "--format", "json", "--limit", "0",
                     "--duration", "6")
    thread.join()
    assert result.exit_code == 0, result.output
    letters = [json.loads(line) for line in result.output.splitlines()]
    assert len(letters) == 5
    assert letters[-1]["reason"] == "late arrival"
    assert (letters[-1]["source_topic"], letters[-1]["source_partition"],
            letters[-1]["source_offset"]) == ("src", 2, 99)


def test_missing_topic_says_what_to_do(kafka_bootstrap: str, unique_name: str) -> None:
    settings = ConsumerSettings(bootstrap_servers=kafka_bootstrap,
                                dlq_topic=f"absent-{unique_name}")
    result = run_cli(settings)
    assert result.exit_code == 1
    assert "does not exist" in result.output and "gradstream consume" in result.output
    bad_format = run_cli(settings, "--format", "xml")
    assert bad_format.exit_code == 2 and "table" in bad_format.output
