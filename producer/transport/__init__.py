"""The producer's way to Kafka, apart from the run API (:mod:`producer.client`).

- :mod:`producer.transport.sender`: the bounded queue, its drop policy and the daemon
  sender thread, with the delivery counters;
- :mod:`producer.transport.kafka`: creating the kafka-python client and reading the
  cluster's record size limit;
- :mod:`producer.transport.encoding`: a recorded step as a ``StepSummary`` message and a
  message as record values below the size limit.
"""
