"""The bounded queue and its sender thread (producer.transport.sender), through the run
API with no broker reachable: training never waits, the oldest step is dropped and counted."""

from __future__ import annotations

import time

from producer import GradientProducer
from tests.producer import UNREACHABLE, grads, numel


def test_never_blocks_and_drops_oldest_when_kafka_is_unreachable() -> None:
    gp = GradientProducer("r", bootstrap_servers=UNREACHABLE, queue_size=10)
    g = grads()
    gp.start_run(numel(g))
    worst = 0.0
    for step in range(200):
        t0 = time.perf_counter()
        gp.record_step(step, g)
        worst = max(worst, time.perf_counter() - t0)
    stats = gp.stats()
    assert stats.recorded == 200
    assert stats.dropped >= 189 and stats.queued <= 11  # RunStarted is never dropped
    assert worst < 0.05
    t0 = time.perf_counter()
    final = gp.close(timeout=0.5)
    assert time.perf_counter() - t0 < 10
    assert final.sent == 0 and final.dropped == stats.dropped


def test_enqueue_timeout_bounds_the_wait() -> None:
    gp = GradientProducer("r", bootstrap_servers=UNREACHABLE, queue_size=2,
                          enqueue_timeout_s=0.2)
    gp.start_run(numel(grads()))
    for step in range(3):
        gp.record_step(step, grads())
    t0 = time.perf_counter()
    gp.record_step(3, grads())  # queue full: waits the bound, then drops the oldest
    elapsed = time.perf_counter() - t0
    assert 0.15 < elapsed < 1.0
    assert gp.stats().dropped >= 1
    gp.close(timeout=0)
