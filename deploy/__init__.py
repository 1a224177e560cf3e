"""Running gradstream: the local Kafka broker (Maven-resolved, KRaft), the demo, the
``gradstream`` command dispatcher, and deployment manifests (docker-compose, Kubernetes)."""
