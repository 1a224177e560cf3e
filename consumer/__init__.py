"""gradstream consumer: the Kafka loop (``loop``, ``checkpoint``: the commit protocol), the
summaries worker (shard merge, GradientFrame computation, incremental run health, alerts),
the scale-out store writer, the dead-letter queue, and the outputs batches go to
(``consumer.outputs``: DuckDB, the frames topic)."""
