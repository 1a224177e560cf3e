"""Default Kafka topic and consumer-group names shared by producers and consumers.

Each may be overridden by configuration (``GRADSTREAM_*`` environment variables or flags);
these are only the defaults both sides agree on when nothing is configured.
"""

DEFAULT_SUMMARIES_TOPIC = "gradstream.summaries"
"""Topic carrying RunStarted / StepSummary / RunFinished messages, keyed by run id."""

DEFAULT_DLQ_TOPIC = "gradstream.dlq"
"""Dead-letter topic: messages a worker could not use, with the reason in a header."""

DEFAULT_ALERTS_TOPIC = "gradstream.alerts"
"""Topic carrying alert events, keyed by run id."""

DEFAULT_CONSUMER_GROUP = "gradstream-workers"
"""Consumer group shared by the worker processes."""

DEFAULT_FRAMES_TOPIC = "gradstream.frames"
"""Scale-out mode: finished frames (merged sums of every rank of a step) published by the
workers, with the runs' RunStarted / RunFinished, keyed by run id; read by
``gradstream store``."""

DEFAULT_STORE_GROUP = "gradstream-store"
"""Consumer group of the store process (one member: DuckDB has one writing process)."""

DEFAULT_RUNS_TOPIC = "gradstream.runs"
"""Scale-out mode: a compacted topic holding each run's RunStarted (key = run id), read by
a worker when it is assigned partitions so it knows the runs whose steps it will see."""
