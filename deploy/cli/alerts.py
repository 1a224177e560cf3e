"""``gradstream alerts``, ``gradstream watch`` and ``gradstream alert-rules``.

``alerts`` lists stored alert events from the DuckDB store, or tails the alerts topic with
``--follow``. The store is read through :func:`analysis.read.reader.open_reader` (the file, or
the endpoint of the process writing it); while a process that serves no reads holds the
store (DuckDB allows one writing process), the list is read from the alerts topic instead
(:mod:`consumer.alerts.listing`). ``watch`` is a live
terminal view fed by the alerts topic only (:mod:`consumer.alerts.watch`), so it works next
to running workers. ``alert-rules`` checks a rule file and prints the effective rules
(:mod:`consumer.alerts.config`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from deploy.cli.errors import fail
from deploy.cli.options import (
    DEFAULT_DB,
    AlertSetOption,
    AlertsTopicOption,
    BootstrapServersOption,
    DbOption,
    DurationOption,
    given,
)
from deploy.cli.reports import TimeoutOption

if TYPE_CHECKING:
    from consumer.settings import ConsumerSettings
    from schemas.alert import Alert


def _stored_alerts(db: Path | str, timeout: float | None, run: str | None, rule: str | None,
                   state: str | None, limit: int) -> list[Alert] | None:
    """The store's alert events (``consumer.alerts.rows.alerts_query``), or None when a
    process that answers no reads holds the store.

    Raises:
        StoreError: missing file, not a gradstream store, a failed read.
    """
    from analysis.read.query import StoreHeldError
    from analysis.read.reader import open_reader
    from consumer.alerts.rows import alerts_from_rows, alerts_query

    try:
        reader = open_reader(db, timeout)
    except StoreHeldError:
        return None
    sql, params = alerts_query(run, rule, state, limit or None)
    with reader:
        table = reader.sql(sql, params)
    return alerts_from_rows(zip(*(column.to_pylist() for column in table.columns), strict=True))


def _settings(bootstrap_servers: str | None, alerts_topic: str | None) -> ConsumerSettings:
    from consumer.settings import ConsumerSettings

    return ConsumerSettings(**given(bootstrap_servers=bootstrap_servers,
                                    alerts_topic=alerts_topic))


def _kafka_problem(settings: ConsumerSettings, exc: BaseException) -> str:
    """A user-facing line for a failure to read the alerts topic."""
    from kafka.errors import KafkaError

    if isinstance(exc, KafkaError):
        return (f"cannot read the alerts topic {settings.alerts_topic!r} from Kafka at "
                f"{settings.bootstrap_servers}: {exc}. Is the broker running (`gradstream "
                "broker start`)? Otherwise pass --bootstrap-servers or set "
                "KAFKA_BOOTSTRAP_SERVERS.")
    return str(exc)


def _row(alert: Alert) -> list[str]:
    from consumer.alerts.watch import clock_time

    stamp = time.strftime("%Y-%m-%d ", time.localtime(alert.created_at)) + clock_time(
        alert.created_at)
    layers = ", ".join(alert.layers[:5]) + (f" +{len(alert.layers) - 5}"
                                            if len(alert.layers) > 5 else "")
    return [stamp, alert.run_id, str(alert.step), str(alert.rule), alert.severity.value,
            alert.state.value, layers or "-", ",".join(map(str, alert.ranks)) or "-",
            alert.message.removeprefix(f"run {alert.run_id}: ")]


def _print_line(console: Console, alert: Alert, as_json: bool) -> None:
    from consumer.alerts.watch import SEVERITY_STYLE

    if as_json:
        print(alert.model_dump_json(), flush=True)
        return
    stamp, run, step, rule, severity, state, layers, ranks, message = _row(alert)
    style = "green" if state == "resolved" else SEVERITY_STYLE[alert.severity]
    console.print(f"{stamp}  [{style}]{severity:<8} {state:<8}[/] {rule:<16} {run} "
                  f"step {step}  layers: {layers}  ranks: {ranks}\n    {message}",
                  highlight=False)


def alerts(
    run: Annotated[str | None, typer.Option("--run", help="Only this run.")] = None,
    rule: Annotated[str | None, typer.Option(
        help="Only this rule, by name (e.g. nonfinite; `gradstream alert-rules` lists "
        "every rule).")] = None,
    state: Annotated[str | None, typer.Option(help="Only 'firing' or 'resolved' events.")] = None,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Tail the alerts topic (works while workers run).")] = False,
    since: Annotated[float, typer.Option(
        min=0, help="With --follow: also print events of the last SECONDS first.")] = 0.0,
    limit: Annotated[int, typer.Option(
        min=0, help="Show the newest N events (0 = all). Not with --follow.")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    db: DbOption = Path(DEFAULT_DB),
    bootstrap_servers: BootstrapServersOption = None,
    alerts_topic: AlertsTopicOption = None,
    duration: DurationOption = None,
    count: Annotated[int | None, typer.Option(
        min=1, help="With --follow: stop after printing this many events.")] = None,
    timeout: TimeoutOption = None,
) -> None:
    """List alert events (firing and resolved) from the store, or tail them live with
    --follow. While a worker holds the store, the list is read from the alerts topic."""
    from kafka.errors import KafkaError
    from rich.table import Table

    from analysis.read.connect import StoreError
    from consumer.alerts.feed import AlertFeed
    from consumer.alerts.listing import alert_matches, alerts_from_topic
    from consumer.alerts.rules import rule_names
    from consumer.topic_admin import TopicMissingError
    from schemas.alert import Alert, AlertState

    if rule is not None and rule not in rule_names():
        fail(f"unknown rule {rule!r}; choose from {', '.join(rule_names())}", 2)
    if state is not None and state not in {s.value for s in AlertState}:
        fail("--state must be 'firing' or 'resolved'", 2)
    console = Console(highlight=False)
    settings = _settings(bootstrap_servers, alerts_topic)
    if follow:
        err = Console(stderr=True)
        try:
            feed = AlertFeed(
                settings, settings.alerts_topic, since=(time.time() - since) if since else None,
                wait_s=float("inf") if duration is None else duration,
                on_wait=lambda: err.print(f"waiting for the alerts topic "
                                          f"{settings.alerts_topic!r} to be created..."),
            )
        except (TopicMissingError, KafkaError) as exc:
            fail(_kafka_problem(settings, exc))
        deadline = None if duration is None else time.monotonic() + duration
        printed = 0
        try:
            while (deadline is None or time.monotonic() < deadline) and (
                    count is None or printed < count):
                for record in feed.poll(200):
                    if isinstance(record, Alert) and alert_matches(record, run, rule, state):
                        _print_line(console, record, as_json)
                        printed += 1
        except KeyboardInterrupt:
            pass
        finally:
            feed.close()
        return
    try:
        events = _stored_alerts(db, timeout, run, rule, state, limit)
    except StoreError as exc:
        missing = isinstance(db, Path) and not db.exists()  # a store URL is a str
        fail(f"{exc} (--follow reads the alerts topic instead)" if missing else str(exc))
    if events is None:
        Console(stderr=True).print(
            f"the store {str(db)!r} is held by a running worker: reading the alerts topic "
            f"{settings.alerts_topic!r} instead")
        try:
            events = alerts_from_topic(settings, run, rule, state, limit)
        except (TopicMissingError, KafkaError, TimeoutError) as exc:
            fail(_kafka_problem(settings, exc))
    if as_json:
        for event in events:
            print(event.model_dump_json())
        return
    if not events:
        console.print("no alerts" + (f" for run {run!r}" if run else ""))
        return
    table = Table(title=f"{len(events)} alert event(s)", title_justify="left")
    for column in ("time", "run", "step", "rule", "severity", "state", "layers", "ranks",
                   "message"):
        table.add_column(column, overflow="fold")
    for event in events:
        table.add_row(*_row(event))
    console.print(table)


def watch(
    bootstrap_servers: BootstrapServersOption = None,
    alerts_topic: AlertsTopicOption = None,
    since: Annotated[float, typer.Option(
        min=0, help="Start with the records of the last SECONDS (runs and alerts).")] = 600.0,
    max_alerts: Annotated[int, typer.Option(
        "--alerts", min=1, help="Latest alert events shown.")] = 10,
    finished: Annotated[bool, typer.Option(
        "--finished/--running-only", help="Also show runs that finished.")] = True,
    refresh: Annotated[float, typer.Option(min=0.2, max=20, help="Redraws per second.")] = 2.0,
    duration: DurationOption = None,
) -> None:
    """Live terminal view of the runs workers are consuming: state (running, stalled,
    finished), health, last step, ranks, open alerts, and the latest alert events. Fed by
    the alerts topic, so it works while workers hold the store. Ctrl-C quits."""
    from kafka.errors import KafkaError
    from rich.live import Live

    from consumer.alerts.feed import AlertFeed
    from consumer.alerts.watch import WatchState
    from consumer.topic_admin import TopicMissingError

    console = Console()
    settings = _settings(bootstrap_servers, alerts_topic)
    try:
        feed = AlertFeed(
            settings, settings.alerts_topic, since=time.time() - since,
            wait_s=float("inf") if duration is None else duration,
            on_wait=lambda: console.print(f"waiting for the alerts topic "
                                          f"{settings.alerts_topic!r} to be created..."),
        )
    except (TopicMissingError, KafkaError) as exc:
        fail(_kafka_problem(settings, exc))
    state = WatchState(max_alerts)
    deadline = None if duration is None else time.monotonic() + duration
    try:
        with Live(state.render(show_finished=finished), console=console,
                  refresh_per_second=refresh, transient=False) as live:
            while deadline is None or time.monotonic() < deadline:
                for record in feed.poll(int(1000 / refresh)):
                    state.apply(record)
                live.update(state.render(show_finished=finished))
    except KeyboardInterrupt:
        pass
    finally:
        feed.close()


def alert_rules(
    file: Annotated[Path | None, typer.Argument(
        help="Rule file (.toml, .yaml or .yml) to check. Default: built-in rules.")] = None,
    alert_set: AlertSetOption = None,
) -> None:
    """Check alert rules and print the effective configuration (YAML, every default
    filled in). A mistake is reported with its file line and reason, exit status 2.

    The output has one section per rule a worker evaluates (the registry
    consumer.alerts.rules.RULES, e.g. nonfinite, exploding, stalled; each rule's module
    there documents its condition), named after the rule, then `max_layer_values`.
    Every rule has `enabled`,
    `severity` (info, warning, critical) and `resolve_after` (clear frames in a row
    that resolve an incident), plus its own settings."""
    from consumer.alerts.config import AlertConfigError, dump_alert_rules, load_alert_rules

    try:
        rules = load_alert_rules(file, alert_set or ())
    except AlertConfigError as exc:
        fail(f"invalid alert rules:\n{exc}", 2)
    print(dump_alert_rules(rules), end="")


def register(app: typer.Typer) -> None:
    """Add ``alerts``, ``watch`` and ``alert-rules`` to the root application."""
    app.command("alerts", help=alerts.__doc__,
                short_help="List alert events, or tail them live with --follow.")(alerts)
    app.command("watch", help=watch.__doc__,
                short_help="Live terminal view of running runs, health and alerts.")(watch)
    app.command("alert-rules", help=alert_rules.__doc__,
                short_help="Check an alert rule file; print the effective rules.")(alert_rules)
