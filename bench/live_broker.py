"""A live Kafka broker for the benchmarks that send through the producer SDK.

The SDK's sender thread encodes and sends every queued message while the training thread
runs; against an unreachable address it never gets that far (it retries the connection
and its bounded queue drops), so a benchmark of the training-thread cost must point the
producer at a broker that answers. :func:`live_broker` gives one: the address passed in
(``--bootstrap-servers``), else ``KAFKA_BOOTSTRAP_SERVERS``, else a temporary
:class:`deploy.broker.LocalBroker` started here (Kafka from Maven Central, cached in
``~/.cache/gradstream``; needs Java) and stopped when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LOCAL_BROKER_TIMEOUT_S = 180.0
"""Seconds a temporary local broker may take to start (a cold JVM on a loaded 2-core VM)."""


@contextlib.contextmanager
def live_broker(bootstrap: str | None = None) -> Iterator[str]:
    """Yield the ``host:port`` bootstrap address of a running Kafka broker.

    Args:
        bootstrap: an existing cluster's bootstrap address; ``None`` or empty falls back
            to ``KAFKA_BOOTSTRAP_SERVERS``, then to a temporary local broker.

    Raises:
        deploy.broker.BrokerError: the local broker could not start (its message says why:
            no Java, the Kafka jars not fetched, a port in use).
    """
    address = (bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "")).strip()
    if address:
        yield address
        return
    from deploy.broker import LocalBroker

    with tempfile.TemporaryDirectory(prefix="gradstream-bench-broker-") as tmp:
        broker = LocalBroker(Path(tmp) / "broker")
        try:
            yield broker.start(timeout=LOCAL_BROKER_TIMEOUT_S)
        finally:
            broker.stop()
