"""A real Prometheus Alertmanager for the integration tests (Debian's
``prometheus-alertmanager``, which ``make test`` installs): its own config, storage and
log in a temporary directory, on a free loopback port, clustering off; stopped by the
test that starts it."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"

GROUP_WAIT_S = 1
"""``group_wait`` and ``group_interval`` of the test route (s): notifications of a new or
changed group within about a second, so a test waits seconds, not Alertmanager's defaults
(30 s and 5 min)."""


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Call ``check`` every 0.1 s until it returns something truthy (returned);
    AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class Alertmanager:
    """A real Alertmanager on loopback whose one route groups alerts by
    ``group_by`` and notifies ``webhook_url`` (Alertmanager's webhook receiver, resolved
    notifications included).

    Args:
        home: a fresh directory (config, ``data/`` storage, ``alertmanager.log``).
        webhook_url: where Alertmanager POSTs its notifications.
        group_by: the route's grouping labels.
    """

    def __init__(self, home: Path, webhook_url: str,
                 group_by: tuple[str, ...] = ("alertname", "run_id")) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = home / "alertmanager.yml"
        self.config.write_text(yaml.safe_dump({
            "route": {"receiver": "recorder", "group_by": list(group_by),
                      "group_wait": f"{GROUP_WAIT_S}s", "group_interval": f"{GROUP_WAIT_S}s",
                      "repeat_interval": "1h"},
            "receivers": [{"name": "recorder", "webhook_configs": [
                {"url": webhook_url, "send_resolved": True}]}],
        }))
        self.log = home / "alertmanager.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Alertmanager:
        """Start it and wait until it is ready (``/-/ready``); returns itself."""
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [ALERTMANAGER, f"--config.file={self.config}",
                 f"--storage.path={self.home / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
                stdout=log, stderr=subprocess.STDOUT)
        wait_until("Alertmanager to be ready", self._ready)
        return self

    def _ready(self) -> bool:
        assert self.process is not None and self.process.poll() is None, (
            f"Alertmanager exited: {self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def get(self, path: str, **params: str | list[str]) -> Any:
        """GET ``path`` of the API v2 (e.g. ``/api/v2/alerts``) with query ``params``
        (a list repeats the parameter, as ``filter`` takes); the decoded JSON."""
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}{'?' + query if query else ''}",
                                    timeout=5) as answer:
            return json.loads(answer.read())

    def alerts(self, **params: str | list[str]) -> list[dict[str, Any]]:
        """``GET /api/v2/alerts``: the alerts Alertmanager holds unresolved (its API v2
        leaves out every alert whose ``endsAt`` has passed)."""
        return self.get("/api/v2/alerts", **params)

    def groups(self, **params: str | list[str]) -> list[dict[str, Any]]:
        """``GET /api/v2/alerts/groups``: the alert groups of the route."""
        return self.get("/api/v2/alerts/groups", **params)

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def __enter__(self) -> Alertmanager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
