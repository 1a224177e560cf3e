"""gradstream consumer workers: consumer group, shard merge, GradientFrame computation,
incremental run health, dead-letter queue and the DuckDB sink."""
