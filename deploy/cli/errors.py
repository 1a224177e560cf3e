"""How a ``gradstream`` command reports an error it expects: one red line (or paragraph) on
stderr, no traceback, and an exit status."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: <message>`` in red on stderr and exit with ``code``."""
    Console(stderr=True, highlight=False).print(f"error: {message}", style="bold red",
                                                markup=False, soft_wrap=True)
    raise typer.Exit(code)
