"""Step-time cost of ``GradientTap`` on CUDA: a ~1 B-parameter GPT-style model in bfloat16,
against the ``torch._foreach_norm`` floor and ``wandb.watch``, all measured in the same run.

GPU figures have not been measured in this repository yet: the machines it was developed
on have no GPU. Only the CPU smoke mode (``--device cpu --tiny``) has been run, which
checks that the script works, not what it measures.

The model is built from ``torch.nn`` (no downloads; ``GPT`` of ``bench/tap_overhead.py``):
token and position embeddings, pre-norm causal ``TransformerEncoderLayer`` blocks, a final
LayerNorm and an output head tied to the token embedding. Default d=2048, 18 blocks, 16
heads, a 50304-token vocabulary, context 1024: 1.01 B parameters, all in bfloat16
(parameters, gradients and AdamW states; no float32 master copy). Each training step is
forward, backward, an optimiser pre-hook, AdamW's step and ``zero_grad``. The variants
differ only in what watches the gradients:

* ``none``: nothing (the baseline);
* ``floor``: ``torch._foreach_norm`` over every gradient (L2, one batched call, float32
  accumulation) stacked and copied to the host: the least a gradient monitor can do (one
  read pass, one small copy that waits for the device);
* ``tap``: ``GradientTap`` in full mode (sum |g|, sum g^2, max |g| and the NaN/Inf count
  per parameter: three batched reductions, ord 1, 2 and inf, float32 accumulation, one
  stacked device->host copy) feeding a ``GradientProducer`` with its default settings that
  sends to a live broker (``--bootstrap-servers``, else ``KAFKA_BOOTSTRAP_SERVERS``, else a
  temporary :class:`deploy.broker.LocalBroker`, which needs Java and the Kafka jars; see
  ``bench/live_broker.py``): its sender thread encodes and sends every step while training
  goes on, as in a real run;
* ``tap-norms``: the same in the producer's norms mode (sum g^2 and the NaN/Inf count:
  one batched reduction, the floor's work plus the tap's bookkeeping);
* ``wandb``: ``wandb.watch(model, log="gradients", log_freq=1)`` with ``wandb.init(mode=
  "offline")`` and one ``wandb.log`` per step (only if ``wandb`` imports; otherwise the
  script says it is not installed). Its hooks run inside ``backward``, so its cost shows
  in the step time only; the watch is removed (``wandb.unwatch``) between its slots.

Timing: CUDA events around the whole step and around the hook, recorded on the training
stream (the hook's interval includes any time the stream sits idle while the host waits);
the host's wall time in the hook is printed too. Variants run interleaved, ``--steps``
steps each per round, in a rotating order over ``--rounds`` rounds, after a warm-up.
Printed per variant: median step time, overhead over ``none`` (ms and % of the step) and
the median time in the hook; then ``tap`` / ``floor`` on the in-hook time. The last line is
``gpu_tap_overhead_pct=X.XX tap_ratio_to_foreach_norm_floor=X.XX`` (the ``tap`` variant's
step-time overhead in % of the ``none`` step, and its in-hook time over the floor's); the
line before it says what each producer delivered (exit status 1 when a message was
dropped or failed).

Without CUDA the script exits with status 2 and says so, unless run as the CPU smoke test
``--device cpu --tiny`` (a tiny model; the tap runs its accelerator code path on the CPU,
``emulate_device=True``; wall-clock timing).

Usage (from the repository root)::

    python bench/gpu_overhead.py                        # one CUDA GPU, ~80 GB
    python bench/gpu_overhead.py --batch 4 --rounds 4   # less memory, shorter
    python bench/gpu_overhead.py --device cpu --tiny    # smoke test of the script, no GPU
    python bench/gpu_overhead.py --bootstrap-servers host:9092
"""

from __future__ import annotations

import argparse
import logging
import math
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.live_broker import live_broker  # noqa: E402
from bench.tap_overhead import GPT  # noqa: E402
from producer import GradientProducer  # noqa: E402
from producer.adapters.torch import GradientTap  # noqa: E402

#: The ``--tiny`` model: (d, blocks, vocabulary, context, batch); it runs 2 rounds of 1 step.
TINY = (64, 2, 512, 16, 2)


class StepClock:
    """Marks on the training stream: CUDA events on a GPU, ``time.perf_counter`` elsewhere.

    ``mark()`` returns a handle; ``ms(a, b)`` the milliseconds between two handles, after
    ``settle()`` (which waits for the device on CUDA).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        """A point on the stream: a recorded ``torch.cuda.Event`` or a perf_counter time."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def settle(self) -> None:
        """Wait until every mark so far has been reached (CUDA: synchronise the device)."""
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end`` (both from :meth:`mark`)."""
        if self.cuda:
            return float(start.elapsed_time(end))
        return (end - start) * 1e3


def _wandb_variant(model: nn.Module) -> tuple[Callable[[], None], Callable[[], None],
                                               Callable[[int], None]] | None:
    """(watch, unwatch, log) callables for ``wandb.watch`` in offline mode, or None when
    wandb does not import."""
    try:
        import wandb
    except ImportError:
        return None
    run = wandb.init(project="gradstream-bench", mode="offline", reinit=True)

    def watch() -> None:
        wandb.watch(model, log="gradients", log_freq=1)

    def unwatch() -> None:
        wandb.unwatch(model)

    def log(step: int) -> None:
        run.log({"bench_step": step})

    return watch, unwatch, log


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (2 when CUDA is missing, 1 when a producer
    did not deliver every message)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model (with --device cpu: smoke test of the script)")
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--bootstrap-servers", default=None, metavar="HOST:PORT",
                        help="Kafka the producers send to (default: KAFKA_BOOTSTRAP_SERVERS, "
                        "else a temporary local broker started for the run)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_overhead: CUDA is not available, nothing measured (this benchmark needs "
              "a CUDA GPU; `--device cpu --tiny` only smoke-tests the script)")
        return 2
    if args.device == "cpu" and not args.tiny:
        print("gpu_overhead: --device cpu runs only with --tiny (a smoke test of the script)")
        return 2
    if args.tiny:
        args.d, args.layers, args.vocab, args.context, args.batch = TINY
        args.heads, args.rounds, args.steps = 2, 2, 1
        if args.device == "cpu":
            torch.set_num_threads(1)  # a smoke test: no wait for a second busy core
    logging.getLogger("gradstream").setLevel(logging.ERROR)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    with live_broker(args.bootstrap_servers) as bootstrap:
        return _run(args, bootstrap)


def _run(args: argparse.Namespace, bootstrap: str) -> int:
    """The measurement of :func:`main` (arguments checked) with the producers sending to
    ``bootstrap``."""
    device = torch.device(args.device)
    dtype = torch.bfloat16

    torch.manual_seed(0)
    model = GPT(args.vocab, args.d, args.layers, args.heads, args.context).to(device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator(device=device).manual_seed(1)
    emulate = device.type == "cpu"
    run = f"bench-gpu-overhead-{uuid.uuid4().hex[:8]}"
    full = GradientProducer(run, bootstrap_servers=bootstrap, topic="gradstream.bench.tap")
    norms = GradientProducer(f"{run}-norms", bootstrap_servers=bootstrap,
                             topic="gradstream.bench.tap", mode="norms")
    tap = GradientTap(model, full, emulate_device=emulate)
    tap_norms = GradientTap(model, norms, emulate_device=emulate)
    tap.start_run()
    tap_norms.start_run()

    def floor() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        torch.stack(torch._foreach_norm(grads)).cpu()

    hooks: dict[str, Callable[[], Any] | None] = {
        "none": None, "floor": floor, "tap": tap.step, "tap-norms": tap_norms.step,
    }
    wandb_hooks = _wandb_variant(model)
    if wandb_hooks is None:
        print("# wandb is not installed: the wandb.watch variant is left out")
    else:
        hooks["wandb"] = None
    clock = StepClock(device)
    step_ms: dict[str, list[float]] = {k: [] for k in hooks}
    hook_ms: dict[str, list[float]] = {k: [] for k in hooks}
    host_ms: dict[str, list[float]] = {k: [] for k in hooks}

    def train_step(name: str) -> None:
        tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=gen,
                               device=device)
        start = clock.mark()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                           tokens[:, 1:].flatten())
        loss.backward()
        hook = hooks[name]
        h0 = clock.mark()
        w0 = time.perf_counter()
        if hook is not None:
            hook()
        w1 = time.perf_counter()
        h1 = clock.mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if name == "wandb" and wandb_hooks is not None:
            wandb_hooks[2](len(step_ms[name]))  # commits the histograms of this step
        end = clock.mark()
        clock.settle()
        step_ms[name].append(clock.ms(start, end))
        hook_ms[name].append(clock.ms(h0, h1))
        host_ms[name].append((w1 - w0) * 1e3)

    def run_slot(name: str, steps: int) -> None:
        if name == "wandb" and wandb_hooks is not None:
            wandb_hooks[0]()
        try:
            for _ in range(steps):
                train_step(name)
        finally:
            if name == "wandb" and wandb_hooks is not None:
                wandb_hooks[1]()

    names = list(hooks)
    for name in names:  # warm-up: allocator, kernels, cuBLAS/cuDNN heuristics
        run_slot(name, 1 if args.tiny else 2)
    for k in names:
        step_ms[k].clear()
        hook_ms[k].clear()
        host_ms[k].clear()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            run_slot(name, args.steps)
    delivered = {name: (p.finish_run(timeout=60), p.close(timeout=10))
                 for name, p in (("tap", full), ("tap-norms", norms))}

    numel = sum(p.numel() for p in params)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU smoke test ({platform.machine()}), wall-clock timing")
    print(f"# {where}, torch {torch.__version__}; model {numel / 1e6:.1f} M parameters in "
          f"{len(params)} tensors, {dtype}; batch {args.batch} x {args.context} tokens; "
          f"{args.rounds} rounds x {args.steps} steps per variant, interleaved")
    base = statistics.median(step_ms["none"])
    print(f"{'variant':10s} {'step ms':>9s} {'overhead ms':>12s} {'overhead %':>11s} "
          f"{'in-hook ms':>11s} {'host ms':>8s}")
    extra: dict[str, float] = {}
    inside: dict[str, float] = {}
    for name in names:
        med = statistics.median(step_ms[name])
        extra[name] = med - base
        inside[name] = statistics.median(hook_ms[name])
        print(f"{name:10s} {med:9.2f} {extra[name]:12.3f} {100 * extra[name] / base:10.2f}% "
              f"{inside[name]:11.3f} {statistics.median(host_ms[name]):8.3f}")
    ratio = inside["tap"] / inside["floor"] if inside["floor"] > 0 else math.nan
    norms_ratio = inside["tap-norms"] / inside["floor"] if inside["floor"] > 0 else math.nan
    print(f"tap-norms / floor, in-hook time: {norms_ratio:.2f}")
    print(f"producers -> {bootstrap}: " + "; ".join(
        f"{name}: {st.recorded} step summaries recorded, {st.sent} messages acknowledged, "
        f"{st.dropped} dropped, {st.failed} failed" for name, (_, st) in delivered.items()))
    print(f"gpu_tap_overhead_pct={100 * extra['tap'] / base:.2f} "
          f"tap_ratio_to_foreach_norm_floor={ratio:.2f}")
    if not all(ok and not st.dropped and not st.failed for ok, st in delivered.values()):
        print(f"gpu_overhead: a producer did not deliver every message to {bootstrap}: the "
              "figures do not include the sender's full work", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
