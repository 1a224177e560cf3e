"""The registry of queued alert sinks: where alert events go besides the alerts topic and
the DuckDB ``alerts`` table.

Each entry is a :class:`~consumer.alerts.sinks.QueuedSink` subclass whose
``from_settings(settings)`` returns the sink the settings configure, or None when they do
not ask for it. :class:`consumer.alerts.service.AlertService` runs every sink
:func:`sinks_from_settings` returns and knows none of them by name. To add a sink, write
``consumer/alerts/<name>.py`` with a ``QueuedSink`` subclass (an
:class:`~consumer.alerts.sinks.HttpSink` for an HTTP API: one retry policy), its settings
in ``consumer.settings.AlertingSettings`` (``GRADSTREAM_*``) and its flags in
``deploy.cli.options.AlertRoutingOptions``, then add the class here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from consumer.alerts.alertmanager import AlertmanagerSink
from consumer.alerts.pagerduty import PagerDutySink
from consumer.alerts.sinks import LogSink, QueuedSink, WebhookSink

if TYPE_CHECKING:
    from consumer.settings import AlertingSettings

SINKS: tuple[type[QueuedSink], ...] = (
    LogSink,            # consumer/alerts/sinks.py: always
    WebhookSink,        # consumer/alerts/sinks.py: webhook_url (Slack-compatible JSON)
    AlertmanagerSink,   # consumer/alerts/alertmanager.py: alertmanager_url (API v2)
    PagerDutySink,      # consumer/alerts/pagerduty.py: pagerduty_routing_key (Events API v2)
)
"""The queued sinks, in the order events are handed to them."""


def sinks_from_settings(settings: AlertingSettings) -> list[QueuedSink]:
    """The sinks of :data:`SINKS` that ``settings`` configure (not started).

    Raises:
        ValueError: a sink's settings are invalid (the message says which and why).
    """
    sinks = (sink_type.from_settings(settings) for sink_type in SINKS)
    return [sink for sink in sinks if sink is not None]
