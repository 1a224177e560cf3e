"""``consume --workers N``: each child's environment rebuilds the parent's settings."""

from __future__ import annotations

import pytest

from consumer.settings import ConsumerSettings
from consumer.supervisor import child_environment


def test_child_environment_round_trips_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = ConsumerSettings(bootstrap_servers="h1:9092,h2:9092", frames_topic="f",
                              metrics_port=9400, group_instance_id="host-a",
                              alert_set=["exploding.consecutive=5", "vanishing.consecutive=7"],
                              shard_timeout_s=3.5)
    env = child_environment(parent, 2)
    for key in [k for k in list(__import__("os").environ) if k.startswith("GRADSTREAM_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith(("GRADSTREAM_", "KAFKA_")):
            monkeypatch.setenv(key, value)
    child = ConsumerSettings()
    assert child.metrics_port == 9402 and child.group_instance_id == "host-a-2"
    same = {"metrics_port", "group_instance_id"}
    assert child.model_dump(exclude=same) == parent.model_dump(exclude=same)
