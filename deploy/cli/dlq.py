"""``gradstream dlq``: list the dead letters of the dead-letter topic, or tail them
(:class:`consumer.dlq_reader.DeadLetterReader`)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from deploy.cli.errors import fail
from deploy.cli.options import BootstrapServersOption, DlqTopicOption, DurationOption, given

if TYPE_CHECKING:
    from consumer.dlq_reader import DeadLetter


def _print_line(console: Console, letter: DeadLetter, fmt: str) -> None:
    if fmt == "json":
        print(json.dumps(letter.to_json(), ensure_ascii=False), flush=True)
        return
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(letter.timestamp))
    console.print(f"{stamp}  {letter.headers.get('error', '?'):<15} {letter.source}  "
                  f"key={letter.key}\n    {letter.headers.get('reason', '')}", markup=False,
                  highlight=False)


def _table(letters: list[DeadLetter], topic: str) -> Any:
    from rich.table import Table

    table = Table(title=f"{len(letters)} dead letter(s) in {topic}", title_justify="left")
    for column in ("time", "error", "reason", "source", "key", "bytes", "value"):
        table.add_column(column, overflow="fold")
    for d in letters:
        size = f"{len(d.value)}" + ("+ (truncated)" if d.headers.get("truncated") else "")
        table.add_row(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.timestamp)),
                      d.headers.get("error", "?"), d.headers.get("reason", ""), d.source,
                      d.key or "-", size, d.preview())
    return table


def dlq(
    topic: DlqTopicOption = None,
    limit: Annotated[int, typer.Option(
        min=0, help="Show the newest N dead letters (0 = all of them).")] = 50,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="After the newest --limit, keep printing new dead letters "
        "until Ctrl-C.")] = False,
    fmt: Annotated[str, typer.Option(
        "--format", help="'table', or 'json' (one object per line with the headers and the "
        "original value; a binary gradstream message decoded to JSON).")] = "table",
    bootstrap_servers: BootstrapServersOption = None,
    duration: DurationOption = None,
) -> None:
    """List the messages workers could not use (undecodable, invalid, unknown schema
    version, oversized, unknown run) with the reason and where each was read (source
    topic, partition, offset). Reads the dead-letter topic without joining a consumer
    group, so it is safe while workers run."""
    from kafka.errors import KafkaError

    from consumer.dlq_reader import DeadLetterReader
    from consumer.settings import ConsumerSettings
    from consumer.topic_admin import TopicMissingError

    if fmt not in ("table", "json"):
        fail(f"--format must be 'table' or 'json', not {fmt!r}", 2)
    settings = ConsumerSettings(**given(bootstrap_servers=bootstrap_servers, dlq_topic=topic))
    console = Console(highlight=False)
    try:
        reader = DeadLetterReader(settings, settings.dlq_topic, last=limit)
    except (TopicMissingError, KafkaError) as exc:
        fail(str(exc))
    try:
        letters = reader.read_to_end()
        if limit:
            letters = letters[-limit:]
        if fmt == "json" or follow:
            for letter in letters:
                _print_line(console, letter, fmt)
        elif letters:
            console.print(_table(letters, settings.dlq_topic))
        else:
            console.print(f"no dead letters in {settings.dlq_topic}")
        deadline = None if duration is None else time.monotonic() + duration
        while follow and (deadline is None or time.monotonic() < deadline):
            for letter in reader.poll(200):
                _print_line(console, letter, fmt)
    except KeyboardInterrupt:
        pass
    except (KafkaError, TimeoutError) as exc:
        fail(f"{exc} (is the broker at {settings.bootstrap_servers} up?)")
    finally:
        reader.close()


def register(app: typer.Typer) -> None:
    """Add ``dlq`` to the root application."""
    app.command("dlq", help=dlq.__doc__,
                short_help="List dead letters (unusable messages) with their reasons.")(dlq)
