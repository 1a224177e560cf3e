"""``gradstream alerts``, ``gradstream watch`` and ``gradstream alert-rules``.

``alerts`` lists stored alert events from the DuckDB store, or tails the alerts topic with
``--follow``. While a worker holds the store (DuckDB allows one writing process), the list
is read from the alerts topic instead. ``watch`` is a live terminal view fed by the alerts
topic only, so it works next to running workers. ``alert-rules`` checks a rule file and
prints the effective rules.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console

if TYPE_CHECKING:
    from consumer.settings import ConsumerSettings
    from schemas.alert import Alert

DbOption = Annotated[
    Path,
    typer.Option("--db", envvar="GRADSTREAM_DB",
                 help="DuckDB store written by `gradstream consume` (env GRADSTREAM_DB)."),
]
BootstrapOption = Annotated[
    str | None,
    typer.Option(help="Kafka bootstrap servers host:port[,...]. Default: "
                 "$KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092."),
]
TopicOption = Annotated[
    str | None,
    typer.Option("--alerts-topic", help="Alerts topic. Default: $GRADSTREAM_ALERTS_TOPIC or "
                 "gradstream.alerts."),
]
DurationOption = Annotated[
    float | None,
    typer.Option(min=0, help="Stop after this many seconds (default: until Ctrl-C)."),
]


def _fail(message: str, code: int = 1) -> NoReturn:
    Console(stderr=True, highlight=False).print(f"error: {message}", style="bold red",
                                                markup=False, soft_wrap=True)
    raise typer.Exit(code)


def _settings(bootstrap_servers: str | None, alerts_topic: str | None) -> ConsumerSettings:
    from consumer.settings import ConsumerSettings

    given = {"bootstrap_servers": bootstrap_servers, "alerts_topic": alerts_topic}
    return ConsumerSettings(**{k: v for k, v in given.items() if v is not None})


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
    return [stamp, alert.run_id, str(alert.step), alert.rule.value, alert.severity.value,
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


def _from_store(db: Path, run: str | None, rule: str | None, state: str | None,
                limit: int) -> list[Alert] | None:
    """Alerts from the store; None when a worker holds it (locked)."""
    import duckdb

    from consumer.alerts.rows import read_alerts

    if not db.exists():
        _fail(f"no gradstream store at {str(db)!r} (pass --db or set GRADSTREAM_DB; "
              "--follow reads the alerts topic instead)")
    try:
        con = duckdb.connect(str(db), read_only=True)
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            return None
        _fail(f"cannot open the store {str(db)!r}: {exc}")
    except duckdb.ConnectionException:
        return None  # open for writing in this very process (a worker thread)
    try:
        has_table = con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'alerts'").fetchone()
        if not has_table or not has_table[0]:
            _fail(f"{str(db)!r} has no alerts table: not a gradstream store")
        return read_alerts(con, run, rule, state, limit or None)
    finally:
        con.close()


def _from_topic(settings: ConsumerSettings, run: str | None, rule: str | None,
                state: str | None, limit: int) -> list[Alert]:
    from consumer.alerts.feed import AlertFeed
    from schemas.alert import Alert

    feed = AlertFeed(settings, settings.alerts_topic, since=0)
    try:
        records = feed.read_to_end()
    finally:
        feed.close()
    alerts = [
        r for r in records if isinstance(r, Alert)
        and (run is None or r.run_id == run) and (rule is None or r.rule.value == rule)
        and (state is None or r.state.value == state)
    ]
    unique = {a.alert_id: a for a in alerts}  # a replayed event appears once
    ordered = sorted(unique.values(), key=lambda a: a.created_at)
    return ordered[-limit:] if limit else ordered


def alerts(
    run: Annotated[str | None, typer.Option("--run", help="Only this run.")] = None,
    rule: Annotated[str | None, typer.Option(
        help="Only this rule: run_health, nonfinite, exploding, vanishing, grad_norm_spike, "
        "stalled, missing_ranks or replica_divergence.")] = None,
    state: Annotated[str | None, typer.Option(help="Only 'firing' or 'resolved' events.")] = None,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Tail the alerts topic (works while workers run).")] = False,
    since: Annotated[float, typer.Option(
        min=0, help="With --follow: also print events of the last SECONDS first.")] = 0.0,
    limit: Annotated[int, typer.Option(
        min=0, help="Show the newest N events (0 = all). Not with --follow.")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    db: DbOption = Path("gradstream.duckdb"),
    bootstrap_servers: BootstrapOption = None,
    alerts_topic: TopicOption = None,
    duration: DurationOption = None,
    count: Annotated[int | None, typer.Option(
        min=1, help="With --follow: stop after printing this many events.")] = None,
) -> None:
    """List alert events (firing and resolved) from the store, or tail them live with
    --follow. While a worker holds the store, the list is read from the alerts topic."""
    from kafka.errors import KafkaError
    from rich.table import Table

    from consumer.alerts.feed import AlertFeed, TopicMissingError
    from schemas.alert import Alert, AlertRule, AlertState

    if rule is not None and rule not in {r.value for r in AlertRule}:
        _fail(f"unknown rule {rule!r}; choose from {', '.join(r.value for r in AlertRule)}", 2)
    if state is not None and state not in {s.value for s in AlertState}:
        _fail("--state must be 'firing' or 'resolved'", 2)
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
            _fail(_kafka_problem(settings, exc))
        deadline = None if duration is None else time.monotonic() + duration
        printed = 0
        try:
            while (deadline is None or time.monotonic() < deadline) and (
                    count is None or printed < count):
                for record in feed.poll(200):
                    if (isinstance(record, Alert) and (run is None or record.run_id == run)
                            and (rule is None or record.rule.value == rule)
                            and (state is None or record.state.value == state)):
                        _print_line(console, record, as_json)
                        printed += 1
        except KeyboardInterrupt:
            pass
        finally:
            feed.close()
        return
    events = _from_store(db, run, rule, state, limit)
    if events is None:
        Console(stderr=True).print(
            f"the store {str(db)!r} is held by a running worker: reading the alerts topic "
            f"{settings.alerts_topic!r} instead")
        try:
            events = _from_topic(settings, run, rule, state, limit)
        except (TopicMissingError, KafkaError, TimeoutError) as exc:
            _fail(_kafka_problem(settings, exc))
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
    bootstrap_servers: BootstrapOption = None,
    alerts_topic: TopicOption = None,
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

    from consumer.alerts.feed import AlertFeed, TopicMissingError
    from consumer.alerts.watch import WatchState

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
        _fail(_kafka_problem(settings, exc))
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
    alert_set: Annotated[list[str] | None, typer.Option(
        "--alert-set", metavar="RULE.FIELD=VALUE",
        help="Override one setting (repeatable), as `gradstream consume --alert-set`.")] = None,
) -> None:
    """Check alert rules and print the effective configuration (YAML, every default
    filled in). A mistake is reported with its file line and reason, exit status 2.

    Rules: run_health (health at or above `level`), nonfinite (NaN/Inf in any layer),
    exploding / vanishing (a layer flagged `consecutive` frames in a row),
    grad_norm_spike (robust z-score of ln grad_norm over a rolling `window`),
    stalled (no frame for `after_s`, or `interval_factor` x the run's median step
    interval), missing_ranks (`consecutive` partial frames), replica_divergence
    (replicas of a layer that disagree after the all-reduce). Each has `enabled`,
    `severity` (info, warning, critical) and `resolve_after` (clear frames in a row
    that resolve an incident)."""
    from consumer.alerts.config import AlertConfigError, dump_alert_rules, load_alert_rules

    try:
        rules = load_alert_rules(file, alert_set or ())
    except AlertConfigError as exc:
        _fail(f"invalid alert rules:\n{exc}", 2)
    print(dump_alert_rules(rules), end="")


def register(app: typer.Typer) -> None:
    """Add ``alerts``, ``watch`` and ``alert-rules`` to the root application."""
    app.command("alerts", help=alerts.__doc__,
                short_help="List alert events, or tail them live with --follow.")(alerts)
    app.command("watch", help=watch.__doc__,
                short_help="Live terminal view of running runs, health and alerts.")(watch)
    app.command("alert-rules", help=alert_rules.__doc__,
                short_help="Check an alert rule file; print the effective rules.")(alert_rules)
