"""Where consumer loops write their batches: the :class:`consumer.outputs.base.Output`
protocol, one module per output, and :mod:`consumer.outputs.registry` naming them."""
