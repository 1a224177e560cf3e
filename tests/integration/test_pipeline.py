"""Pipeline parallelism: each stage's ranks build the tap on their own stage and declare
only its layers; the run's layer list is their union, and the stored frames equal torch's
own values of the full gradients of every stage (real gloo ranks, point-to-point
activations, DDP within a stage, the real broker, worker and DuckDB)."""

from __future__ import annotations

import math
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import pytest

from consumer.settings import ConsumerSettings
from consumer.worker import Worker
from tests.integration.parallel_ranks import STEPS, run_pipeline_rank
from tests.integration.test_parallelism import assert_frames_match_torch, run_ranks


def run_pipeline(dp: int, tmp_path: Path, bootstrap: str, name: str, **options: Any
                 ) -> tuple[dict[str, Any], duckdb.DuckDBPyConnection, str, list[Any]]:
    """Run a 2-stage x ``dp`` pipeline job into a fresh worker and store; return torch's
    values of both stages merged (the shape ``assert_frames_match_torch`` reads), a
    read-only connection, the run id and the layer lists the taps announced."""
    world = 2 * dp
    settings = ConsumerSettings(
        bootstrap_servers=bootstrap, topic=f"pp-{name}", dlq_topic=f"pp-dlq-{name}",
        group_id=f"pp-{name}", db=str(tmp_path / "pp.duckdb"))
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    run_id = f"pp-{world}-{name}"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'pg-pp'}"
    try:
        assert worker.wait_ready(60)
        procs = [ctx.Process(target=run_pipeline_rank, args=(
            r, world, dp, init, bootstrap, settings.topic, run_id, queue, options))
            for r in range(world)]
        stages = {item["stage"]: item for item in run_ranks(procs, queue, 2)}
        assert worker.wait_for_runs([run_id], 60)
        deadline = time.monotonic() + 30
        while worker.counters.frames < STEPS and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.counters.dead_letters == 0
    first, second = stages[0], stages[1]
    records = []
    for a, b in zip(first["records"], second["records"], strict=True):
        records.append({"layers": {**a["layers"], **b["layers"]},
                        "total_norm": math.hypot(a["total_norm"], b["total_norm"])})
    merged = {"names": first["names"] + second["names"], "records": records}
    announced = [first["layers"], second["layers"]]
    return merged, duckdb.connect(settings.db, read_only=True), run_id, announced


@pytest.mark.parametrize("dp,reduce", [(1, "auto"), (2, "auto"), (1, "off")])
def test_stages_declaring_their_own_layers_make_one_run(dp, reduce, kafka_bootstrap,
                                                        tmp_path, unique_name):
    result, con, run_id, announced = run_pipeline(dp, tmp_path, kafka_bootstrap, unique_name,
                                                  reduce=reduce)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert result["names"] == names
    assert announced == [names, names]  # both stages announce the union, in model order
    stored = con.execute("SELECT name, numel FROM layers WHERE run_id = ? ORDER BY "
                         "layer_index", [run_id]).fetchall()
    assert stored == [(n, result["records"][0]["layers"][n]["numel"]) for n in names]
    assert_frames_match_torch(result, con, run_id)
    complete = con.execute("SELECT count(*) FROM frames WHERE run_id = ? AND complete",
                           [run_id]).fetchone()[0]
    assert complete == STEPS
