"""Faults survived: a worker killed with SIGKILL ten times, a broker restart, bad input.

Each check computes the run's frames offline from the same summaries (exact sums into
``consumer.frames.MergedShards``, then ``compute_frame``) and compares them with DuckDB:
every (run, step, layer) row present once with equal values, every frame complete. The
statistics are dyadic rationals (integers times powers of two), so the merged sums are
exact whatever order the ranks arrive in and "equal" means bit-for-bit. Each check prints
``lost=0 duplicated=0`` on success.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from consumer.frames import MergedShards, compute_frame
from consumer.settings import ConsumerSettings
from consumer.topic_admin import ensure_topics
from consumer.worker import Worker
from deploy.broker import LocalBroker
from producer import GradientProducer, LayerSummaries
from schemas.wire import (
    MAX_MESSAGE_BYTES,
    RunFinished,
    RunStarted,
    StepSummary,
    WireError,
    decode_message,
    encode_message,
)
from tests.integration.dead_letters import read_dead_letters

COLUMNS = ("numel", "sum_abs", "sum_sq", "max_abs_grad", "nonfinite", "mean_abs_grad",
           "grad_norm", "flow_intensity", "is_vanishing", "is_exploding")
WALL_TIME_0 = 1.7e9


@dataclass
class RunData:
    """Summaries of one run: ``ranks`` ranks report all ``layers`` layers for ``steps``
    steps (DDP-style). Arrays are [step, rank, layer]; values are dyadic rationals."""

    run_id: str
    numel: np.ndarray
    sum_abs: np.ndarray
    sum_sq: np.ndarray
    max_abs: np.ndarray
    nonfinite: np.ndarray

    @property
    def shape(self) -> tuple[int, int, int]:
        """(steps, ranks, layers)."""
        return self.sum_abs.shape

    def run_started(self, rank: int) -> RunStarted:
        _, ranks, layers = self.shape
        return RunStarted(run_id=self.run_id, rank=rank, world_size=ranks,
                          layer_names=[f"layer.{i}" for i in range(layers)],
                          numel=(self.numel.sum(axis=0)).tolist(), start_time=WALL_TIME_0)

    def summary(self, step: int, rank: int) -> StepSummary:
        _, ranks, layers = self.shape
        return StepSummary(
            run_id=self.run_id, step=step, rank=rank, world_size=ranks,
            wall_time=WALL_TIME_0 + step, layer_indices=list(range(layers)),
            numel=self.numel[rank].tolist(), sum_abs=self.sum_abs[step, rank].tolist(),
            sum_sq=self.sum_sq[step, rank].tolist(), max_abs=self.max_abs[step, rank].tolist(),
            nonfinite=self.nonfinite[step, rank].tolist(),
        )

    def run_finished(self, rank: int) -> RunFinished:
        steps, ranks, _ = self.shape
        return RunFinished(run_id=self.run_id, rank=rank, world_size=ranks,
                           last_step=steps - 1, steps_recorded=steps, end_time=WALL_TIME_0)

    def stream(self, rng: random.Random) -> list[bytes]:
        """Every message of the run, encoded: all RunStarted, then the ranks' step
        summaries randomly interleaved (each rank in step order, ranks drifting apart),
        each rank's RunFinished after its last step."""
        steps, ranks, _ = self.shape
        out = [encode_message(self.run_started(r)) for r in range(ranks)]
        next_step = [0] * ranks
        while any(s <= steps for s in next_step):
            rank = rng.choice([r for r in range(ranks) if next_step[r] <= steps])
            step = next_step[rank]
            next_step[rank] += 1
            out.append(encode_message(self.summary(step, rank) if step < steps
                                      else self.run_finished(rank)))
        return out

    def expected(self) -> dict[str, np.ndarray]:
        """The stored columns expected, each [steps * layers] in (step, layer) order,
        from MergedShards + compute_frame over every rank."""
        steps, ranks, layers = self.shape
        started = self.run_started(0)
        idx = np.arange(layers)
        cols: dict[str, list[np.ndarray]] = {c: [] for c in COLUMNS}
        for step in range(steps):
            merged = MergedShards.empty(layers)
            for rank in range(ranks):
                merged.add(idx, self.numel[rank], self.sum_abs[step, rank],
                           self.sum_sq[step, rank], self.max_abs[step, rank],
                           self.nonfinite[step, rank])
            frame = compute_frame(
                self.run_id, step, merged, vanishing_threshold=started.vanishing_threshold,
                exploding_threshold=started.exploding_threshold,
                ranks_seen=tuple(range(ranks)), world_size=ranks, wall_time=WALL_TIME_0 + step,
            )
            for c in COLUMNS:
                cols[c].append(getattr(frame, c))
        return {c: np.concatenate(v) for c, v in cols.items()}


def make_run(run_id: str, ranks: int, layers: int, steps: int, seed: int) -> RunData:
    """Random dyadic statistics with a vanishing layer 0, an exploding layer 1 every 7th
    step, and a NaN on rank 1 of layer 2 at steps = 5 mod 997."""
    rng = np.random.default_rng(seed)
    shape = (steps, ranks, layers)
    numel = np.full((ranks, layers), 4096, np.int64)
    sum_abs = rng.integers(1, 2**20, shape) * 2.0**-10
    sum_sq = rng.integers(1, 2**20, shape) * 2.0**-10
    max_abs = rng.integers(1, 2**10, shape) * 2.0**-8
    sum_abs[:, :, 0] *= 2.0**-40
    sum_sq[:, :, 0] *= 2.0**-80
    max_abs[:, :, 0] *= 2.0**-40
    hot = np.arange(steps) % 7 == 0
    max_abs[hot, np.arange(steps)[hot] % ranks, 1] = 2048.0
    nonfinite = np.zeros(shape, np.int64)
    if layers > 2 and ranks > 1:
        nonfinite[np.arange(steps) % 997 == 5, 1, 2] = 1
    return RunData(run_id, numel, sum_abs, sum_sq, max_abs, nonfinite)


def compare_store(db: str | Path, run: RunData) -> tuple[int, int]:
    """(lost, duplicated) layer rows and frames of ``run`` in the store; asserts that the
    values equal the offline frames and that every frame is complete."""
    steps, ranks, layers = run.shape
    con = duckdb.connect(str(db), read_only=True)
    try:
        got = con.execute(
            f"SELECT step, layer_index, {', '.join(COLUMNS)} FROM layer_stats "
            "WHERE run_id = ? ORDER BY step, layer_index", [run.run_id],
        ).fetchnumpy()
        frames = con.execute(
            "SELECT step, complete, ranks_seen FROM frames WHERE run_id = ? ORDER BY step",
            [run.run_id],
        ).fetchall()
    finally:
        con.close()
    keys = np.asarray(got["step"], np.int64) * layers + np.asarray(got["layer_index"])
    unique = np.unique(keys)
    frame_steps = [f[0] for f in frames]
    duplicated = (len(keys) - len(unique)) + (len(frame_steps) - len(set(frame_steps)))
    lost = len(np.setdiff1d(np.arange(steps * layers), unique))
    lost += len(set(range(steps)) - set(frame_steps))
    extra = len(np.setdiff1d(unique, np.arange(steps * layers)))
    assert extra == 0, f"{extra} rows that no summary produced"
    if lost == 0 and duplicated == 0:
        expected = run.expected()
        for c in COLUMNS:
            np.testing.assert_array_equal(np.asarray(got[c]), expected[c], err_msg=c)
        assert all(complete and sorted(seen) == list(range(ranks))
                   for _, complete, seen in frames)
    return lost, duplicated


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]] | None:
    """Samples of a worker's metrics endpoint by sample name; None if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(samples: dict | None, name: str) -> float:
    return sum(v for _, v in (samples or {}).get(name, []))


# -- crash ---------------------------------------------------------------------------------


def test_worker_killed_ten_times_stores_every_frame_exactly_once(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """4 ranks x 5000 steps stream while `gradstream consume --db` is SIGKILLed 10 times."""
    run = make_run(f"crash-{unique_name}", ranks=4, layers=6, steps=5000, seed=11)
    rng = random.Random(5)
    messages = run.stream(rng)
    assert len(messages) >= 20_000
    topic, db, port = f"crash-{unique_name}", tmp_path / "crash.duckdb", free_port()
    ensure_topics(ConsumerSettings(bootstrap_servers=kafka_bootstrap, partitions=2), [topic])
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "GRADSTREAM_GROUP_INSTANCE_ID": f"crash-worker-{unique_name}"}
    command = [sys.executable, "-m", "deploy.cli", "consume", "--db", str(db), "--topic", topic,
               "--dlq-topic", f"{topic}-dlq", "--alerts-topic", f"{topic}-alerts",
               "--group", f"crash-{unique_name}", "--shard-timeout", "600",
               "--metrics-port", str(port), "--log-level", "WARNING"]
    log = (tmp_path / "worker.log").open("a")

    def start() -> subprocess.Popen:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    sent: list[int] = []

    def produce() -> None:  # the stream, paced over ~25 s
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all",
                                 enable_idempotence=True, linger_ms=5)
        chunk, t0 = 400, time.monotonic()
        for i in range(0, len(messages), chunk):
            for value in messages[i:i + chunk]:
                producer.send(topic, key=run.run_id.encode(), value=value)
            sent.append(i + chunk)
            time.sleep(max(0.0, t0 + 25 * (i + chunk) / len(messages) - time.monotonic()))
        producer.flush()
        producer.close()

    streamer = threading.Thread(target=produce, daemon=True)
    streamer.start()
    proc = start()
    mid_stream = 0
    try:
        for kill in range(10):
            deadline = time.monotonic() + 90
            while scrape(port) is None:  # the endpoint answers once the store is restored
                assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "worker did not come up"
                time.sleep(0.05)
            if kill % 2:  # half of the kills: once this instance is consuming records
                while total(scrape(port), "gradstream_messages_total") == 0:
                    assert time.monotonic() < deadline, "worker consumed nothing"
                    time.sleep(0.05)
            time.sleep(rng.uniform(0.1, 1.5))
            consumed = total(scrape(port), "gradstream_messages_total")
            mid_stream += consumed > 0
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            print(f"kill {kill + 1}: instance had consumed {consumed:.0f} records; "
                  f"{sent[-1] if sent else 0} of {len(messages)} produced")
            proc = start()
        streamer.join(120)
        deadline = time.monotonic() + 180
        while True:  # drained: every partition read to its end, no frame waiting for ranks
            samples = scrape(port)
            lags = (samples or {}).get("gradstream_consumer_lag", [])
            if lags and all(v == 0 for _, v in lags) and total(
                    samples, "gradstream_pending_frames") == 0:
                break
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"worker did not drain the topic: {samples}"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert mid_stream >= 5, f"only {mid_stream} kills hit a consuming worker"
    lost, duplicated = compare_store(db, run)
    print(f"crash: {len(messages)} messages, 10 SIGKILLs ({mid_stream} while consuming): "
          f"lost={lost} duplicated={duplicated}")
    assert (lost, duplicated) == (0, 0)


# -- broker restart ------------------------------------------------------------------------


def test_broker_restart_mid_stream_loses_no_frame(tmp_path: Path, unique_name: str) -> None:
    """Producers (SDK) and a worker keep going while their broker is stopped and started."""
    broker = LocalBroker(tmp_path / "broker")
    bootstrap = broker.start(timeout=180)
    run = make_run(f"restart-{unique_name}", ranks=2, layers=5, steps=300, seed=3)
    settings_ = ConsumerSettings(
        bootstrap_servers=bootstrap, topic=f"restart-{unique_name}",
        dlq_topic=f"restart-dlq-{unique_name}", alerts_topic=f"restart-alerts-{unique_name}",
        group_id=f"restart-{unique_name}", db=str(tmp_path / "restart.duckdb"),
        shard_timeout_s=600.0,
    )
    worker = Worker(settings_)
    thread = threading.Thread(target=worker.run, daemon=True)
    try:
        thread.start()
        assert worker.wait_ready(90), worker.error
        steps, ranks, _ = run.shape
        names = tuple(run.run_started(0).layer_names)
        producers = [GradientProducer(run.run_id, rank=r, world_size=ranks,
                                      bootstrap_servers=bootstrap, topic=settings_.topic,
                                      queue_size=10_000, close_timeout_s=120.0)
                     for r in range(ranks)]
        for p in producers:
            p.start_run(dict(zip(names, run.numel.sum(axis=0).tolist(), strict=True)))

        def record(step_range: range) -> None:
            for step in step_range:
                for r, p in enumerate(producers):
                    p.record_summaries(step, LayerSummaries(
                        names, run.numel[r], run.sum_abs[step, r], run.sum_sq[step, r],
                        run.max_abs[step, r], run.nonfinite[step, r]))
                time.sleep(0.01)

        record(range(0, 100))
        broker.stop()
        print("broker stopped at step 100")
        record(range(100, 200))  # queued by the producers while the broker is down
        time.sleep(2)
        broker.start(timeout=180)
        print("broker started again")
        record(range(200, steps))
        for p in producers:
            assert p.finish_run(timeout=120)
            stats = p.close()
            assert stats.dropped == 0 and stats.failed == 0, stats
        assert worker.wait_for_runs([run.run_id], 180), worker.error
    finally:
        worker.stop()
        thread.join(60)
        broker.stop()
    assert worker.error is None, worker.error
    lost, duplicated = compare_store(settings_.db, run)
    print(f"broker restart: lost={lost} duplicated={duplicated}")
    assert (lost, duplicated) == (0, 0)


# -- fuzz ----------------------------------------------------------------------------------

FUZZ_RUN = make_run("fuzz-run", ranks=2, layers=3, steps=6, seed=7)
VALID_STEP = json.loads(encode_message(FUZZ_RUN.summary(0, 0)))
ARRAYS = ("layer_indices", "numel", "sum_abs", "sum_sq", "max_abs", "nonfinite")
REQUIRED = ("type", "run_id", "step", "rank", "world_size", "wall_time", "layer_indices",
            "numel", "sum_sq", "nonfinite")


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def _with(**changes: object) -> dict:
    return {**VALID_STEP, **changes}


not_json = st.one_of(
    st.binary(max_size=200),
    st.integers(1, len(encode_message(FUZZ_RUN.summary(0, 0))) - 1).map(
        lambda k: encode_message(FUZZ_RUN.summary(0, 0))[:k]),  # truncated
    st.just(None),  # a record without value
)
wrong_type = st.one_of(
    st.tuples(  # no field but run_id is a string
        st.sampled_from(REQUIRED[2:]),
        st.one_of(st.none(), st.text(alphabet="xyz", min_size=1), st.just({}), st.just([[]])),
    ),
    st.tuples(st.just("run_id"), st.one_of(st.none(), st.integers(), st.just(["r"]))),
).map(lambda kv: _dumps(_with(**{kv[0]: kv[1]})))
missing_field = st.sampled_from(REQUIRED).map(
    lambda k: _dumps({f: v for f, v in VALID_STEP.items() if f != k}))
unknown_major = st.tuples(
    st.integers(0, 99).filter(lambda m: m != 1), st.integers(0, 9),
).map(lambda v: _dumps(_with(schema_version=f"{v[0]}.{v[1]}")))
misaligned = st.tuples(st.sampled_from(ARRAYS[1:]), st.booleans()).map(
    lambda v: _dumps(_with(**{v[0]: VALID_STEP[v[0]][:-1] if v[1]
                              else VALID_STEP[v[0]] + VALID_STEP[v[0]][-1:]})))
# A sum may be +inf (a float64 sum that overflowed, as in the reference); NaN and -inf
# never are, and max |g| is finite (non-finite elements are counted, not maxed).
not_finite = st.one_of(
    st.tuples(st.sampled_from(("sum_abs", "sum_sq")), st.integers(0, 2),
              st.sampled_from((math.nan, -math.inf))),
    st.tuples(st.just("max_abs"), st.integers(0, 2),
              st.sampled_from((math.nan, math.inf, -math.inf))),
).map(lambda v: _dumps(_with(**{v[0]: [v[2] if i == v[1] else x
                                       for i, x in enumerate(VALID_STEP[v[0]])]})))
out_of_range = st.sampled_from([
    _dumps(_with(step=-1)), _dumps(_with(rank=2)), _dumps(_with(world_size=0)),
    _dumps(_with(layer_indices=[0, 0, 1])), _dumps(_with(nonfinite=[5000, 0, 0])),
    _dumps(_with(run_id="")), _dumps(_with(type="step_summary_v9")),
    _dumps(_with(sum_abs=None)),  # sum_abs without max_abs
])
unusable_for_the_run = st.sampled_from([
    _dumps(_with(run_id="never-started")),  # unknown run: no RunStarted
    _dumps(_with(world_size=3)),  # differs from the run's world size
    _dumps(_with(layer_indices=[0, 1, 7])),  # beyond the run's 3 layers
])
bad_message = st.one_of(not_json, wrong_type, missing_field, unknown_major, misaligned,
                        not_finite, out_of_range, unusable_for_the_run)
OVERSIZED = b'{"type": "step_summary", "pad": "' + b"x" * MAX_MESSAGE_BYTES + b'"}'


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(bad=st.lists(bad_message, min_size=20, max_size=60), data=st.data())
def test_fuzzed_bad_messages_go_to_the_dlq_and_valid_ones_are_stored(
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory, bad: list, data
) -> None:
    """Malformed messages interleaved with a valid run: each bad one is a dead letter with
    its reason and source offset, each valid one is stored, the worker never stops."""
    tag = os.urandom(5).hex()
    run = FUZZ_RUN
    for value in bad:  # the strategies only make unusable messages (or decoding is wrong)
        if value is not None and b"never-started" not in value and b'"world_size": 3' not in \
                value and b"[0, 1, 7]" not in value:
            with pytest.raises(WireError):
                decode_message(value)
    bad = [*bad, OVERSIZED]
    steps, ranks, _ = run.shape
    valid = [encode_message(run.run_started(r)) for r in range(ranks)]
    valid += [encode_message(run.summary(s, r)) for s in range(steps) for r in range(ranks)]
    valid += [encode_message(run.run_finished(r)) for r in range(ranks)]
    # Bad messages anywhere; the valid ones keep their order (RunStarted first).
    slots = sorted(data.draw(st.lists(st.integers(0, len(valid)), min_size=len(bad),
                                      max_size=len(bad)), label="positions"))
    stream: list[tuple[bool, bytes | None]] = []
    for i, value in enumerate(valid):
        stream += [(False, bad[j]) for j, pos in enumerate(slots) if pos == i]
        stream.append((True, value))
    stream += [(False, bad[j]) for j, pos in enumerate(slots) if pos == len(valid)]

    topic = f"fuzz-{tag}"
    settings_ = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=topic, dlq_topic=f"fuzz-dlq-{tag}",
        alerts_topic=f"fuzz-alerts-{tag}", group_id=f"fuzz-{tag}",
        db=str(tmp_path_factory.mktemp("fuzz") / "fuzz.duckdb"), shard_timeout_s=600.0,
        partitions=1,
    )
    ensure_topics(settings_, [topic])
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all",
                             max_request_size=MAX_MESSAGE_BYTES + 1024 * 1024)
    futures = [(ok, producer.send(topic, key=run.run_id.encode(), value=value))
               for ok, value in stream]
    producer.flush()
    offsets = [(ok, f.get(timeout=60).offset) for ok, f in futures]
    producer.close()
    bad_offsets = {off for ok, off in offsets if not ok}

    worker = Worker(settings_)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert worker.wait_for_runs([run.run_id], 120), worker.error
    finally:
        worker.stop()
        thread.join(60)
    assert worker.error is None

    letters = read_dead_letters(kafka_bootstrap, settings_.dlq_topic, len(bad))
    got = [int(h["source_offset"]) for h in letters]
    assert all(h["reason"] and h["error"] in {"invalid", "unknown_run"} for h in letters)
    assert all(h["source_topic"] == topic for h in letters)
    lost, duplicated = compare_store(settings_.db, run)
    missing_letters = len(bad_offsets - set(got))
    print(f"fuzz: {len(bad)} bad + {len(valid)} valid messages: dead letters "
          f"{len(got)}, lost={lost + missing_letters} duplicated={len(got) - len(set(got))}")
    assert sorted(got) == sorted(bad_offsets)
    assert (lost, duplicated) == (0, 0)
