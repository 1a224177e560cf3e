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
