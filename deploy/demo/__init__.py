"""The gradstream demo's real training: a NumPy MLP on scikit-learn's digits, trained
data-parallel across N rank processes, each emitting telemetry of its local gradients.

* :mod:`deploy.demo.mlp`: the model, hand-written backprop, initialisations, the data set.
* :mod:`deploy.demo.training`: the scenarios (``healthy``, ``vanishing``, ``exploding``),
  :func:`~deploy.demo.training.run_data_parallel` and the pluggable telemetry.
* :mod:`deploy.demo.pipeline`: ``gradstream demo`` end to end (broker, worker, training,
  reports).

Importing this package is light (NumPy only); scikit-learn is imported when data is loaded and
the producer SDK inside :func:`~deploy.demo.training.kafka_telemetry`.
"""
