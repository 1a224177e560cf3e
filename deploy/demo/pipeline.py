"""The demo end to end: a Kafka broker, a consumer worker writing a fresh DuckDB file,
the chosen scenarios trained data-parallel through Kafka, then each run's report read back
from DuckDB and its CSV/JSON exports (``gradstream demo``).

Kafka clients, DuckDB and the producer are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

SCENARIO_NAMES = ("healthy", "vanishing", "exploding", "bad-rank", "loss-spike", "straggler")
"""The scenarios the demo runs by default, in this order."""


@contextlib.contextmanager
def kafka_for_demo(bootstrap_servers: str | None) -> Iterator[str]:
    """Yield bootstrap servers: the given ones, else ``$KAFKA_BOOTSTRAP_SERVERS``, else the
    broker started by ``gradstream broker start``, else a temporary local broker that is
    stopped on exit.

    Raises:
        deploy.broker.BrokerError: no broker given and the local one cannot start.
    """
    from deploy.broker import DEFAULT_STATE_DIR, LocalBroker

    given = bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip()
    if given:
        yield given
        return
    if (DEFAULT_STATE_DIR / "broker.json").exists():
        persistent = LocalBroker.from_state(DEFAULT_STATE_DIR)
        if persistent.status().running:
            yield persistent.bootstrap
            return
    with tempfile.TemporaryDirectory(prefix="gradstream-demo-broker-") as tmp:
        broker = LocalBroker(Path(tmp))
        bootstrap = broker.start(timeout=120.0)
        try:
            yield bootstrap
        finally:
            broker.stop()



def train_and_consume(
    console: Console, bootstrap: str, db: Path, chosen: list[str], ranks: int,
    steps: int | None, stamp: str, webhook: str | None, serve_port: int | None,
    progress: Progress, token: str | None = None, alerting: dict[str, Any] | None = None,
) -> list[str]:
    """Run a worker in a thread answering reads of ``db`` on 127.0.0.1:``serve_port`` (the
    live dashboard and the read endpoint, advertised in ``<db>.serve.json``; 0 = any free
    port, None = no endpoint), train each chosen scenario through Kafka, and wait until
    every run is stored. Returns the run ids.

    The endpoint requires ``token`` (None: a random one); the printed dashboard URL
    carries it (``http://127.0.0.1:PORT/?token=...``).

    The worker reads its other settings from the environment as ``gradstream consume``
    does; ``webhook`` (None: ``GRADSTREAM_WEBHOOK_URL``, if set) receives its alerts, and
    ``alerting`` (``consumer.settings.AlertingSettings`` fields, e.g. ``alertmanager_url``,
    ``pagerduty_routing_key``, ``dashboard_url``; None: the environment's) routes its
    incidents to Alertmanager and PagerDuty.

    Raises:
        deploy.serve.ServeError: the worker could not open and serve the store.
        RuntimeError: the worker did not start or store every run in time.
    """
    from rich.markup import escape

    from consumer.settings import ConsumerSettings
    from consumer.worker import Worker
    from deploy.demo.scenarios import SCENARIOS
    from deploy.demo.telemetry import kafka_telemetry
    from deploy.demo.training import run_data_parallel
    from deploy.serve import EndpointOptions, ServedLoop

    settings = ConsumerSettings(
        bootstrap_servers=bootstrap, db=str(db), topic=f"gradstream.demo-{stamp}.summaries",
        dlq_topic=f"gradstream.demo-{stamp}.dlq", group_id=f"gradstream-demo-{stamp}",
        shard_timeout_s=10.0, **({"webhook_url": webhook} if webhook else {}),
        **(alerting or {}),
    )
    options = None if serve_port is None else EndpointOptions(port=serve_port, token=token)
    served = ServedLoop(functools.partial(Worker, settings), db, options, "demo")
    if served.start():
        console.print(f"Live dashboard: {escape(served.dashboard_url)} (while the demo runs)",
                      style="bold", soft_wrap=True)  # one line: the URL stays whole
    worker = served.loop
    run_ids: list[str] = []
    try:
        if not worker.wait_ready(60):
            raise RuntimeError(f"the consumer worker did not start: {worker.error}")
        with progress:
            for name in chosen:
                sc = SCENARIOS[name]
                total = steps or sc.steps
                run_id = f"demo-{name}-{stamp}"
                task = progress.add_task(f"{name:<10} {ranks} ranks", total=total, loss="-")
                make = functools.partial(
                    kafka_telemetry, run_id=run_id, bootstrap_servers=bootstrap,
                    topic=settings.topic, config={"scenario": name, **sc.config()},
                )

                def on_step(step: int, loss: float, task=task) -> None:
                    progress.update(task, completed=step + 1, loss=f"{loss:.4g}")

                run_data_parallel(name, ranks, total, make, on_step=on_step)
                run_ids.append(run_id)
        console.print("Waiting for the worker to store every frame...")
        if not worker.wait_for_runs(run_ids, 120):
            raise RuntimeError(f"the worker did not store all runs in time: {worker.error}")
    finally:
        served.stop()
    console.print(
        f"Worker: {worker.counters.messages} messages, {worker.counters.frames} frames, "
        f"{worker.counters.dead_letters} dead letters -> {db}"
    )
    if worker.alerts is not None:
        fired = worker.alerts.engine.counters.fired
        console.print(f"Alerts: {fired} incident(s) fired (topic {settings.alerts_topic}); "
                      f"list them: gradstream alerts --db {db}")
        for name, sink in worker.alerts.summary().items():
            if name not in ("kafka", "log", "engine"):  # the routes given: webhook, ...
                console.print(f"  routed to {name}: {sink['delivered']} event(s) delivered, "
                              f"{sink['failed']} failed, {sink['dropped']} dropped")
    return run_ids


def report_runs(console: Console, db: Path, run_ids: list[str], out: Path, heatmap: bool) -> None:
    """Print each run's report (and ASCII heatmap when ``heatmap``) read back from ``db``,
    and write its CSV and JSON exports into ``out``."""
    from analysis.export import export_csv, export_json
    from analysis.heatmap import ascii_heatmap
    from analysis.read.connect import open_store
    from analysis.report import build_report, render_report

    con = open_store(db, read_only=True)
    try:
        for run_id in run_ids:
            summary = build_report(con, run_id)
            console.rule(f"[bold]{run_id}")
            console.print(render_report(summary))
            if heatmap:
                console.print(ascii_heatmap(con, run_id, max_columns=80), markup=False,
                              highlight=False)
            csv_path, json_path = out / f"{run_id}.csv", out / f"{run_id}.json"
            export_csv(con, run_id, csv_path)
            export_json(con, run_id, json_path)
            console.print(f"exports: {csv_path}  {json_path}")
    finally:
        con.close()
    console.print(
        f"\nSQL over the history: duckdb -readonly {db}   or   gradstream report --db {db} --all"
    )
