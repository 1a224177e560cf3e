"""Alert events for ``gradstream alerts`` read from the alerts topic (when the store is held
by a process that serves no reads, or with ``--follow``), and the filters they share with
the stored events (read through the store's reader in ``deploy/cli/alerts.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from consumer.settings import ConsumerSettings
    from schemas.alert import Alert


def alert_matches(alert: Alert, run: str | None, rule: str | None, state: str | None) -> bool:
    """Whether ``alert`` passes the filters (None: any run, rule or state)."""
    return ((run is None or alert.run_id == run) and (rule is None or str(alert.rule) == rule)
            and (state is None or alert.state.value == state))


def alerts_from_topic(settings: ConsumerSettings, run: str | None, rule: str | None,
                      state: str | None, limit: int) -> list[Alert]:
    """The newest ``limit`` alert events of the alerts topic that match the filters (0 =
    all), oldest first, each once (a replayed event is counted once).

    Raises:
        consumer.topic_admin.TopicMissingError: the topic does not exist.
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
