"""``gradstream inspect``: print the records of any gradstream topic decoded for people,
binary messages as JSON (:func:`consumer.dlq_reader.read_topic`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from deploy.cli.errors import fail
from deploy.cli.options import BootstrapServersOption, DurationOption, given


def inspect(
    topic: Annotated[str, typer.Argument(help="The topic to read (summaries, frames, runs, "
                                         "alerts, dead letters, ...).")],
    from_beginning: Annotated[bool, typer.Option(
        "--from-beginning", help="Start at the first record of each partition (default: "
        "only records that arrive from now on).")] = False,
    max_records: Annotated[int, typer.Option(
        "--max", min=0, help="Stop after N records (0 = no limit).")] = 0,
    bootstrap_servers: BootstrapServersOption = None,
    duration: DurationOption = None,
) -> None:
    """Print the records of a gradstream topic as JSON lines: position, key, headers and
    the value decoded (binary messages as objects with their arrays as lists, JSON as
    parsed, other bytes base64). Nothing is validated, so invalid messages show as they
    are. Reads without joining a consumer group, so it is safe while workers run. With
    neither --max nor --duration it runs until Ctrl-C."""
    from kafka.errors import KafkaError

    from consumer.dlq_reader import read_topic
    from consumer.settings import ConsumerSettings
    from consumer.topic_admin import TopicMissingError

    settings = ConsumerSettings(**given(bootstrap_servers=bootstrap_servers))
    try:
        for row in read_topic(settings, topic, from_beginning=from_beginning,
                              max_records=max_records, duration_s=duration):
            print(json.dumps(row, ensure_ascii=False), flush=True)
    except KeyboardInterrupt:
        pass
    except TopicMissingError as exc:
        fail(str(exc))
    except KafkaError as exc:
        fail(f"{exc} (is the broker at {settings.bootstrap_servers} up?)")


def register(app: typer.Typer) -> None:
    """Add ``inspect`` to the root application."""
    app.command("inspect", help=inspect.__doc__,
                short_help="Print a topic's records decoded as JSON lines.")(inspect)
