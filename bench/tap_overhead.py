"""Step-time cost of ``GradientTap`` on a ~20 M-parameter GPT-style transformer (CPU),
against the ``torch._foreach_norm`` floor and peers, all measured in the same run.

The model is built from ``torch.nn`` (no downloads): token and position embeddings, pre-norm
causal ``TransformerEncoderLayer`` blocks, a final LayerNorm and an output head tied to the
token embedding (default d=384, 8 blocks, 16384-token vocabulary: 20.6 M parameters). Each
training step is forward, backward, an optimiser pre-hook, AdamW's step and ``zero_grad``.
The variants differ only in the pre-hook:

* ``none``: no hook (the baseline);
* ``floor``: ``torch._foreach_norm`` over every gradient (L2, one batched call) stacked and
  copied to a NumPy array: the least a gradient monitor can do (one read pass);
* ``tap``: ``GradientTap`` (sum |g|, sum g^2, max |g|, non-finite count per parameter)
  feeding a ``GradientProducer`` with its default settings that sends to a live broker
  (``--bootstrap-servers``, else ``KAFKA_BOOTSTRAP_SERVERS``, else a temporary
  :class:`deploy.broker.LocalBroker` started for the run; ``bench/live_broker.py``): its
  sender thread encodes (binary wire) and sends every step while training goes on, as in
  a real run, and competes with the training thread for the GIL and the cores;
* ``lightning``: Lightning's ``grad_norm`` utility (only if ``lightning`` or
  ``pytorch_lightning`` imports).

Variants run interleaved, ``--steps`` steps each per round, in a rotating order over
``--rounds`` rounds, after a warm-up. Reported per variant: the median step time, its
overhead over ``none`` in ms and %, and the median time spent inside the hook itself
(measured in the same steps). The ratios tap / floor are printed for both: the step-time
one is noisy on a loaded machine (it is a difference of two medians); the in-hook one is
the training-thread time each adds and is the one on the last line,
``tap_ratio_to_foreach_norm_floor=X.XX``. It also prints the producer's
``stats().training_thread_s`` per tap step, which must match the tap's in-hook time, and
what the producer delivered: step summaries recorded, messages acknowledged by the broker
(RunStarted, one per tap step, RunFinished), dropped and failed.

Usage (from the repository root)::

    python bench/tap_overhead.py                  # ~1-2 minutes on 2 cores
    python bench/tap_overhead.py --rounds 8 --steps 4 --batch 8
    python bench/tap_overhead.py --bootstrap-servers host:9092
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
from producer import GradientProducer  # noqa: E402
from producer.adapters.torch import GradientTap  # noqa: E402


class GPT(nn.Module):
    """A small decoder-only transformer: int64[B, T] tokens -> float32[B, T, vocab] logits."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        return self.head(self.ln(self.blocks(x, mask=mask, is_causal=True)))


def _lightning_grad_norm() -> Callable[[nn.Module], Any] | None:
    for module in ("lightning.pytorch.utilities", "pytorch_lightning.utilities"):
        try:
            utilities = __import__(module, fromlist=["grad_norm"])
            return lambda model: utilities.grad_norm(model, norm_type=2)
        except ImportError:
            continue
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``argv`` as on the command line, default ``sys.argv[1:]``);
    returns the exit status: 0, or 1 when the producer did not deliver every message."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--bootstrap-servers", default=None, metavar="HOST:PORT",
                        help="Kafka the producer sends to (default: KAFKA_BOOTSTRAP_SERVERS, "
                        "else a temporary local broker started for the run)")
    args = parser.parse_args(argv)
    logging.getLogger("gradstream").setLevel(logging.ERROR)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    with live_broker(args.bootstrap_servers) as bootstrap:
        return _run(args, bootstrap)


def _run(args: argparse.Namespace, bootstrap: str) -> int:
    """The benchmark of :func:`main` with the producer sending to ``bootstrap``."""

    torch.manual_seed(0)
    model = GPT(args.vocab, args.d, args.layers, max(1, args.d // 64), args.context)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    producer = GradientProducer(f"bench-tap-overhead-{uuid.uuid4().hex[:8]}",
                                bootstrap_servers=bootstrap, topic="gradstream.bench.tap")
    tap = GradientTap(model, producer)
    tap.start_run()

    def floor() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        torch.stack(torch._foreach_norm(grads)).numpy()

    hooks: dict[str, Callable[[], Any] | None] = {"none": None, "floor": floor, "tap": tap.step}
    lightning = _lightning_grad_norm()
    if lightning is not None:
        hooks["lightning"] = lambda: lightning(model)
    step_s: dict[str, list[float]] = {k: [] for k in hooks}
    hook_s: dict[str, list[float]] = {k: [] for k in hooks}

    def train_step(name: str) -> None:
        tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=gen)
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        hook = hooks[name]
        h0 = time.perf_counter()
        if hook is not None:
            hook()
        h1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s[name].append(time.perf_counter() - t0)
        hook_s[name].append(h1 - h0)

    names = list(hooks)
    for name in names:  # warm-up: allocator, numba load, thread pools
        train_step(name)
        train_step(name)
    for k in names:
        step_s[k].clear()
        hook_s[k].clear()
    before = producer.stats().training_thread_s
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            for _ in range(args.steps):
                train_step(name)
    tap_thread_s = producer.stats().training_thread_s - before
    delivered = producer.finish_run(timeout=60)
    sent = producer.close(timeout=10)

    numel = sum(p.numel() for p in params)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; model {numel / 1e6:.1f} M parameters in "
          f"{len(params)} tensors; batch {args.batch} x {args.context} tokens; "
          f"{args.rounds} rounds x {args.steps} steps per variant, interleaved")
    base = statistics.median(step_s["none"])
    print(f"{'variant':10s} {'step ms':>9s} {'overhead ms':>12s} {'overhead %':>11s} "
          f"{'in-hook ms':>11s}")
    extra: dict[str, float] = {}
    inside: dict[str, float] = {}
    for name in names:
        med = statistics.median(step_s[name])
        extra[name] = med - base
        inside[name] = statistics.median(hook_s[name])
        print(f"{name:10s} {med * 1e3:9.1f} {extra[name] * 1e3:12.2f} "
              f"{100 * extra[name] / base:10.1f}% {inside[name] * 1e3:11.2f}")
    steps_tap = len(step_s["tap"])
    print(f"producer stats().training_thread_s per tap step: "
          f"{tap_thread_s / steps_tap * 1e3:.2f} ms (mean in-hook time "
          f"{statistics.fmean(hook_s['tap']) * 1e3:.2f} ms)")
    print(f"producer -> {bootstrap}: {sent.recorded} step summaries recorded, {sent.sent} "
          f"messages acknowledged (RunStarted + steps + RunFinished), {sent.dropped} dropped, "
          f"{sent.failed} failed ({producer.settings.wire_format} wire)")
    step_ratio = extra["tap"] / extra["floor"] if extra["floor"] > 0 else math.nan
    print(f"tap / floor, step-time overhead (noisy): {step_ratio:.2f}")
    ratio = inside["tap"] / inside["floor"]
    print(f"tap_ratio_to_foreach_norm_floor={ratio:.2f}")
    if not delivered or sent.dropped or sent.failed:
        print(f"tap_overhead: the producer did not deliver every message to {bootstrap} "
              "(see the producer line above): the figures do not include the sender's "
              "full work", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
