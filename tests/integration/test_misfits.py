"""Never merge what does not fit: real Kafka broker, real worker, real DuckDB file.

Two ranks announcing different layer lists (as a producer listing each rank's own local
slices would, e.g. FSDP v1's ``use_orig_params=True`` parameters taken as they are) must
not have rank 1's statistics merged by layer index into rank 0's layers; a piece whose
numel does not fit its parameter must not yield a complete frame. The tests read what
the user would: the dead-letter topic with its reason headers, the ``frames`` table and the
alerts stored with the run.
"""

from __future__ import annotations

import io
import threading
import time

import duckdb
import numpy as np
import pytest
from kafka import KafkaProducer
from rich.console import Console

from analysis.report import build_report, render_report
from consumer.alerts.rows import read_alerts
from consumer.settings import ConsumerSettings
from consumer.topic_admin import ensure_topics
from consumer.worker import Worker
from schemas.alert import AlertRule
from schemas.wire import RunFinished, RunStarted, StepSummary, encode_message
from tests.integration.dead_letters import read_dead_letters

STEPS = 3


def settings_for(bootstrap: str, name: str, db: str) -> ConsumerSettings:
    """One partition, a shard timeout far longer than the test: a frame finalised as
    partial here was finalised because the missing rank's data was refused."""
    return ConsumerSettings(
        bootstrap_servers=bootstrap, topic=f"misfit-{name}", dlq_topic=f"misfit-dlq-{name}",
        alerts_topic=f"misfit-alerts-{name}", group_id=f"misfit-{name}", db=db,
        shard_timeout_s=600.0, partitions=1,
    )


def summary(run_id: str, step: int, rank: int, numel: list[int], value: float,
            layout: bool) -> StepSummary:
    """A rank's summary with |g| = ``value`` in every element."""
    k = len(numel)
    return StepSummary(
        run_id=run_id, step=step, rank=rank, world_size=2, wall_time=1.7e9 + step,
        layer_indices=list(range(k)), numel=numel, sum_abs=[n * value for n in numel],
        sum_sq=[n * value * value for n in numel], max_abs=[value] * k, nonfinite=[0] * k,
        shard_index=[0] * k if layout else None, shard_count=[1] * k if layout else None,
    )


def send(settings: ConsumerSettings, run_id: str,
         messages: list[RunStarted | StepSummary | RunFinished]) -> None:
    """Send ``messages`` in order (binary wire, key = run id) and wait for the acks."""
    ensure_topics(settings, [settings.topic])
    producer = KafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks="all")
    for m in messages:
        producer.send(settings.topic, key=run_id.encode(), value=encode_message(m, "binary"))
    producer.flush()
    producer.close()


def run_through_worker(settings: ConsumerSettings, run_id: str,
                       messages: list[RunStarted | StepSummary | RunFinished]) -> Worker:
    """Send ``messages`` in order, then consume them until the run is finished and stored."""
    send(settings, run_id, messages)
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert worker.wait_for_runs([run_id], 120), worker.error
    finally:
        worker.stop()
        thread.join(60)
    assert worker.error is None
    return worker


def dead_letters(settings: ConsumerSettings, expected: int) -> list[dict[str, str]]:
    """Headers of the dead-letter topic's records (until ``expected`` arrived, then 1 s
    more for any surplus)."""
    return read_dead_letters(settings.bootstrap_servers, settings.dlq_topic, expected)


def test_a_rank_announcing_another_layer_list_is_refused_never_merged(
    kafka_bootstrap: str, tmp_path, unique_name: str
) -> None:
    """Rank 0 lists (a: 4096, b: 16), rank 1 (c: 4096, d: 64): rank 1's RunStarted and
    every summary of it are dead-lettered with the reason; the frames hold rank 0's pieces
    only (layer a keeps 4096 elements and rank 0's norm, not 8192 and a mix), are partial,
    and the missing_ranks alert says rank 1's data was refused, not that it sent nothing."""
    settings = settings_for(kafka_bootstrap, unique_name, str(tmp_path / "s.duckdb"))
    run_id = f"layers-{unique_name}"
    starts = [RunStarted(run_id=run_id, rank=r, world_size=2, layer_names=names,
                         numel=numel, start_time=1.7e9)
              for r, (names, numel) in enumerate([(["a", "b"], [4096, 16]),
                                                  (["c", "d"], [4096, 64])])]
    messages: list = [*starts]
    for step in range(STEPS):
        messages.append(summary(run_id, step, 0, [4096, 16], 0.5, layout=True))
        messages.append(summary(run_id, step, 1, [4096, 64], 2.0, layout=True))
    messages += [RunFinished(run_id=run_id, rank=r, world_size=2, last_step=STEPS - 1,
                             steps_recorded=STEPS, end_time=1.7e9 + STEPS) for r in (0, 1)]
    worker = run_through_worker(settings, run_id, messages)
    assert worker.counters.dead_letters == 1 + STEPS

    letters = dead_letters(settings, 1 + STEPS)
    assert [h["error"] for h in letters] == ["conflicting_run"] + ["refused_rank"] * STEPS
    assert "from rank 1 lists different layers" in letters[0]["reason"]
    assert "first difference at layer 0: 'c' (4096 elements) where the run has 'a'" \
        in letters[0]["reason"] and "(the run was started by rank 0)" in letters[0]["reason"]
    assert all(h["reason"].startswith("rank 1's RunStarted was refused: RunStarted for run")
               for h in letters[1:])

    con = duckdb.connect(settings.db, read_only=True)
    frames = con.execute("SELECT step, complete, ranks_seen, missing_ranks, refused_ranks, "
                         "layout_violations FROM frames WHERE run_id = ? ORDER BY step",
                         [run_id]).fetchall()
    assert frames == [(s, False, [0], [1], [1], 0) for s in range(STEPS)]
    rows = con.execute("SELECT layer_index, numel, grad_norm FROM layer_stats "
                       "WHERE run_id = ? AND step = 0 ORDER BY layer_index", [run_id]).fetchall()
    assert [(i, n) for i, n, _ in rows] == [(0, 4096), (1, 16)]
    assert np.isclose(rows[0][2], np.sqrt(4096 * 0.25))  # rank 0's norm only
    (fired,) = [a for a in read_alerts(con, run_id, rule=AlertRule.MISSING_RANKS)
                if a.state.value == "firing"]
    assert fired.ranks == [1] and "sent nothing" not in fired.message
    assert "rank 1's data was refused: its RunStarted was refused" in fired.message
    assert fired.values["silent_ranks"] == [] and list(fired.values["refused_ranks"]) == ["1"]
    con.close()


def test_pieces_that_do_not_fit_their_parameter_never_make_a_complete_frame(
    kafka_bootstrap: str, tmp_path, unique_name: str
) -> None:
    """Two ranks hold disjoint halves of (w: 4096, b: 16). Step 0 fits; at step 1 rank 1
    claims 8192 elements of w (dead-lettered from the message alone); at step 2 each rank
    claims all 4096 elements of w as its own disjoint piece (8192 counted for a 4096
    parameter: a marked partial frame with the shard_layout alert)."""
    settings = settings_for(kafka_bootstrap, unique_name, str(tmp_path / "s.duckdb"))
    run_id = f"numel-{unique_name}"
    messages: list = [RunStarted(run_id=run_id, rank=r, world_size=2, layer_names=["w", "b"],
                                 numel=[4096, 16], start_time=1.7e9) for r in (0, 1)]
    pieces = {0: ([2048, 8], [2048, 8]), 1: ([2048, 8], [8192, 8]), 2: ([4096, 8], [4096, 8])}
    for step, (mine, theirs) in pieces.items():
        messages.append(summary(run_id, step, 0, mine, 0.5, layout=False))
        messages.append(summary(run_id, step, 1, theirs, 0.25, layout=False))
    messages += [RunFinished(run_id=run_id, rank=r, world_size=2, last_step=2,
                             steps_recorded=3, end_time=1.7e9 + 3) for r in (0, 1)]
    worker = run_through_worker(settings, run_id, messages)
    assert worker.counters.dead_letters == 1

    (letter,) = dead_letters(settings, 1)
    assert letter["error"] == "invalid"
    assert letter["reason"].startswith("rank 1 step 1: layer 0 holds 8192 elements as a "
                                       "piece, which exceeds the parameter's 4096")

    con = duckdb.connect(settings.db, read_only=True)
    frames = con.execute("SELECT step, complete, ranks_seen, missing_ranks, refused_ranks, "
                         "layout_violations FROM frames WHERE run_id = ? ORDER BY step",
                         [run_id]).fetchall()
    assert frames == [(0, True, [0, 1], [], [], 0), (1, False, [0], [1], [1], 0),
                      (2, False, [0, 1], [], [], 1)]
    numel = con.execute("SELECT step, numel FROM layer_stats WHERE run_id = ? AND "
                        "layer_index = 0 ORDER BY step", [run_id]).fetchall()
    assert numel == [(0, 4096), (1, 2048), (2, 8192)]  # stored as counted, marked partial
    alerts = read_alerts(con, run_id)
    (layout,) = [a for a in alerts if a.rule == AlertRule.SHARD_LAYOUT
                 and a.state.value == "firing"]
    assert layout.step == 2 and layout.layers == ["w"] and layout.severity.value == "critical"
    assert "w's pieces hold 8192 elements, the parameter 4096 (RunStarted)" in layout.message
    assert "stored as partial" in layout.message
    report = build_report(con, run_id)
    assert (report.partial_frames, report.partial_missing_ranks, report.partial_refused_ranks,
            report.partial_misfit_pieces) == (2, 1, 1, 1)
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render_report(report))
    assert ("2 partial: 1 missing a rank, 1 with a rank's data refused, 1 with pieces that "
            "do not fit their parameter" in out.getvalue())
    (missing,) = [a for a in alerts if a.rule == AlertRule.MISSING_RANKS
                  and a.state.value == "firing"]
    assert missing.step == 1 and "rank 1's data was refused: its summary was " \
        "dead-lettered: rank 1 step 1: layer 0 holds 8192 elements" in missing.message
    con.close()


def test_scale_out_stores_a_replica_of_the_wrong_size_as_a_partial_frame(
    kafka_bootstrap: str, tmp_path, unique_name: str
) -> None:
    """Scale-out mode (worker -> frames topic -> store): three ranks hold w (4096) in two
    pieces of 2048; rank 2's replica of piece 0 claims 1024 elements. The worker leaves it
    out, so the counted pieces still add up to 4096, yet the store's DuckDB holds the frame
    as partial, every rank seen, with the misfit layer counted in ``layout_violations``."""
    from consumer.store_writer import StoreWriter
    from consumer.store_writer_settings import StoreWriterSettings

    settings = settings_for(kafka_bootstrap, unique_name, str(tmp_path / "w.duckdb"))
    settings = settings.model_copy(update={"frames_topic": f"misfit-frames-{unique_name}",
                                           "runs_topic": f"misfit-runs-{unique_name}",
                                           })
    run_id = f"replica-{unique_name}"
    messages: list = [RunStarted(run_id=run_id, rank=r, world_size=3, layer_names=["w"],
                                 numel=[4096], start_time=1.7e9) for r in range(3)]
    for rank, (piece, numel) in enumerate([(0, 2048), (1, 2048), (0, 1024)]):
        messages.append(StepSummary(
            run_id=run_id, step=0, rank=rank, world_size=3, wall_time=1.7e9,
            layer_indices=[0], numel=[numel], sum_abs=[numel * 0.5],
            sum_sq=[numel * 0.25], max_abs=[0.5], nonfinite=[0],
            shard_index=[piece], shard_count=[2]))
    messages += [RunFinished(run_id=run_id, rank=r, world_size=3, last_step=0,
                             steps_recorded=1, end_time=1.7e9 + 1) for r in range(3)]
    store = StoreWriter(StoreWriterSettings(bootstrap_servers=kafka_bootstrap,
                                frames_topic=settings.frames_topic,
                                alerts_topic=settings.alerts_topic,
                                group_id=f"misfit-store-{unique_name}",
                                db=str(tmp_path / "store.duckdb")))
    thread = threading.Thread(target=store.run, daemon=True)
    thread.start()
    try:
        assert store.wait_ready(60)
        worker = run_through_worker(settings, run_id, messages)
        assert worker.counters.dead_letters == 0
        assert store.wait_for_runs([run_id], 60), store.error
    finally:
        store.stop()
        thread.join(60)
    assert store.error is None
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    frames = con.execute("SELECT step, complete, ranks_seen, missing_ranks, refused_ranks, "
                         "layout_violations FROM frames WHERE run_id = ?", [run_id]).fetchall()
    assert frames == [(0, False, [0, 1, 2], [], [], 1)]
    numel = con.execute("SELECT numel FROM layer_stats WHERE run_id = ?", [run_id]).fetchall()
    assert numel == [(4096,)]  # the counted pieces add up: only the ledger row tells
    con.close()


@pytest.mark.parametrize("scale_out", [False, True], ids=["duckdb", "scale_out"])
def test_a_refused_rank_stays_refused_after_a_worker_restart(
    kafka_bootstrap: str, tmp_path, unique_name: str, scale_out: bool
) -> None:
    """Rank 1 announces another layer list and is refused; the worker stops after step 0.
    A new worker (the refusal reloaded from the DuckDB table ``refused_ranks``, or in
    scale-out mode from the compacted runs topic) still dead-letters rank 1's later
    summaries with ``refused_rank``, never merging them."""
    settings = settings_for(kafka_bootstrap, unique_name, str(tmp_path / "s.duckdb"))
    if scale_out:
        settings = settings.model_copy(update={
            "frames_topic": f"misfit-frames-{unique_name}",
            "runs_topic": f"misfit-runs-{unique_name}"})
    run_id = f"restart-{unique_name}"
    first: list = [RunStarted(run_id=run_id, rank=r, world_size=2, layer_names=names,
                              numel=[4096, 16], start_time=1.7e9)
                   for r, names in enumerate([["a", "b"], ["c", "d"]])]
    first += [summary(run_id, 0, r, [4096, 16], 0.5 * (r + 1), layout=True) for r in (0, 1)]
    send(settings, run_id, first)
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while worker.counters.frames < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.counters.frames == 1 and worker.counters.dead_letters == 2
    finally:
        worker.stop()
        thread.join(60)
    assert worker.error is None
    if not scale_out:
        con = duckdb.connect(settings.db, read_only=True)
        assert con.execute("SELECT run_id, rank FROM refused_ranks").fetchall() == [
            (run_id, 1)]
        con.close()

    later: list = []
    for step in (1, 2):
        later += [summary(run_id, step, r, [4096, 16], 0.5 * (r + 1), layout=True)
                  for r in (0, 1)]
    later += [RunFinished(run_id=run_id, rank=r, world_size=2, last_step=2,
                          steps_recorded=3, end_time=1.7e9 + 3) for r in (0, 1)]
    again = run_through_worker(settings, run_id, later)  # a new Worker, same file
    assert again.counters.dead_letters == 2
    letters = dead_letters(settings, 4)
    assert [h["error"] for h in letters] == ["conflicting_run"] + ["refused_rank"] * 3
    assert all(h["reason"].startswith("rank 1's RunStarted was refused: RunStarted for run")
               for h in letters[1:])
    if scale_out:
        return  # the frames went to the frames topic (the store's test is above)
    con = duckdb.connect(settings.db, read_only=True)
    frames = con.execute("SELECT step, complete, ranks_seen, refused_ranks FROM frames "
                         "WHERE run_id = ? ORDER BY step", [run_id]).fetchall()
    assert frames == [(s, False, [0], [1]) for s in range(3)]
    norms = con.execute("SELECT grad_norm FROM layer_stats WHERE run_id = ? AND "
                        "layer_index = 0", [run_id]).fetchall()
    assert np.allclose([n for (n,) in norms], np.sqrt(4096 * 0.25))  # rank 0's only
    con.close()
