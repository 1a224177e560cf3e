"""Scale-out chaos: two workers and the store, each SIGKILLed and restarted several times
at random moments while several multi-rank runs stream; then the same with two store
processes writing one Apache Iceberg table set (``--iceberg-catalog``), each reading half
of the partitions (``--assign-partitions``).

The processes are the real ``gradstream consume --frames-topic`` and ``gradstream store``
commands (configured through ``GRADSTREAM_*`` variables, as ``consume --workers N`` starts
its children); workers use static group membership, so a restarted worker takes its
partitions back without waiting for its predecessor's session to expire. Afterwards the
store must hold exactly the frames computed offline from the same summaries (0 missing,
0 duplicated, 0 wrong-valued), each alert event once, every incident resolved once, and
every restarted process must have written again within 5 s of its start (DuckDB) or 20 s
(Iceberg: a restarted store reads the stored runs back from the tables, and each write is
one commit per table to the catalog).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import pytest
from kafka import KafkaProducer

from consumer.frames import MergedShards, compute_frame
from consumer.store_writer import StoreWriter
from consumer.store_writer_settings import StoreWriterSettings
from schemas.wire import RunFinished, RunStarted, StepSummary, encode_message

WORLD = 2
LAYERS = 6
STEPS = 160
RUNS = 4
KILLS = 7
MAX_RESUME_S = {"duckdb": 5.0, "iceberg": 20.0}
STEP_INTERVAL_S = 0.2
"""Streaming lasts about STEPS * STEP_INTERVAL_S = 32 s, while the kills happen."""
NAN_STEPS = range(70, 73)
"""Run 0 has a NaN on rank 1, layer 2 at these steps: one nonfinite incident."""


def shard(run: int, step: int, rank: int) -> StepSummary:
    """Deterministic shard of (run, step, rank)."""
    rng = np.random.default_rng([run, step, rank])
    numel = np.full(LAYERS, 40 + rank)
    scale = np.full(LAYERS, 1e-2)
    sum_abs = rng.uniform(0.5, 1.0, LAYERS) * scale * numel
    nonfinite = [0] * LAYERS
    if run == 0 and step in NAN_STEPS and rank == 1:
        nonfinite[2] = 1
    return StepSummary(
        run_id=f"run{run}", step=step, rank=rank, world_size=WORLD, wall_time=1.0 + step,
        layer_indices=list(range(LAYERS)), numel=numel.tolist(), sum_abs=sum_abs.tolist(),
        sum_sq=(sum_abs * scale).tolist(), max_abs=(scale * 2).tolist(), nonfinite=nonfinite,
    )


def offline(run: int, step: int) -> list[tuple]:
    """The rows of (run, step) computed here from the shards, as the store must hold them."""
    merged = MergedShards.empty(LAYERS)
    for rank in range(WORLD):
        s = shard(run, step, rank)
        merged.add(np.arange(LAYERS), np.asarray(s.numel), np.asarray(s.sum_abs),
                   np.asarray(s.sum_sq), np.asarray(s.max_abs), np.asarray(s.nonfinite))
    f = compute_frame(f"run{run}", step, merged, vanishing_threshold=1e-7,
                      exploding_threshold=1e3, ranks_seen=tuple(range(WORLD)),
                      world_size=WORLD, wall_time=0.0)
    return [(int(f.numel[i]), float(f.sum_abs[i]), float(f.sum_sq[i]),
             float(f.max_abs_grad[i]), int(f.nonfinite[i])) for i in range(LAYERS)]


@dataclass
class Process:
    """One gradstream process, restarted under the same name and environment."""

    name: str
    command: list[str]
    env: dict[str, str]
    popen: subprocess.Popen[str] | None = None
    resume_s: list[float | None] = field(default_factory=list)
    """Per incarnation: seconds from its start to its first write (None: none yet)."""
    log: list[str] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)
    """Index in ``log`` where each incarnation begins."""

    def start(self) -> None:
        """Start an incarnation; a reader thread notes when it first writes."""
        started, incarnation = time.monotonic(), len(self.resume_s)
        self.resume_s.append(None)
        self.marks.append(len(self.log))
        self.log.append(f"=== start {time.strftime('%H:%M:%S')}")
        self.popen = subprocess.Popen(self.command, env=self.env, stderr=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, args=(self.popen, started, incarnation),
                         daemon=True).start()

    def _read(self, popen: subprocess.Popen[str], started: float, incarnation: int) -> None:
        assert popen.stderr is not None
        for line in popen.stderr:
            self.log.append(line.rstrip())
            if self.resume_s[incarnation] is None and "resumed" in line:
                self.resume_s[incarnation] = time.monotonic() - started

    def wait_for(self, text: str, timeout_s: float = 60.0) -> None:
        """Block until the current incarnation logged ``text``.

        Raises:
            AssertionError: not within ``timeout_s`` (with the log's tail).
        """
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.log[self.marks[-1]:]):
            assert time.monotonic() < deadline, f"{self.name}: no {text!r}:\n" + "\n".join(
                self.log[-30:])
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: no flush, no leaving the group."""
        assert self.popen is not None
        self.log.append(f"=== SIGKILL {time.strftime('%H:%M:%S')}")
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(30)

    def terminate(self) -> int:
        """SIGTERM and wait: the process writes its batch and stops."""
        assert self.popen is not None
        self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(60)


def store_settings(store: str, tmp_path: Path) -> dict[str, str]:
    """The store's ``GRADSTREAM_*`` settings: a DuckDB file, or an Iceberg table set (a
    SQLite catalog and a warehouse directory)."""
    if store == "duckdb":
        return {"GRADSTREAM_DB": str(tmp_path / "store.duckdb")}
    return {"GRADSTREAM_ICEBERG_CATALOG": f"sqlite:///{tmp_path / 'catalog.db'}",
            "GRADSTREAM_ICEBERG_WAREHOUSE": (tmp_path / "warehouse").as_uri(),
            "GRADSTREAM_DB": str(tmp_path / "unused.duckdb")}


def stored_tables(store: str, tmp_path: Path) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """(layer rows, frame rows, alert rows) of the store, read with DuckDB or with
    pyiceberg alone."""
    layer_columns = ["run_id", "step", "layer_index", "numel", "sum_abs", "sum_sq",
                     "max_abs_grad", "nonfinite"]
    frame_columns = ["run_id", "step", "complete"]
    alert_columns = ["alert_id", "incident_id", "run_id", "rule", "state", "first_step"]
    if store == "duckdb":
        con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
        try:
            return tuple(  # type: ignore[return-value]
                con.execute(f"SELECT {', '.join(columns)} FROM {table}").fetchall()
                for table, columns in (("layer_stats", layer_columns),
                                       ("frames", frame_columns), ("alerts", alert_columns)))
        finally:
            con.close()
    from pyiceberg.catalog.sql import SqlCatalog

    from schemas.iceberg_catalog import CATALOG_NAME  # the writer's name: tables are kept per name

    catalog = SqlCatalog(CATALOG_NAME, uri=f"sqlite:///{tmp_path / 'catalog.db'}",
                         warehouse=(tmp_path / "warehouse").as_uri())

    def rows(table: str, columns: list[str]) -> list[tuple]:
        arrow = catalog.load_table(f"gradstream.{table}").scan(
            selected_fields=tuple(columns)).to_arrow()
        return list(zip(*(arrow[c].to_pylist() for c in columns), strict=True))

    return (rows("layer_stats", layer_columns), rows("frames", frame_columns),
            rows("alerts", alert_columns))


@pytest.mark.parametrize("store_kind", ["duckdb", "iceberg"])
def test_kill_and_restart_loses_nothing(kafka_bootstrap, tmp_path, unique_name, store_kind):
    topics = {name: f"chaos-{name}-{unique_name}"
              for name in ("summaries", "frames", "dlq", "alerts", "runs")}
    base = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
                GRADSTREAM_FRAMES_TOPIC=topics["frames"], GRADSTREAM_DLQ_TOPIC=topics["dlq"],
                GRADSTREAM_ALERTS_TOPIC=topics["alerts"], GRADSTREAM_PARTITIONS="4")
    stored = store_settings(store_kind, tmp_path)
    command = [sys.executable, "-m", "deploy.cli"]
    workers = [
        Process(f"worker{i}", [*command, "consume"], dict(
            base, GRADSTREAM_TOPIC=topics["summaries"], GRADSTREAM_RUNS_TOPIC=topics["runs"],
            GRADSTREAM_GROUP_ID=f"chaos-{unique_name}", GRADSTREAM_SHARD_TIMEOUT_S="3",
            GRADSTREAM_GROUP_INSTANCE_ID=f"chaos-{unique_name}-{i}",
            GRADSTREAM_SESSION_TIMEOUT_MS="10000"))
        for i in range(2)
    ]
    if store_kind == "duckdb":
        stores = [Process("store", [*command, "store"],
                          dict(base, **stored, GRADSTREAM_GROUP_ID="chaos-store"))]
    else:  # two store processes, half of the partitions each, one table set
        stores = [Process(f"store{i}", [*command, "store"],
                          dict(base, **stored, GRADSTREAM_GROUP_ID="chaos-store",
                               GRADSTREAM_ASSIGNED_PARTITIONS=parts))
                  for i, parts in enumerate(("0,1", "2,3"))]
    processes = [*workers, *stores]
    for p in processes:
        p.start()
    for p in processes:
        p.wait_for("assigned [(")
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=5)

    def send(message) -> None:
        producer.send(topics["summaries"], key=message.run_id.encode(),
                      value=encode_message(message))

    rng = random.Random(20261123)
    # Every process killed at least twice, never twice in a row, at random moments; the
    # next kill comes after the restarted process resumed (wrote, or had nothing to read).
    victims: list[Process] = []
    while len(victims) < KILLS:
        round_ = rng.sample(processes, len(processes))
        if victims and round_[0] is victims[-1]:
            round_[0], round_[1] = round_[1], round_[0]
        victims += round_
    victims = victims[:KILLS]
    chaos_errors: list[BaseException] = []

    def chaos() -> None:
        """Kill a victim at a random moment, restart it, wait until it resumed; repeat."""
        try:
            for victim in victims:
                time.sleep(rng.uniform(0.5, 2.5))
                victim.kill()
                time.sleep(rng.uniform(0.0, 1.0))
                victim.start()
                victim.wait_for("resumed")
        except BaseException as exc:  # reported by the test thread
            chaos_errors.append(exc)

    chaos_thread = threading.Thread(target=chaos, daemon=True)
    try:
        for run in range(RUNS):
            for rank in range(WORLD):
                send(RunStarted(run_id=f"run{run}", rank=rank, world_size=WORLD,
                                layer_names=[f"l{i}" for i in range(LAYERS)],
                                numel=[81] * LAYERS, start_time=1.0))
        chaos_thread.start()
        for step in range(STEPS):
            for run in range(RUNS):
                for rank in range(WORLD):
                    send(shard(run, step, rank))
            producer.flush()
            time.sleep(STEP_INTERVAL_S)
        chaos_thread.join(120)
        assert not chaos_errors, chaos_errors
        for run in range(RUNS):
            for rank in range(WORLD):
                send(RunFinished(run_id=f"run{run}", rank=rank, world_size=WORLD,
                                 last_step=STEPS - 1, end_time=2.0))
        producer.flush()
        time.sleep(8.0)  # the workers publish the last frames
        for p in workers:
            assert p.terminate() == 0, "\n".join(p.log[-20:])
        for p in stores:
            assert p.terminate() == 0, "\n".join(p.log[-20:])
    finally:
        producer.close()
        for p in processes:
            if p.popen is not None and p.popen.poll() is None:
                p.kill()
            (tmp_path / f"{p.name}.log").write_text("\n".join(p.log))
    # Whatever the last store incarnation had not read yet is read by a fresh store.
    final = StoreWriter(StoreWriterSettings(
        bootstrap_servers=kafka_bootstrap, frames_topic=topics["frames"],
        alerts_topic=topics["alerts"], group_id="chaos-store",
        **{k.removeprefix("GRADSTREAM_").lower(): v for k, v in stored.items()}))
    thread = threading.Thread(target=final.run, daemon=True)
    thread.start()
    run_ids = [f"run{r}" for r in range(RUNS)]
    try:
        assert final.wait_for_runs(run_ids, 120), "the store did not see every run finish"
        time.sleep(1.0)  # alert events after the last frame
    finally:
        final.stop()
        thread.join(60)
    assert final.error is None

    rows, frames, alerts = stored_tables(store_kind, tmp_path)
    by_step: dict[tuple[str, int], dict[int, tuple]] = {}
    duplicated = 0
    for run_id, step, layer, *values in rows:
        per_step = by_step.setdefault((run_id, step), {})
        duplicated += layer in per_step
        per_step[layer] = tuple(values)
    lost = wrong = 0
    for run in range(RUNS):
        for step in range(STEPS):
            got = by_step.get((f"run{run}", step), {})
            for layer, want in enumerate(offline(run, step)):
                if layer not in got:
                    lost += 1
                elif not (got[layer][0] == want[0] and got[layer][4] == want[4]
                          and np.allclose(got[layer][1:4], want[1:4], rtol=1e-12, atol=0)):
                    wrong += 1
    duplicated += len(frames) - len({(r, s) for r, s, _ in frames})
    restarts = [s for p in processes for s in p.resume_s[1:]]
    max_resume = max((s if s is not None else float("inf") for s in restarts), default=0.0)
    print(f"{store_kind}: lost={lost} duplicated={duplicated} wrong={wrong} "
          f"max_resume_s={max_resume:.2f}")
    assert (lost, duplicated, wrong) == (0, 0, 0)
    assert all(complete for *_, complete in frames)
    assert len(restarts) == KILLS
    assert max_resume <= MAX_RESUME_S[store_kind], {p.name: p.resume_s for p in processes}
    # Alerts: one row per event, one nonfinite incident in run 0, fired and resolved once.
    assert len({a[0] for a in alerts}) == len(alerts)
    nonfinite = [a for a in alerts if a[3] == "nonfinite"]
    assert sorted((a[2], a[4], a[5]) for a in nonfinite) == [
        ("run0", "firing", NAN_STEPS[0]), ("run0", "resolved", NAN_STEPS[0])], nonfinite
    incidents: dict[tuple[str, str], set[str]] = {}
    for _id, incident, run_id, rule, state, _first in alerts:
        if state == "firing":
            incidents.setdefault((run_id, rule), set()).add(incident)
    assert all(len(ids) == 1 for ids in incidents.values()), incidents
