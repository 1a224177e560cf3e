"""Training-thread cost of the producer SDK, against the physical floor on this machine.

For each case it prints, measured in the same run and interleaved (best of ``--repeats``):

* floor: ``np.add.reduce`` over every layer, the cost of one read pass (measured in
  the same run); NumPy's reduce runs on one thread;
* ``summarize()``: gradstream's per-layer statistics (numel, sum|g|, sum g^2, max|g|,
  nonfinite), with its ratio to the floor;
* the reference way: trustformers-debug's helpers (``mean_abs``, ``max_abs``, ``l2_norm`` over
  ``&[f64]``) done as three separate float64 NumPy reductions after a float64 copy;
* the extra cost of the exponent histogram (``summarize(histogram=True)`` minus
  ``summarize()``);
* norms mode (``summarize(norms_only=True)``) and the size of one rank's StepSummary per
  step in full and norms mode, as the producer sends it (its default wire format, binary,
  :func:`schemas.wire.encode_binary`) and as JSON (``GRADSTREAM_WIRE_FORMAT=json``), each
  labelled with its format;
* the weight summaries (``producer.weights.summarize_weights``: power sums S1..S4,
  extremes, non-finite count, exponent histogram of |w|; one fused numba pass per layer),
  measured on weights of the same sizes as the gradients (setting ``weight_stats``): the
  default configuration, with the update norm against the kept float32 copy and the copy
  refreshed in the same pass (``refresh=True``); the same with the copy refreshed by a
  separate ``astype(np.float32)`` per layer afterwards; the update norm without any
  refresh; no update norm; and a NaN in every layer;
* the update floor, the memory floor of the default weight configuration: whatever the
  arithmetic, a pass that computes the update norm and refreshes the copy must read every
  weight (n x 4 bytes for float32), read the kept copy (n x 4) and write the copy back
  (n x 4; the lines were just read, so the write needs no extra read-for-ownership).
  Measured in the same run as ``np.maximum(w, c, out=c)`` per layer, one NumPy pass on one
  thread that moves exactly those bytes (2 reads + 1 in-place write) with negligible
  arithmetic, on a scratch copy ``c``. The weight rows show their ratio to both floors;
  the rows with the update norm are judged against the update floor;
* ``summarize()`` when every layer holds a NaN (the block holding it is redone masked
  while in L1: no second read of the layer), and with the pure-NumPy fallback backend;
* ``GradientProducer.record_step`` (summary + enqueue) with the producer pointed at an
  unreachable broker (127.0.0.1:9): the sender thread cannot connect, the bounded queue
  drops, and the training thread must not notice.

It also reports the one-off first-call cost (import, numba JIT into an empty cache, load
from a warm cache), measured in fresh subprocesses and excluded from the timings above.

Clock: the summary rows (everything but ``record_step``) are timed by default on the CPU
time of the calling thread (``--clock thread``, ``time.thread_time``), which leaves out the
time the thread waits preempted by other processes on a shared machine; every kernel and
the NumPy floors run on that one thread, so the ratios compare like with like. One
exception: the NumPy fallback's ``np.dot`` may run on BLAS threads, whose time this clock
does not see. ``--clock wall`` times them on ``time.perf_counter``.

Usage (from the repository root)::

    python bench/producer_overhead.py            # (a) 100 x 500k, (b) 1000 x 4k float32
    python bench/producer_overhead.py --quick    # smaller arrays, fewer repeats
    python bench/producer_overhead.py --case-a 4x1000 --case-b 1000x16 --repeats 1  # smoke
    python bench/producer_overhead.py --clock wall

Each case ends with a ``ratios:`` line: ``weight_stats_to_floor`` (the weight statistics
alone: power sums, extremes, zeros, non-finite count, exponent histogram; against the read
floor), ``weights_to_floor`` and ``weights_to_update_floor`` (the default configuration,
with the update norm and the refresh, against both floors) and ``nan_to_floor``.
The last line is ``summary_ratio_to_floor=X.XX`` for case (a).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from producer import GradientProducer  # noqa: E402
from producer import backend as producer_backend  # noqa: E402
from producer.settings import ProducerSettings  # noqa: E402
from producer.summary import summarize  # noqa: E402
from producer.weights import summarize_weights  # noqa: E402
from schemas.wire import StepSummary, WireFormat, encode_message  # noqa: E402

SENT_FORMAT: WireFormat = ProducerSettings.model_fields["wire_format"].default
"""The wire format the producer sends by default (``GRADSTREAM_WIRE_FORMAT`` unset)."""

_PROBE = r"""
import sys, time
t0 = time.perf_counter()
import producer
t1 = time.perf_counter()
light = "numba" not in sys.modules
import numpy as np
from producer.backend import active_backend
from producer.summary import summarize
g = {"w": np.ones(1000, np.float32)}
summarize(g)
t2 = time.perf_counter()
summarize(g, histogram=True)
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, int(light), active_backend())
"""


def _first_call_probe(cache_dir: str) -> tuple[float, float, float, bool, str]:
    """(import producer s, first summarize s, first histogram s, numba-free import, backend)
    in a fresh interpreter whose numba cache is ``cache_dir``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
        check=True, timeout=600,
    ).stdout.split()
    return float(out[0]), float(out[1]), float(out[2]), out[3] == "1", out[4]


def _floor(arrays: list[np.ndarray]) -> None:
    for x in arrays:
        np.add.reduce(x)


def _update_floor(arrays: list[np.ndarray], copies: list[np.ndarray]) -> None:
    # Reads both arrays and writes the copy in place: the bytes of stats + update + refresh.
    for x, c in zip(arrays, copies, strict=True):
        np.maximum(x, c, out=c)


def _weights_copy_after(
    weights: dict[str, np.ndarray], previous: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    # The update norm, then a new float32 copy of every layer (a second pass + allocation).
    summarize_weights(weights, previous)
    return {n: w.astype(np.float32, copy=True) for n, w in weights.items()}


def _reference_way(arrays: list[np.ndarray]) -> None:
    # The reference helpers mean_abs / max_abs / l2_norm, each a separate pass over &[f64].
    for x in arrays:
        v = x.astype(np.float64).ravel()
        _mean_abs = np.abs(v).sum() / v.size
        _max_abs = np.abs(v).max()
        _l2 = math.sqrt(np.square(v).sum())


def _summarize_numpy_backend(grads: dict[str, np.ndarray]) -> None:
    producer_backend.set_backend("numpy")
    try:
        summarize(grads)
    finally:
        producer_backend.set_backend(None)  # back to the default (environment / auto)


#: Clocks of the summary rows: ``thread`` = CPU time of the calling (training) thread,
#: ``time.thread_time`` (CLOCK_THREAD_CPUTIME_ID): it leaves out the time the thread sits
#: preempted while other processes use the shared cores, which wall time counts; ``wall`` =
#: ``time.perf_counter``.
CLOCKS: dict[str, Callable[[], float]] = {"thread": time.thread_time, "wall": time.perf_counter}


def _bench(
    fns: Mapping[str, Callable[[], object]], repeats: int, clock: Callable[[], float],
) -> dict[str, float]:
    """Best time (s, on ``clock``) of each function over ``repeats`` interleaved rounds."""
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            best[name] = min(best[name], clock() - t0)
    return best


def _record_step_times(
    grads: dict[str, np.ndarray], repeats: int, gap_s: float
) -> dict[str, tuple[float, float]]:
    """Seconds per ``record_step`` against an unreachable broker, as (best, median).

    Keys: ``"back_to_back"`` (calls in a row: worst case for contention with the sender
    thread) and ``"gap"`` (``gap_s`` of GIL-free sleep between calls, standing in for the
    training step's compute).
    """
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    logging.getLogger("gradstream").setLevel(logging.CRITICAL)
    producer = GradientProducer(
        "bench-producer-overhead",
        bootstrap_servers="127.0.0.1:9",
        topic="gradstream.bench",
        queue_size=4,
    )
    result: dict[str, tuple[float, float]] = {}
    step = 0
    try:
        producer.start_run({name: g.size for name, g in grads.items()})
        producer.record_step(step, grads)  # warm-up
        for mode, gap in (("back_to_back", 0.0), ("gap", gap_s)):
            times = []
            for _ in range(repeats):
                step += 1
                if gap:
                    time.sleep(gap)
                t0 = time.perf_counter()
                producer.record_step(step, grads)
                times.append(time.perf_counter() - t0)
            times.sort()
            result[mode] = (times[0], times[len(times) // 2])
    finally:
        producer.close(timeout=0)
    return result


def message_bytes(
    grads: dict[str, np.ndarray], wire_format: WireFormat, run_id: str = "bench", step: int = 1,
) -> tuple[int, int]:
    """Size (bytes) of one rank's StepSummary of ``grads`` encoded in ``wire_format``, in
    full and norms mode: the fields ``GradientProducer`` fills for a step without the
    optional statistics (histograms, weights, shard layout, local view), from
    ``summarize(grads)`` and ``summarize(grads, norms_only=True)``. The record value Kafka
    stores for that step has this size (``tests/bench/test_producer_overhead.py`` checks it
    against the records a producer sends)."""
    sizes = []
    for norms_only in (False, True):
        s = summarize(grads, norms_only=norms_only)
        sizes.append(len(encode_message(StepSummary(
            run_id=run_id, step=step, rank=0, world_size=1, wall_time=time.time(),
            layer_indices=list(range(len(s))), numel=s.numel.tolist(),
            sum_abs=None if s.sum_abs is None else s.sum_abs.tolist(), sum_sq=s.sum_sq.tolist(),
            max_abs=None if s.max_abs is None else s.max_abs.tolist(),
            nonfinite=s.nonfinite.tolist(),
        ), wire_format)))
    return sizes[0], sizes[1]


def _case(label: str, layers: int, numel: int, repeats: int, clock: str) -> float:
    rng = np.random.default_rng(12345)
    grads = {
        f"layer{i:04d}.weight": (rng.standard_normal(numel, dtype=np.float32) * 1e-3)
        for i in range(layers)
    }
    arrays = list(grads.values())
    nan_grads = {name: g.copy() for name, g in grads.items()}
    for g in nan_grads.values():
        g[len(g) // 2] = np.nan
    weights = {name: g * 1e3 + 0.5 for name, g in grads.items()}
    previous = {name: w.copy() for name, w in weights.items()}
    kept = {name: w.copy() for name, w in weights.items()}  # refreshed in place each call
    nan_weights = {name: w.copy() for name, w in weights.items()}
    for w in nan_weights.values():
        w[len(w) // 2] = np.nan
    scratch = [w.copy() for w in weights.values()]
    # Warm-up (JIT/cache load and page faults excluded from the timings).
    summarize_weights(weights, previous)
    summarize_weights(weights, kept, refresh=True)
    _update_floor(list(weights.values()), scratch)
    summarize(grads)
    summarize(grads, histogram=True)
    summarize(nan_grads)
    _floor(arrays)
    _reference_way(arrays[:2])

    best = _bench(
        {
            "floor": lambda: _floor(arrays),
            "summary": lambda: summarize(grads),
            "reference": lambda: _reference_way(arrays),
            "hist": lambda: summarize(grads, histogram=True),
            "nan": lambda: summarize(nan_grads),
            "norms": lambda: summarize(grads, norms_only=True),
            "update_floor": lambda: _update_floor(list(weights.values()), scratch),
            "weights": lambda: summarize_weights(weights, kept, refresh=True),
            "weights_copy_after": lambda: _weights_copy_after(weights, previous),
            "weights_no_refresh": lambda: summarize_weights(weights, previous),
            "weights_only": lambda: summarize_weights(weights),
            "weights_nan": lambda: summarize_weights(nan_weights),
            "numpy": lambda: _summarize_numpy_backend(grads),
        },
        repeats,
        CLOCKS[clock],
    )
    rs = _record_step_times(grads, max(repeats, 9), gap_s=0.005)
    floor = best["floor"]
    ufloor = best["update_floor"]
    mb = layers * numel * 4 / 1e6
    print(f"\ncase ({label}): {layers} layers x {numel} float32 ({mb:.1f} MB), "
          f"best of {repeats}, {clock} clock (record_step rows: wall clock)")
    print(f"  {'what':<52} {'ms':>9} {'x floor':>8} {'x upd fl':>8}")
    weight_rows = [
        ("update floor: np.maximum(w, c, out=c), 2 rd + 1 wr", ufloor),
        ("weight statistics + update norm + refresh (default)", best["weights"]),
        ("  + update norm, then astype(float32) copy per layer", best["weights_copy_after"]),
        ("  + update norm, copy not refreshed", best["weights_no_refresh"]),
        ("  weight statistics without the update norm", best["weights_only"]),
        ("  weight statistics, a NaN in every layer", best["weights_nan"]),
    ]
    rows = [
        ("floor: np.add.reduce per layer (1 thread)", floor),
        ("summarize() [numel,sum_abs,sum_sq,max_abs,nonfinite]", best["summary"]),
        ("reference: f64 copy + mean_abs, max_abs, l2 passes", best["reference"]),
        ("summarize(histogram=True)", best["hist"]),
        ("  histogram extra cost (hist - summary)", best["hist"] - best["summary"]),
        ("summarize(norms_only=True) (norms mode)", best["norms"]),
        ("summarize(), a NaN in every layer (skipped inline)", best["nan"]),
        ("summarize(), pure-NumPy fallback backend", best["numpy"]),
        ("record_step, no broker, back-to-back: best", rs["back_to_back"][0]),
        ("record_step, no broker, back-to-back: median", rs["back_to_back"][1]),
        ("record_step, no broker, 5 ms between steps: best", rs["gap"][0]),
        ("record_step, no broker, 5 ms between steps: median", rs["gap"][1]),
    ]
    for what, seconds in rows:
        print(f"  {what:<52} {seconds * 1e3:9.3f} {seconds / floor:8.2f}")
    for what, seconds in weight_rows:
        print(f"  {what:<52} {seconds * 1e3:9.3f} {seconds / floor:8.2f} "
              f"{seconds / ufloor:8.2f}")
    other: WireFormat = "json" if SENT_FORMAT == "binary" else "binary"
    for wire_format in (SENT_FORMAT, other):
        full_bytes, norms_bytes = message_bytes(grads, wire_format)
        what = ("as sent: the producer's default" if wire_format == SENT_FORMAT
                else f"GRADSTREAM_WIRE_FORMAT={wire_format}")
        print(f"  StepSummary in the {wire_format} wire format ({what}): full mode "
              f"{full_bytes} B, norms mode {norms_bytes} B (norms/full "
              f"{norms_bytes / full_bytes:.2f})")
    gbps = layers * numel * 4 / best["summary"] / 1e9
    print(f"  summarize() reads {gbps:.1f} GB/s; floor {layers * numel * 4 / floor / 1e9:.1f} GB/s")
    print(f"  ratios: weight_stats_to_floor={best['weights_only'] / floor:.2f} "
          f"weights_to_floor={best['weights'] / floor:.2f} "
          f"weights_to_update_floor={best['weights'] / ufloor:.2f} "
          f"nan_to_floor={best['nan'] / floor:.2f}")
    return best["summary"] / floor


def _shape(text: str) -> tuple[int, int]:
    """``"LAYERSxNUMEL"`` -> (layers, numel), both >= 1 (argparse type)."""
    try:
        layers, numel = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected LAYERSxNUMEL, e.g. 100x500000") from None
    if layers < 1 or numel < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: layers and numel must be >= 1")
    return layers, numel


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller arrays, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per case")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                        help="clock of the summary rows (default: calling thread's CPU time)")
    parser.add_argument("--case-a", type=_shape, default=None, metavar="LAYERSxNUMEL",
                        help="case (a) size (default 100x500000; --quick 20x100000)")
    parser.add_argument("--case-b", type=_shape, default=None, metavar="LAYERSxNUMEL",
                        help="case (b) size (default 1000x4096; --quick 200x4096)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 11)
    case_a = args.case_a or ((20, 100_000) if args.quick else (100, 500_000))
    case_b = args.case_b or ((200, 4_096) if args.quick else (1000, 4_096))

    try:
        import numba

        numba_version = numba.__version__
    except ImportError:
        numba_version = "not installed"
    backend = producer_backend.active_backend()
    print("gradstream producer overhead benchmark")
    print(f"  python {platform.python_version()}, numpy {np.__version__}, numba {numba_version}, "
          f"{os.cpu_count()} cores; summary backend: {backend}")
    print("  threads: summarize() runs on the calling (training) thread only, 1 thread; "
          "the floor np.add.reduce is 1 thread too")

    with tempfile.TemporaryDirectory(prefix="gradstream-numba-cache-") as cache:
        imp, cold, cold_hist, light, probe_backend = _first_call_probe(cache)
        _, warm, warm_hist, _, _ = _first_call_probe(cache)
    print(f"  import producer: {imp * 1e3:.0f} ms "
          f"({'numba not imported' if light else 'numba imported!'})")
    if probe_backend == "numba":
        print(f"  first summarize(), empty numba cache (import numba + JIT float32): "
              f"{cold:.2f} s; + histogram kernel: {cold_hist:.2f} s")
        print(f"  first summarize(), warm numba cache (import numba + load): "
              f"{warm:.2f} s; + histogram kernel: {warm_hist:.2f} s")
    else:
        print(f"  first summarize() (NumPy backend, no JIT): {cold * 1e3:.1f} ms")

    ratio_a = _case("a", *case_a, repeats, args.clock)
    _case("b", *case_b, repeats, args.clock)
    print(f"\nsummary_ratio_to_floor={ratio_a:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
