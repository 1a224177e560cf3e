"""The history at LLM scale: every read of a 100 M-row store through the notebook API and
the HTTP endpoint, with peak memory.

1. Builds a store of 1,000 layers x 100,000 steps (100 M ``layer_stats`` rows;
   ``--layers`` / ``--steps`` to change) with the project's DDL, in a child process (its
   memory is not the readers'): the rows of ``bench/analysis_scale.py``'s generator
   (:func:`analysis_scale.insert_layer_stats`: depth profile, noise, decay, vanishing
   input layers, a dead layer, three layers exploding for five steps, weight statistics),
   appended :data:`CHUNK_ROWS` rows at a time in (step, layer) order as the consumer
   appends frames, so the builder's memory stays bounded whatever the size. Each chunk's
   ``frames`` rows follow, complete as the worker writes them: the run health after each
   frame from the worker's own tracker (:class:`consumer.health_tracker.RunHealthTracker`,
   default options), the frame's flag counts, one rank seen, none missing; then the run's
   counters (``runs.health``, ``frames``, ``issue_frames``, ``last_step``), its rank's
   RunFinished (``run_ranks``, ``end_time``) and, in a tree that has them, the write-time
   frame summaries (``schemas.frame_summary.fill_frame_summaries``) and grid rollup
   (``schemas.grid_rollup.fill_rollup``).
2. Reads the whole file once (the warm-up: the page cache holds it, as it would for a
   store in use), then times each read once, end to end, first through the notebook API
   (:class:`analysis.Store` on the read-only file, in this process): ``runs()``,
   ``report()`` of the whole run and of a 1,000-step range in the middle, every
   registered analysis (:data:`analysis.registry.ANALYSES`, default options, whole run),
   ``grid()``, ``plot()`` saved as a PNG, and ``layer_stats()`` of that range for the layers
   matching :data:`SLICE_LAYERS`.
3. Then through the HTTP endpoint: ``gradstream serve --no-consume`` on the store (a child
   process, any free loopback port, the token from ``GRADSTREAM_TOKEN``), the dashboard's
   requests with its JSON answers: ``/api/runs``, ``/api/grid`` (first request: not yet in
   the server's cache), ``/api/report`` (whole run and the range), ``/api/analysis/<name>``
   for every analysis (first request each), and the same ``layer_stats`` slice as
   ``POST /api/query`` (Arrow back, decoded), as a notebook reading through the endpoint
   sends it. Each time runs from sending the request to the last byte of the answer.
4. Peak memory: the peak resident set (``ru_maxrss``) of this process
   (``resource.getrusage(RUSAGE_SELF)``, every notebook read) and of the server process
   (from ``os.wait4`` when it exits: its whole life), in GB (10^9 bytes).

Each figure is one run, the first of its kind in its process (imports included), as a user
opening a notebook or the dashboard meets it.

Usage (from the repository root)::

    python bench/history_scale.py                          # 1,000 layers x 100,000 steps
    python bench/history_scale.py --layers 1000 --steps 2000
    python bench/history_scale.py --db /tmp/h.duckdb --keep   # build once, reuse afterwards
    python bench/history_scale.py --layers 8 --steps 200      # smoke test

Targets on the 100 M-row store (2-core VM): report <= 2 s, every analysis <= 30 s, grid <=
1 s, plot <= 3 s, peak RSS <= 6 GB. The last line is ``report_s=X analysis_max_s=X grid_s=X
plot_s=X peak_rss_gb=X``: report_s the slower notebook report (whole run or range),
analysis_max_s the slowest analysis on either path, grid_s the HTTP grid's first request,
plot_s the notebook plot, peak_rss_gb the larger of the two processes' peaks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import analysis_scale  # noqa: E402
import duckdb  # noqa: E402
import pyarrow as pa  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from analysis import registry  # noqa: E402
from analysis.notebook import Store  # noqa: E402
from analysis.notebook_sql import LAYER_STATS_SQL, layer_params, step_params  # noqa: E402
from analysis.read.endpoint_codec import table_from_ipc  # noqa: E402
from analysis.read.query import ARROW_STREAM  # noqa: E402
from analysis.read.sidecar import ServeInfo, read_sidecar  # noqa: E402
from consumer.health_tracker import RunHealthTracker  # noqa: E402

RUN = "bench-history"

TARGETS_S: dict[str, float] = {"report": 2.0, "analysis": 30.0, "grid": 1.0, "plot": 3.0}
"""Seconds each kind of read may take on the 100 M-row store (the issue's targets)."""

PEAK_RSS_TARGET_GB = 6.0
"""Largest peak resident set of the notebook process or the server, GB (10^9 bytes)."""

GB = 1e9
"""Bytes in the GB of the figures."""

CHUNK_ROWS = 2_000_000
"""``layer_stats`` rows per ``INSERT`` of the builder (whole steps: ``CHUNK_ROWS // layers``
steps a chunk, at least one): each chunk is generated and sorted into (step, layer) order
in memory, about 1 GB at this size, so the builder's memory does not grow with the
history; 50 statements build the 100 M rows."""

RANGE_STEPS = 1000
"""Steps of the range report and of the ``layer_stats`` slice (the middle of the run)."""

SLICE_LAYERS = "blocks.1*"
"""fnmatch pattern of the ``layer_stats`` slice: blocks 1, 10-19, 100-199 (weights and
biases), 222 of the 1,000 layers."""

STEP_WALL_S = 1.0
"""Producer wall time between two steps of the synthetic run, seconds (``frames.wall_time
= step x STEP_WALL_S`` from the run's start time 0.0)."""

SERVER_START_S = 120.0
"""Longest wait for ``gradstream serve`` to advertise its endpoint (its sidecar)."""

SERVER_STOP_S = 30.0
"""Longest wait for the server to exit after SIGTERM before it is killed."""

WARM_UP_CHUNK = 64 << 20
"""Bytes per read of the warm-up pass over the file."""


# -- the store ------------------------------------------------------------------------------


def build_history(path: Path, layers: int, steps: int, console: Console) -> None:
    """Create the store at ``path``: ``layers`` x ``steps`` ``layer_stats`` rows, one
    ``frames`` row per step and the run's counters (see the module docstring, step 1).

    Raises:
        duckdb.Error: the schema no longer takes these rows.
    """
    for stale in (path, Path(f"{path}.wal")):
        stale.unlink(missing_ok=True)
    chunk_steps = max(1, CHUNK_ROWS // layers)
    tracker = RunHealthTracker(layers)
    con = duckdb.connect(str(path))
    try:
        con.execute("SET enable_progress_bar = false")  # the chunk lines say how far it is
        analysis_scale.create_run(con, RUN, layers)
        con.execute("SELECT setseed(0.25)")
        t0 = time.perf_counter()
        for first in range(0, steps, chunk_steps):
            stop = min(steps, first + chunk_steps)
            con.execute("BEGIN")
            analysis_scale.insert_layer_stats(con, RUN, layers, steps, first, stop,
                                              step_major=True)
            _insert_frames(con, tracker, layers, first, stop)
            con.execute("COMMIT")
            console.print(f"  steps {first:,}-{stop - 1:,}: {stop * layers:,} rows "
                          f"({time.perf_counter() - t0:.0f} s)")
        _finish_run(con, tracker, steps)
        con.execute("CHECKPOINT")
        console.print(f"built {layers * steps:,} layer_stats rows and {steps:,} frames in "
                      f"{time.perf_counter() - t0:.1f} s ({path.stat().st_size / 1e6:,.0f} MB)")
    finally:
        con.close()


def _insert_frames(con: duckdb.DuckDBPyConnection, tracker: RunHealthTracker, layers: int,
                   first: int, stop: int) -> None:
    """The ``frames`` rows of steps ``first <= step < stop`` from their stored
    ``layer_stats`` rows: each frame given to ``tracker`` in step order for the run health
    after it, as the worker's DuckDB output writes them (``consumer.outputs.duckdb``)."""
    rows = con.execute(
        "SELECT layer_index, is_vanishing, is_exploding, nonfinite FROM layer_stats "
        "WHERE run_id = $run AND step >= $first AND step < $stop ORDER BY step, layer_index",
        {"run": RUN, "first": first, "stop": stop}).fetchnumpy()
    count = stop - first
    index, vanishing, exploding, nonfinite = (
        np.asarray(rows[name]).reshape(count, layers)
        for name in ("layer_index", "is_vanishing", "is_exploding", "nonfinite"))
    health = [str(tracker.update(first + k, index[k], vanishing[k], exploding[k],
                                 nonfinite[k]))
              for k in range(count)]
    wall = np.arange(first, stop, dtype=np.float64) * STEP_WALL_S
    no_ranks = pa.array([[]] * count, pa.list_(pa.int32()))
    frames = pa.table({
        "run_id": pa.array([RUN] * count, pa.string()),
        "step": pa.array(np.arange(first, stop, dtype=np.int64)),
        "health": pa.array(health, pa.string()),
        "num_layers": pa.array(np.full(count, layers, np.int32)),
        "vanishing_layers": pa.array(vanishing.sum(axis=1).astype(np.int32)),
        "exploding_layers": pa.array(exploding.sum(axis=1).astype(np.int32)),
        "nonfinite_layers": pa.array((nonfinite > 0).sum(axis=1).astype(np.int32)),
        "complete": pa.array(np.ones(count, bool)),
        "ranks_seen": pa.array([[0]] * count, pa.list_(pa.int32())),
        "missing_ranks": no_ranks,
        "wall_time": pa.array(wall),
        "finalized_at": pa.array(wall),
        "refused_ranks": no_ranks,
        "layout_violations": pa.array(np.zeros(count, np.int32)),
    })
    con.register("hs_frames", frames)
    try:
        # BY NAME: a column the schema gains later is NULL or its default here.
        con.execute("INSERT INTO frames BY NAME SELECT * FROM hs_frames")
    finally:
        con.unregister("hs_frames")


def _finish_run(con: duckdb.DuckDBPyConnection, tracker: RunHealthTracker, steps: int) -> None:
    """The run's counters after its last frame and its one rank's RunFinished, as the
    worker stores them."""
    end = steps * STEP_WALL_S
    con.execute(
        "UPDATE runs SET health = ?, frames = ?, issue_frames = ?, last_step = ?, "
        "first_nonfinite_step = ?, end_time = ? WHERE run_id = ?",
        [str(tracker.health), tracker.frames, tracker.issue_frames, tracker.last_step,
         tracker.first_nonfinite_step, end, RUN])
    con.execute(
        "INSERT INTO run_ranks BY NAME SELECT ? AS run_id, 0 AS rank, ? AS last_step, "
        "? AS steps_recorded, 0 AS dropped, ? AS end_time",
        [RUN, steps - 1, steps, end])


def fill_summaries(path: Path, console: Console) -> None:
    """Fill the write-time frame summaries of the run, as the worker writes them, when this
    tree has :mod:`schemas.frame_summary`."""
    try:
        # Older trees lack the write-time frame summaries: their frames rows are complete
        # without them.
        from schemas.frame_summary import fill_frame_summaries
    except ImportError:
        console.print("no schemas.frame_summary in this tree: frames without summaries")
        return
    con = duckdb.connect(str(path))
    con.execute("SET enable_progress_bar = false")  # the lines below say what was done
    try:
        t0 = time.perf_counter()
        fill_frame_summaries(con, RUN)
        con.execute("CHECKPOINT")
        console.print(f"frame summaries filled in {time.perf_counter() - t0:.1f} s")
        try:  # the grid rollup the worker keeps with the rows, in trees that have it
            from schemas.grid_rollup import fill_rollup
        except ImportError:
            return
        t0 = time.perf_counter()
        fill_rollup(con, RUN)
        con.execute("CHECKPOINT")
        console.print(f"grid rollup filled in {time.perf_counter() - t0:.1f} s")
    finally:
        con.close()


def _prepare(path: str, layers: int, steps: int, build: bool) -> None:
    """Child process: build the store when ``build``, then fill its frame summaries."""
    console = Console(highlight=False)
    if build:
        build_history(Path(path), layers, steps, console)
    fill_summaries(Path(path), console)


def prepare_store(path: Path, layers: int, steps: int, build: bool) -> None:
    """:func:`_prepare` in a child process (spawned: a fresh interpreter), so that the
    builder's memory is not counted in this process's peak.

    Raises:
        RuntimeError: the child failed (its traceback is on stderr).
    """
    child = multiprocessing.get_context("spawn").Process(
        target=_prepare, args=(str(path), layers, steps, build))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"building the store failed (exit code {child.exitcode})")


def holds(path: Path, layers: int, steps: int) -> bool | None:
    """Whether ``path`` holds this bench's run at ``layers`` x ``steps``: True; another
    shape: False; not a store this bench built (no such file, not DuckDB, no run
    :data:`RUN`): None."""
    if not path.exists():
        return None
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error:
        return None
    try:
        found = con.execute(
            "SELECT (SELECT num_layers FROM runs WHERE run_id = $run), "
            "(SELECT count(*) FROM layer_stats WHERE run_id = $run), "
            "(SELECT count(*) FROM frames WHERE run_id = $run)", {"run": RUN}).fetchone()
    except duckdb.Error:
        return None
    finally:
        con.close()
    if found is None or found[0] is None:
        return None
    return tuple(found) == (layers, layers * steps, steps)


def warm_up(path: Path) -> float:
    """Read the whole file once (into the page cache); returns the seconds it took."""
    buffer = bytearray(WARM_UP_CHUNK)
    t0 = time.perf_counter()
    with path.open("rb", buffering=0) as fh:
        while fh.readinto(buffer):
            pass
    return time.perf_counter() - t0


# -- the timings ----------------------------------------------------------------------------


@dataclass
class Timing:
    """One timed read.

    Attributes:
        read: what was read (the table's first column).
        via: ``notebook`` or ``HTTP``.
        kind: the target it counts against (a key of :data:`TARGETS_S`), or "".
        seconds: wall time of the one run.
        detail: what came back (rows, bytes).
    """

    read: str
    via: str
    kind: str
    seconds: float
    detail: str = ""


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """``(seconds, result)`` of one call of ``fn``."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def notebook_reads(db: Path, steps: tuple[int, int], out: Path, timeout_s: float,
                   console: Console) -> list[Timing]:
    """Time every read through :class:`analysis.Store` (module docstring, step 2); the
    plot's PNG is written into ``out``.

    Raises:
        analysis.read.connect.StoreError: a read failed (its time limit included).
    """
    store = Store(db, timeout_s=timeout_s)
    console.print(f"notebook reads via: {store.via}")
    run = store.run(RUN)
    timings: list[Timing] = []

    def add(read: str, kind: str, fn: Callable[[], object],
            describe: Callable[[Any], str] = lambda _r: "") -> None:
        seconds, result = timed(fn)
        timings.append(Timing(read, "notebook", kind, seconds, describe(result)))

    add("runs", "", store.runs, lambda df: f"{len(df)} run")
    add("report, whole run", "report", run.report,
        lambda r: str(r.overall_health))
    add("report, step range", "report", lambda: run.report(steps=steps),
        lambda r: f"{r.frames:,} frames")
    for name in registry.ANALYSES:
        add(f"analysis {name}", "analysis", lambda name=name: run.analyze(name))
    add("grid", "grid", run.grid,
        lambda g: "{} x {} cells".format(*g.shape))
    png = out / "history_scale.png"

    def plot() -> int:
        figure = run.plot()
        figure.savefig(png)
        return png.stat().st_size

    add("plot", "plot", plot, lambda size: f"PNG {_size(size)}")
    add("layer_stats slice", "", lambda: run.layer_stats(steps=steps, layers=SLICE_LAYERS),
        lambda df: f"{len(df):,} rows")
    return timings


class Server:
    """``gradstream serve --no-consume`` on the store, in a child process.

    Args:
        db: the store file.
        timeout_s: the server's time limit of each read (``--query-timeout``).
        log: file receiving the server's stdout and stderr.

    Raises:
        RuntimeError: it exited or advertised no endpoint within :data:`SERVER_START_S`
            (the end of its log in the message).
    """

    def __init__(self, db: Path, timeout_s: float, log: Path) -> None:
        self.token = secrets.token_urlsafe(32)
        self.timeout_s = timeout_s
        self.log = log
        env = dict(os.environ, GRADSTREAM_TOKEN=self.token)
        with log.open("wb") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "deploy.cli", "serve", "--no-consume", "--db", str(db),
                 "--host", "127.0.0.1", "--port", "0", "--query-timeout", str(timeout_s)],
                cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        self.info = self._wait_ready(db)

    def _wait_ready(self, db: Path) -> ServeInfo:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            info = read_sidecar(db)
            if info is not None and info.pid == self.process.pid:
                return info
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gradstream serve did not start:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log."""
        return self.log.read_text(errors="replace")[-chars:]

    def request(self, path: str, query: dict[str, object] | None = None,
                body: dict[str, object] | None = None,
                accept: str = "application/json") -> bytes:
        """The answer of one request (GET, or POST with a JSON ``body``), read to its end.

        Raises:
            RuntimeError: not 200 (the server's error in the message).
        """
        fields = {k: str(v) for k, v in (query or {}).items() if v is not None}
        url = f"{self.info.url}{path}" + (f"?{urllib.parse.urlencode(fields)}" if fields else "")
        headers = {"Accept": accept, "Authorization": f"Bearer {self.token}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s + 30) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None

    def stop(self) -> int:
        """SIGTERM the server, wait for it (SIGKILL after :data:`SERVER_STOP_S`) and return
        its peak resident set in bytes (``ru_maxrss`` of its whole life, ``os.wait4``)."""
        if self.process.returncode is not None:
            return 0
        self.process.send_signal(signal.SIGTERM)
        killer = threading.Timer(SERVER_STOP_S, self.process.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(self.process.pid, 0)
        finally:
            killer.cancel()
        self.process.returncode = os.waitstatus_to_exitcode(status)
        return _maxrss_bytes(usage.ru_maxrss)


def http_reads(server: Server, steps: tuple[int, int]) -> list[Timing]:
    """Time the dashboard's requests (module docstring, step 3).

    Raises:
        RuntimeError: a request was not answered 200.
    """
    first, last = steps
    run = {"run": RUN}
    timings: list[Timing] = []

    def add(read: str, kind: str, fn: Callable[[], object],
            describe: Callable[[Any], str] = lambda b: _size(len(b))) -> None:
        seconds, result = timed(fn)
        timings.append(Timing(read, "HTTP", kind, seconds, describe(result)))

    add("GET /api/runs", "", lambda: server.request("/api/runs"))
    add("GET /api/grid", "grid", lambda: server.request("/api/grid", run))
    add("GET /api/report", "report", lambda: server.request("/api/report", run))
    add("GET /api/report, step range", "report",
        lambda: server.request("/api/report", {**run, "from_step": first, "to_step": last}))
    for name in registry.ANALYSES:
        add(f"GET /api/analysis/{name}", "analysis",
            lambda name=name: server.request(f"/api/analysis/{name}", run))
    params = {"run_id": RUN, **step_params(steps), **layer_params(SLICE_LAYERS)}
    add("POST /api/query, slice", "",
        lambda: table_from_ipc(server.request("/api/query", accept=ARROW_STREAM,
                                              body={"sql": LAYER_STATS_SQL, "params": params})),
        lambda t: f"{t.num_rows:,} rows")
    return timings


def _size(size: int) -> str:
    """``size`` bytes in kB or MB (10^3, 10^6 bytes)."""
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"


def _maxrss_bytes(maxrss: int) -> int:
    """``ru_maxrss`` in bytes (kibibytes on Linux, bytes on macOS, getrusage(2))."""
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def middle_range(steps: int) -> tuple[int, int]:
    """The inclusive range of :data:`RANGE_STEPS` steps (all, when fewer) in the middle of a
    run of ``steps`` steps."""
    count = min(RANGE_STEPS, steps)
    first = (steps - count) // 2
    return first, first + count - 1


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Build (or reuse) the store, time every read on both paths and print the table and
    the last line; ``argv`` as on the command line (default ``sys.argv[1:]``).

    Raises:
        SystemExit: ``--db`` names a file that is not a store this bench built.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--db", type=Path, default=None,
                        help="store file (default: a temporary file, deleted at the end)")
    parser.add_argument("--keep", action="store_true",
                        help="reuse --db if it already holds the history; keep it afterwards")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="time limit of each read, seconds (notebook and server): a "
                        "read beyond its target is measured, not cut short")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.steps < 1:
        parser.error("--layers and --steps must be >= 1")
    console = Console(highlight=False)
    rows = args.layers * args.steps
    tmp = tempfile.TemporaryDirectory(prefix="gradstream-history-bench-")
    work = Path(tmp.name)
    db = args.db if args.db is not None else work / "history.duckdb"
    console.print(f"machine: {os.cpu_count()} cores; store {db}")
    shape = holds(db, args.layers, args.steps)
    if shape is None and db.exists():
        sys.exit(f"refusing to replace {db}: it holds no run {RUN!r} (not a store this bench "
                 "built); pass another --db")
    reuse = args.keep and shape is True
    if reuse:
        console.print(f"reusing {db} ({rows:,} rows)")
    else:
        console.print(f"building {args.layers:,} layers x {args.steps:,} steps = {rows:,} rows")
    t0 = time.perf_counter()
    prepare_store(db, args.layers, args.steps, build=not reuse)
    console.print(f"store ready in {time.perf_counter() - t0:.1f} s "
                  f"({db.stat().st_size / 1e6:,.0f} MB)")

    warm_s = warm_up(db)
    console.print(f"warm-up: read the file in {warm_s:.1f} s")
    steps = middle_range(args.steps)
    timings = notebook_reads(db, steps, work, args.timeout, console)
    bench_peak = _maxrss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    server = Server(db, args.timeout, work / "serve.log")
    try:
        timings += http_reads(server, steps)
    except BaseException:
        server.stop()
        console.print(server.log_tail(), markup=False)
        raise
    server_peak = server.stop()

    table = Table(title=f"reads of {rows:,} rows ({args.layers:,} layers x {args.steps:,} "
                  "steps), one run each", title_justify="left",
                  caption=f"step range: steps {steps[0]:,}-{steps[1]:,}; slice: layers "
                  f"{SLICE_LAYERS} over the range", caption_justify="left")
    table.add_column("read", no_wrap=True)
    table.add_column("via", no_wrap=True)
    table.add_column("seconds", justify="right")
    table.add_column("target", justify="right")
    table.add_column("ok", justify="center")
    table.add_column("detail")
    for t in timings:
        target = TARGETS_S.get(t.kind)
        table.add_row(t.read, t.via, f"{t.seconds:.3f}",
                      "" if target is None else f"<= {target:g} s",
                      "" if target is None else ("yes" if t.seconds <= target else "NO"),
                      t.detail)
    for name, peak in (("peak RSS, notebook process", bench_peak),
                       ("peak RSS, server process", server_peak)):
        table.add_row(name, "", f"{peak / GB:.2f} GB", f"<= {PEAK_RSS_TARGET_GB:g} GB",
                      "yes" if peak / GB <= PEAK_RSS_TARGET_GB else "NO", "")
    console.print(table)

    def seconds(via: str, kind: str) -> list[float]:
        return [t.seconds for t in timings if t.via == via and t.kind == kind]

    report_s = max(seconds("notebook", "report"))
    analysis_max_s = max(seconds("notebook", "analysis") + seconds("HTTP", "analysis"))
    grid_s = seconds("HTTP", "grid")[0]
    plot_s = seconds("notebook", "plot")[0]
    peak_gb = max(bench_peak, server_peak) / GB
    missed = [t.read for t in timings if t.kind and t.seconds > TARGETS_S[t.kind]]
    if peak_gb > PEAK_RSS_TARGET_GB:
        missed.append("peak RSS")
    console.print("every read within its target" if not missed
                  else f"above target: {', '.join(missed)}")
    if args.keep and args.db is not None:
        console.print(f"kept {db}")
    elif args.db is not None:
        for path in (db, Path(f"{db}.wal")):
            path.unlink(missing_ok=True)
    tmp.cleanup()
    print(f"report_s={report_s:.3f} analysis_max_s={analysis_max_s:.3f} grid_s={grid_s:.3f} "
          f"plot_s={plot_s:.3f} peak_rss_gb={peak_gb:.3f}")


if __name__ == "__main__":
    main()
