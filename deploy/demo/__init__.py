"""The gradstream demo's real training: a NumPy MLP on scikit-learn's digits, trained
data-parallel across N rank processes, each emitting telemetry of its local gradients.

* :mod:`deploy.demo.mlp`: the model, hand-written backprop, initialisations, the data set.
* :mod:`deploy.demo.scenarios`: the scenarios (``healthy``, ``vanishing``, ``exploding``,
  ``bad-rank``).
* :mod:`deploy.demo.telemetry`: what a rank does with its gradients (nothing, record them,
  fail, or send them with the producer SDK).
* :mod:`deploy.demo.training`: :func:`~deploy.demo.training.run_data_parallel`, the rank
  processes and the all-reduce between them.
* :mod:`deploy.demo.pipeline`: ``gradstream demo`` end to end (broker, worker, training,
  reports).

Importing this package is light (NumPy only); scikit-learn is imported when data is loaded and
the producer SDK inside :func:`~deploy.demo.telemetry.kafka_telemetry`.
"""
