"""Stored alert events for ``gradstream alerts``: read from the DuckDB store, or from the
alerts topic while a worker holds the store (DuckDB allows one writing process)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from consumer.settings import ConsumerSettings
    from schemas.alert import Alert


class StoreUnreadableError(Exception):
    """The store is missing, cannot be opened, or is not a gradstream store; ``str(exc)``
    tells the user what to do."""


def alert_matches(alert: Alert, run: str | None, rule: str | None, state: str | None) -> bool:
    """Whether ``alert`` passes the filters (None: any run, rule or state)."""
    return ((run is None or alert.run_id == run) and (rule is None or str(alert.rule) == rule)
            and (state is None or alert.state.value == state))


def alerts_from_store(db: Path, run: str | None, rule: str | None, state: str | None,
                      limit: int) -> list[Alert] | None:
    """The newest ``limit`` alert events of the store ``db`` that match the filters (0 =
    all), oldest first; None when a worker holds the store (it is locked).

    Raises:
        StoreUnreadableError: no such file, or not a gradstream store.
    """
    import duckdb

    from consumer.alerts.rows import read_alerts

    if not db.exists():
        raise StoreUnreadableError(
            f"no gradstream store at {str(db)!r} (pass --db or set GRADSTREAM_DB; "
            "--follow reads the alerts topic instead)")
    try:
        con = duckdb.connect(str(db), read_only=True)
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            return None
        raise StoreUnreadableError(f"cannot open the store {str(db)!r}: {exc}") from None
    except duckdb.ConnectionException:
        return None  # open for writing in this very process (a worker thread)
    try:
        has_table = con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'alerts'").fetchone()
        if not has_table or not has_table[0]:
            raise StoreUnreadableError(f"{str(db)!r} has no alerts table: not a gradstream store")
        return read_alerts(con, run, rule, state, limit or None)
    finally:
        con.close()


def alerts_from_topic(settings: ConsumerSettings, run: str | None, rule: str | None,
                      state: str | None, limit: int) -> list[Alert]:
    """The newest ``limit`` alert events of the alerts topic that match the filters (0 =
    all), oldest first, each once (a replayed event is counted once).

    Raises:
        consumer.alerts.feed.TopicMissingError: the topic does not exist.
        kafka.errors.KafkaError, TimeoutError: the topic could not be read.
    """
    from consumer.alerts.feed import AlertFeed
    from schemas.alert import Alert

    feed = AlertFeed(settings, settings.alerts_topic, since=0)
    try:
        records = feed.read_to_end()
    finally:
        feed.close()
    alerts = [r for r in records if isinstance(r, Alert) and alert_matches(r, run, rule, state)]
    unique = {a.alert_id: a for a in alerts}
    ordered = sorted(unique.values(), key=lambda a: a.created_at)
    return ordered[-limit:] if limit else ordered
