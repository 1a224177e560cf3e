"""The outputs a worker can write to, by name (one line per output).

Adding an output: a module in this package with a :class:`consumer.outputs.base.Output`
subclass and its ``from_settings`` constructor, and one line in :data:`OUTPUTS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from consumer.outputs.base import Output
from consumer.outputs.duckdb import DuckDBOutput
from consumer.outputs.frames_topic import FramesTopicOutput


def _iceberg(settings: Any) -> Output:
    """:meth:`consumer.outputs.iceberg.IcebergOutput.from_settings`, imported when used:
    pyiceberg is the optional ``iceberg`` extra.

    Raises:
        ModuleNotFoundError: pyiceberg is not installed (``pip install 'gradstream[iceberg]'``).
    """
    try:
        from consumer.outputs.iceberg import IcebergOutput
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"the iceberg output needs pyiceberg ({exc}): pip install 'gradstream[iceberg]'"
        ) from exc
    return IcebergOutput.from_settings(settings)


OUTPUTS: dict[str, Callable[[Any], Output]] = {
    "duckdb": DuckDBOutput.from_settings,
    "frames_topic": FramesTopicOutput.from_settings,
    "iceberg": _iceberg,
}
"""Output name -> constructor from a worker's settings (``ConsumerSettings.output``)."""


def open_output(name: str, settings: Any) -> Output:
    """Open the output called ``name`` (:data:`OUTPUTS`) with ``settings``.

    Raises:
        KeyError: no output of that name.
        duckdb.IOException / kafka.errors.KafkaError: as the output's constructor.
    """
    return OUTPUTS[name](settings)
