"""``gradstream inspect`` and the dead-letter view show binary messages as JSON."""

from __future__ import annotations

import json

from kafka import KafkaProducer
from typer.testing import CliRunner

from consumer.dlq_reader import DeadLetter
from deploy.cli import app
from schemas.wire import RunStarted, StepSummary, encode_message


def _summary(**over) -> StepSummary:
    base = dict(run_id="r", step=3, rank=0, world_size=1, wall_time=1.5, layer_indices=[0, 1],
                numel=[4, 8], sum_abs=[1.0, 2.0], sum_sq=[0.5, 1.0], max_abs=[0.5, 0.7],
                nonfinite=[0, 1])
    base.update(over)
    return StepSummary(**base)


def test_dead_letter_with_a_binary_value_is_shown_decoded() -> None:
    raw = encode_message(_summary(), "binary")
    letter = DeadLetter(0, 7, 1.7e9, "r", raw, {"reason": "x", "error": "invalid"})
    shown = letter.to_json()
    assert shown["value_encoding"] == "binary"
    assert shown["value"]["sum_sq"] == [0.5, 1.0] and shown["value"]["step"] == 3
    json.dumps(shown, allow_nan=False)
    assert letter.preview().startswith("binary {")
    cut = DeadLetter(0, 8, 1.7e9, "r", raw[:40], {"truncated": "true"})
    assert cut.to_json()["value_base64"]  # a cut binary value cannot be decoded


def test_inspect_prints_binary_json_and_other_records(kafka_bootstrap: str,
                                                       unique_name: str) -> None:
    topic = f"inspect-{unique_name}"
    started = RunStarted(run_id="r", world_size=1, layer_names=["a", "b"], numel=[4, 8],
                         start_time=1.0)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for value in (encode_message(started), encode_message(_summary(), "binary"), b"\xff\x00"):
        producer.send(topic, key=b"r", value=value)
    producer.flush()
    producer.close()
    result = CliRunner().invoke(app, ["inspect", topic, "--from-beginning", "--max", "3",
                                      "--duration", "60",
                                      "--bootstrap-servers", kafka_bootstrap])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["encoding"] for r in rows] == ["json", "binary", "bytes"]
    assert rows[0]["value"]["layer_names"] == ["a", "b"]
    assert rows[1]["value"]["type"] == "step_summary"
    assert rows[1]["value"]["nonfinite"] == [0, 1] and rows[1]["key"] == "r"
    assert [r["offset"] for r in rows] == [0, 1, 2]


def test_inspect_missing_topic_fails(kafka_bootstrap: str, unique_name: str) -> None:
    result = CliRunner().invoke(app, ["inspect", f"nope-{unique_name}", "--max", "1",
                                      "--bootstrap-servers", kafka_bootstrap])
    assert result.exit_code != 0 and "does not exist" in result.output
