"""The demo's stream stored twice from one topic, by a worker writing DuckDB and by a worker
writing an Apache Iceberg table set on a local S3 endpoint (moto's server): ``report``,
``analyze`` and ``export`` print the same output on both stores."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from consumer.settings import ConsumerSettings
from consumer.worker import Worker
from deploy.cli import build_app
from deploy.demo.telemetry import kafka_telemetry
from deploy.demo.training import run_data_parallel
from tests.analysis.read.test_iceberg_reader import s3_endpoint  # noqa: F401  (fixture)

SCENARIOS = {"exploding": 40, "bad-rank": 30}
"""Demo scenarios streamed, with their steps (the exploding layers and the NaN of the last
rank's local gradient fall within them)."""

S3 = {"AWS_ACCESS_KEY_ID": "gradstream", "AWS_SECRET_ACCESS_KEY": "gradstream-secret",
      "AWS_REGION": "us-east-1"}


@pytest.fixture
def lake(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:  # noqa: F811
    """An S3 bucket on the local endpoint, its settings in the AWS environment variables;
    the warehouse URL."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    for name, value in S3.items():
        monkeypatch.setenv(name, value)
    boto3.client("s3", endpoint_url=s3_endpoint, region_name=S3["AWS_REGION"],
                 aws_access_key_id=S3["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=S3["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket="lake")
    yield "s3://lake/gradstream"


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(build_app(), list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0, (args, result.output)
    return result.stdout


def test_the_demo_stream_reads_the_same_from_iceberg_on_s3(
        kafka_bootstrap: str, unique_name: str, tmp_path: Path, lake: str) -> None:
    topic = f"iceberg-demo-{unique_name}"
    run_ids = [f"demo-{name}-{unique_name}" for name in SCENARIOS]
    for (name, steps), run_id in zip(SCENARIOS.items(), run_ids, strict=True):
        make = functools.partial(kafka_telemetry, run_id=run_id,
                                 bootstrap_servers=kafka_bootstrap, topic=topic)
        run_data_parallel(name, 2, steps, make)
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    common = dict(bootstrap_servers=kafka_bootstrap, topic=topic,
                  dlq_topic=f"{topic}-dlq", alerts_topic=f"{topic}-alerts", shard_timeout_s=10.0)
    workers = [
        Worker(ConsumerSettings(**common, group_id=f"duck-{unique_name}",
                                db=str(tmp_path / "demo.duckdb"))),
        Worker(ConsumerSettings(**common, group_id=f"ice-{unique_name}",
                                db=str(tmp_path / "unused.duckdb"), iceberg_catalog=catalog,
                                iceberg_warehouse=lake)),
    ]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        for w in workers:
            assert w.wait_for_runs(run_ids, 180), w.error
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(60)
    assert all(w.error is None for w in workers)
    assert not (tmp_path / "unused.duckdb").exists()
    duck, ice = str(tmp_path / "demo.duckdb"), f"iceberg+{catalog}?warehouse={lake}"
    for run_id in run_ids:
        for args in (("report", "--run", run_id, "--format", "json"),
                     ("analyze", "--kind", "flow", "--run", run_id, "--format", "json"),
                     ("analyze", "--kind", "explosion", "--run", run_id)):
            want = _invoke(*args, "--db", duck)
            assert len(want.splitlines()) > 1
            assert _invoke(*args, "--db", ice) == want, args
        for fmt in ("csv", "json"):
            paths = [tmp_path / f"{name}-{run_id}.{fmt}" for name in ("duck", "ice")]
            for store, path in zip((duck, ice), paths, strict=True):
                _invoke("export", "--db", store, "--run", run_id, "--format", fmt,
                        "--output", str(path))
            assert paths[0].read_bytes() == paths[1].read_bytes(), (run_id, fmt)
    report = json.loads(_invoke("report", "--run", run_ids[1], "--format", "json", "--db", ice))
    assert report["overall_health"] == "Critical"  # the NaN of the bad-rank scenario
