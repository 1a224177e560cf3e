"""The ``gradstream`` command: the composition root that wires every subcommand.

How the CLI is wired: :mod:`deploy.cli.options` declares once each option that more than
one command takes (flag, help text, environment variable, and ``DEFAULT_DB``, the default
store file); a command takes one by annotating a parameter with its type, and takes a whole
set of them, such as every option of the consumer worker, through an option group
(:class:`deploy.cli.consume.WorkerOptions`, taken by both ``consume`` and ``serve``). One
module per command group defines the commands and adds them to the root application with
``register(app)``: :mod:`~deploy.cli.consume` (``consume``, ``store``),
:mod:`~deploy.cli.alerts` (``alerts``, ``watch``, ``alert-rules``), :mod:`~deploy.cli.dlq`,
:mod:`~deploy.cli.reports` (``report``, ``export``, ``plot``, ``query``),
:mod:`~deploy.cli.serve`, :mod:`~deploy.cli.analyze` (generic over
:mod:`analysis.registry`), :mod:`~deploy.cli.demo` and :mod:`~deploy.cli.broker`. A command
function only parses its options, builds the settings of what it runs (``consumer.settings``,
``consumer.store_writer_settings``) and calls the logic, which stays in its package
(:mod:`consumer.worker`, :mod:`consumer.store_writer`, :mod:`consumer.supervisor`,
:mod:`consumer.dlq_reader`, :mod:`analysis.report`, :mod:`analysis.export`,
:mod:`analysis.read.query`, :mod:`deploy.broker`, :mod:`deploy.serve`, :mod:`deploy.demo`).
Those packages never import this one, but a package's own command module may use
:mod:`deploy.cli.options`.

``app`` is built on first use (``from deploy.cli import app``, :func:`main`, ``python -m
deploy.cli``), so importing :mod:`deploy.cli.options` registers nothing and cannot form an
import cycle with a command module that uses it. DuckDB, Kafka clients and pydantic are
imported inside the command functions, so ``gradstream --help`` stays fast.
"""

from __future__ import annotations

import functools
from typing import Any

import typer

__all__ = ["app", "build_app", "main"]


def build_app() -> typer.Typer:
    """A new root ``gradstream`` application with every subcommand registered."""
    from deploy.cli import (
        alerts,
        analyze,
        broker,
        consume,
        demo,
        dlq,
        inspect,
        maintain,
        reports,
        serve,
    )

    root = typer.Typer(
        name="gradstream",
        help=(
            "Streaming gradient telemetry for deep-learning training: every step, every "
            "rank, SQL over the history.\n\n"
            "Producers inside training ranks send gradient summaries to Kafka; `gradstream "
            "consume` merges ranks into frames, classifies health and stores them in DuckDB; "
            "`report` and `export` read the store."
        ),
        no_args_is_help=True,
        add_completion=False,
        rich_markup_mode="rich",
    )
    consume.register(root)
    alerts.register(root)
    dlq.register(root)
    inspect.register(root)
    reports.register(root)
    serve.register(root)
    analyze.register(root)
    demo.register(root)
    broker.register(root)
    maintain.register(root)
    return root


@functools.cache
def _app() -> typer.Typer:
    return build_app()


def __getattr__(name: str) -> Any:
    """``app``: the root application, built by :func:`build_app` on first use."""
    if name == "app":
        return _app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Entry point of the ``gradstream`` console script."""
    _app()()
