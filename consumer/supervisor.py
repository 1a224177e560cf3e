"""``gradstream consume --workers N``: N scale-out worker processes on one host.

Each worker is a child process ``python -m deploy.cli consume`` configured through the
environment (``KAFKA_BOOTSTRAP_SERVERS`` and ``GRADSTREAM_<SETTING>``) with the parent's
settings; worker i serves metrics on ``metrics_port + i``. SIGINT/SIGTERM are passed on to
every child, which finishes its batch and leaves the group; a child that exits on its own
with an error is restarted after a second (the group rebalances meanwhile).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from consumer.settings import ConsumerSettings

log = logging.getLogger("gradstream.consumer")


def child_environment(settings: ConsumerSettings, index: int) -> dict[str, str]:
    """Environment of worker ``index``: every setting as ``GRADSTREAM_<NAME>`` (lists
    comma-separated), the bootstrap servers also as ``KAFKA_BOOTSTRAP_SERVERS``."""
    env = dict(os.environ)
    for name, value in settings.model_dump().items():
        if value is None:
            env.pop(f"GRADSTREAM_{name.upper()}", None)
            continue
        if name == "metrics_port" and value:
            value = int(value) + index
        if name == "group_instance_id":  # static membership: one id per process
            value = f"{value}-{index}"
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        env[f"GRADSTREAM_{name.upper()}"] = text
    env["KAFKA_BOOTSTRAP_SERVERS"] = settings.bootstrap_servers
    return env


def run_workers(settings: ConsumerSettings, count: int, log_level: str, log_format: str) -> int:
    """Run ``count`` worker processes until SIGINT/SIGTERM; returns the exit code (0).

    Raises:
        OSError: a child process cannot be started.
    """
    command = [sys.executable, "-m", "deploy.cli", "consume", "--log-level", log_level,
               "--log-format", log_format]
    children: list[subprocess.Popen[bytes]] = []
    stopping = False

    def start(i: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(command, env=child_environment(settings, i))

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    children.extend(start(i) for i in range(count))
    log.info("started %d workers: pids %s", count, [c.pid for c in children])
    while True:
        if stopping:
            for child in children:
                child.wait()
            return 0
        for i, child in enumerate(children):
            code = child.poll()
            if code is not None and not stopping:
                log.warning("worker %d (pid %d) exited with %d: restarting", i, child.pid, code)
                time.sleep(1.0)
                children[i] = start(i)
        time.sleep(0.2)
