"""The ``gradstream`` command: a thin dispatcher.

Each package owns its subcommands and exposes ``register(app)``, which adds them to the
root Typer application; this module only collects them. Heavy imports (DuckDB, Kafka
clients) happen inside the commands, so ``gradstream --help`` stays fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="gradstream",
    help=(
        "Streaming gradient telemetry for deep-learning training: every step, every rank, "
        "SQL over the history.\n\n"
        "Producers inside training ranks send gradient summaries to Kafka; `gradstream "
        "consume` merges ranks into frames, classifies health and stores them in DuckDB; "
        "`report` and `export` read the store."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)


def _register_all() -> None:
    from analysis import cli as analysis_cli
    from consumer import alerts_cli, dlq_cli
    from consumer import cli as consumer_cli
    from deploy import broker_cli, demo_cli

    broker_cli.register(app)
    consumer_cli.register(app)
    alerts_cli.register(app)
    dlq_cli.register(app)
    analysis_cli.register(app)
    demo_cli.register(app)


_register_all()


def main() -> None:
    """Entry point of the ``gradstream`` console script."""
    app()


if __name__ == "__main__":
    main()
