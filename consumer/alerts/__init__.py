"""Alerting on gradient health: rules evaluated incrementally by the workers, incident
deduplication (fire once, resolve once), and sinks (alerts topic, DuckDB, webhook, log,
Alertmanager, PagerDuty).

Modules: ``config`` (rules and thresholds, rule files), ``robust`` (rolling modified
z-scores), ``incident`` (the fire/resolve state machine, incidents to restore), ``rules``
(the rule registry, one module per rule; its docstring shows how to add one),
``engine`` (all runs of a worker), ``sinks`` (Kafka, webhook, log), ``alertmanager`` and
``pagerduty`` (the standard incident stack), ``sink_registry`` (the queued sinks, one
line each), ``rows`` (the DuckDB
``alerts`` table), ``service`` (what a worker holds), ``feed`` (reading the alerts topic)
and ``watch`` (the live terminal view).
"""

from consumer.alerts.config import AlertConfigError, AlertRulesConfig, load_alert_rules
from consumer.alerts.engine import AlertEngine

__all__ = ["AlertConfigError", "AlertEngine", "AlertRulesConfig", "load_alert_rules"]
