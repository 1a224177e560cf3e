"""``python -m deploy.cli``: the ``gradstream`` command (how workers are started as child
processes by :mod:`consumer.supervisor`)."""

from deploy.cli import main

main()
