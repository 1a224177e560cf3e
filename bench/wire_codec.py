"""The binary wire container read and written by ``schemas.wire`` against the ``safetensors``
library, side by side in one run.

A binary message (``schemas.wire.encode_binary``) is a safetensors container behind a
4-byte prefix. This script times, for StepSummary messages of ``--layers`` layers (each
size a separate case):

* decode: ``schemas.wire.read_binary_container`` (scalars and zero-copy array views) against
  ``safetensors.numpy.load`` of the same bytes plus the JSON parse of the header that the
  library leaves to the caller (the gradstream scalars travel in ``__metadata__``);
* encode: ``schemas.wire.encode_binary`` against ``safetensors.numpy.save`` of the same
  arrays and metadata (the arrays already built, which favours the library).

Each case prints the median times in µs and ``decode_ratio_library_to_ours`` /
``encode_ratio_library_to_ours`` (> 1: the library is slower). The last line is
``decode_ratio_library_to_ours=X.XX`` for the largest case.

Usage (from the repository root)::

    python bench/wire_codec.py                        # 100, 1000 and 100000 layers
    python bench/wire_codec.py --layers 10 --repeats 3  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import safetensors.numpy as st  # noqa: E402

from schemas import wire  # noqa: E402
from schemas.wire import StepSummary, encode_binary, read_binary_container  # noqa: E402


def step_summary(layers: int, seed: int = 0) -> StepSummary:
    """A full-mode StepSummary of ``layers`` layers with random sums."""
    rng = np.random.default_rng(seed)
    return StepSummary(
        run_id="bench", step=1, rank=0, world_size=1, wall_time=1.0,
        layer_indices=list(range(layers)), numel=[4096] * layers,
        sum_abs=rng.random(layers).tolist(), sum_sq=rng.random(layers).tolist(),
        max_abs=rng.random(layers).tolist(), nonfinite=[0] * layers,
    )


def library_decode(raw: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """What ``read_binary_container`` returns, through ``safetensors.numpy.load``."""
    body = raw[4:]
    size = int.from_bytes(body[:8], "little")
    header = json.loads(body[8:8 + size])
    return json.loads(header["__metadata__"]["gradstream"]), st.load(body)


def library_encode(arrays: dict[str, np.ndarray], scalars: dict[str, Any]) -> bytes:
    """A binary message through ``safetensors.numpy.save``."""
    meta = {"gradstream": json.dumps(scalars, separators=(",", ":"))}
    return wire.BINARY_MAGIC + wire.BINARY_LAYOUT_SAFETENSORS + st.save(arrays, metadata=meta)


def median_us(call: Callable[[], object], repeats: int, inner: int) -> float:
    """Median over ``repeats`` rounds of the mean time of ``inner`` calls, in µs."""
    call()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            call()
        rounds.append((time.perf_counter() - start) / inner)
    return statistics.median(rounds) * 1e6


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[100, 1000, 100_000])
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per case")
    args = parser.parse_args(argv)
    ratio = float("nan")
    for layers in args.layers:
        message = step_summary(layers)
        raw = encode_binary(message)
        scalars, arrays = read_binary_container(raw)
        got_scalars, got_arrays = library_decode(raw)
        assert got_scalars == scalars and all(
            np.array_equal(got_arrays[k], v) for k, v in arrays.items())
        owned = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        inner = max(1, 20_000 // layers)
        ours = median_us(lambda raw=raw: read_binary_container(raw), args.repeats, inner)
        lib = median_us(lambda raw=raw: library_decode(raw), args.repeats, inner)
        enc_ours = median_us(lambda m=message: encode_binary(m), args.repeats, inner)
        enc_lib = median_us(lambda a=owned, s=scalars: library_encode(a, s), args.repeats,
                            inner)
        ratio = lib / ours
        print(f"layers={layers} bytes={len(raw)} decode_ours_us={ours:.1f} "
              f"decode_library_us={lib:.1f} encode_ours_us={enc_ours:.1f} "
              f"encode_library_us={enc_lib:.1f} decode_ratio_library_to_ours={ratio:.2f} "
              f"encode_ratio_library_to_ours={enc_lib / enc_ours:.2f}")
    print(f"decode_ratio_library_to_ours={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
