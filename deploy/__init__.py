"""Running gradstream: the local Kafka broker (locked jars from Maven Central, KRaft), the demo, the
``gradstream`` command dispatcher, and deployment manifests (docker-compose, Kubernetes)."""
