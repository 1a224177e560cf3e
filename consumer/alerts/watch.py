"""The state behind ``gradstream watch`` and its rich rendering.

:class:`WatchState` folds alerts-topic records (``schemas.alert``) into: the latest
RunStatus of every run, the incidents open now, and the last alert events. Rendering is a
pure function of that state and the current time, so it is tested without a terminal.
"""

from __future__ import annotations

import time
from collections import deque
from datetime import datetime

from rich.console import Group
from rich.table import Table
from rich.text import Text

from consumer.alerts.rules import rule_title
from schemas.alert import Alert, AlertSeverity, AlertState, RunStatus
from schemas.health import HEALTH_COLOR
from schemas.wire import GradientHealth

WATCH_HEALTH_STYLE = {
    health: f"bold {color}" if health is GradientHealth.CRITICAL else color
    for health, color in HEALTH_COLOR.items()
}
"""``rich`` style of each run health in the watch table: its colour
(:data:`schemas.health.HEALTH_COLOR`), Critical in bold."""
SEVERITY_STYLE = {
    AlertSeverity.INFO: "cyan",
    AlertSeverity.WARNING: "yellow",
    AlertSeverity.CRITICAL: "bold red",
}


def clock_time(unix: float) -> str:
    """Local ``HH:MM:SS`` of a unix time."""
    return datetime.fromtimestamp(unix).strftime("%H:%M:%S")


def age(seconds: float) -> str:
    """``"4 s"``, ``"3 min"``, ``"2 h"``."""
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


class WatchState:
    """Runs, open incidents and recent events seen on the alerts topic.

    Args:
        max_alerts: recent events kept for display.
    """

    def __init__(self, max_alerts: int = 10) -> None:
        self.runs: dict[str, RunStatus] = {}
        self.open: dict[tuple[str, str], Alert] = {}
        self.recent: deque[Alert] = deque(maxlen=max_alerts)
        self.records = 0

    def apply(self, record: Alert | RunStatus) -> None:
        """Fold one record in (records of a run arrive in order: one partition per run)."""
        self.records += 1
        if isinstance(record, RunStatus):
            known = self.runs.get(record.run_id)
            if known is None or record.emitted_at >= known.emitted_at:
                self.runs[record.run_id] = record
            return
        self.recent.append(record)
        key = (record.run_id, str(record.rule))
        if record.state is AlertState.FIRING:
            self.open[key] = record
        else:
            self.open.pop(key, None)

    def run_state(self, status: RunStatus) -> tuple[str, str]:
        """(label, style) of a run: finished, stalled or running."""
        if status.finished:
            return "finished", "dim"
        if status.stalled:
            return "stalled", "bold red"
        return "running", "green"

    def render(self, now: float | None = None, show_finished: bool = True) -> Group:
        """Two tables: the runs (health, step, ranks, last frame, open alerts) and the last
        alert events, newest first."""
        now = time.time() if now is None else now
        runs = Table(title="Runs", title_justify="left", expand=True)
        for column in ("run", "state", "health", "step", "ranks", "updated", "open alerts"):
            runs.add_column(column, overflow="fold")
        shown = 0
        for run_id in sorted(self.runs):
            status = self.runs[run_id]
            if status.finished and not show_finished:
                continue
            shown += 1
            label, style = self.run_state(status)
            open_rules = sorted(rule for (r, rule) in self.open if r == run_id)
            runs.add_row(
                run_id, Text(label, style=style),
                Text(status.health.value, style=WATCH_HEALTH_STYLE[status.health]),
                str(status.step), f"{len(status.ranks_seen)}/{status.world_size}",
                f"{age(now - status.emitted_at)} ago",
                Text(", ".join(open_rules) or "-", style="red" if open_rules else "dim"),
            )
        if not shown:
            runs.add_row(Text("no run has reported yet", style="dim"), "", "", "", "", "", "")
        events = Table(title="Latest alerts", title_justify="left", expand=True)
        for column in ("time", "run", "step", "rule", "severity", "state", "message"):
            events.add_column(column, overflow="fold")
        for alert in reversed(self.recent):
            resolved = alert.state is AlertState.RESOLVED
            events.add_row(
                clock_time(alert.created_at), alert.run_id, str(alert.step),
                rule_title(alert.rule),
                Text(alert.severity.value, style=SEVERITY_STYLE[alert.severity]),
                Text(alert.state.value, style="green" if resolved else "red"),
                alert.message.removeprefix(f"run {alert.run_id}: "),
            )
        if not self.recent:
            events.add_row("", Text("no alerts", style="dim"), "", "", "", "", "")
        return Group(runs, events)
