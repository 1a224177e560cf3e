"""gradstream's contract: pydantic wire models, topic names and DuckDB table definitions.

Every other package imports this one; it imports none of them. It stays light (pydantic
only) because the producer SDK loads it inside users' training jobs, and its re-exports
below are resolved on first use (PEP 562), so that a stdlib-only submodule such as
:mod:`schemas.nonfinite_verdict` can be imported (by the command line, to build its
choices) without loading pydantic or NumPy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from schemas.alert import (
        Alert,
        AlertRule,
        AlertSeverity,
        AlertState,
        RunStatus,
        decode_alert_record,
        encode_alert_record,
    )
    from schemas.topics import (
        DEFAULT_ALERTS_TOPIC,
        DEFAULT_CONSUMER_GROUP,
        DEFAULT_DLQ_TOPIC,
        DEFAULT_SUMMARIES_TOPIC,
    )
    from schemas.wire import (
        SCHEMA_MAJOR,
        SCHEMA_VERSION,
        GradientHealth,
        Message,
        RunFinished,
        RunStarted,
        StepSummary,
        WireError,
        decode_message,
        encode_message,
    )

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("Alert", "AlertRule", "AlertSeverity", "AlertState", "RunStatus",
                     "decode_alert_record", "encode_alert_record"), "schemas.alert"),
    **dict.fromkeys(("DEFAULT_ALERTS_TOPIC", "DEFAULT_CONSUMER_GROUP", "DEFAULT_DLQ_TOPIC",
                     "DEFAULT_SUMMARIES_TOPIC"), "schemas.topics"),
    **dict.fromkeys(("SCHEMA_MAJOR", "SCHEMA_VERSION", "GradientHealth", "Message",
                     "RunFinished", "RunStarted", "StepSummary", "WireError",
                     "decode_message", "encode_message"), "schemas.wire"),
}
"""Re-exported name -> the submodule that defines it."""


def __getattr__(name: str) -> Any:
    """Resolve a re-exported name from its submodule on first use (PEP 562).

    Raises:
        AttributeError: ``name`` is not one of ``__all__``.
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'schemas' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_ALERTS_TOPIC",
    "DEFAULT_CONSUMER_GROUP",
    "DEFAULT_DLQ_TOPIC",
    "DEFAULT_SUMMARIES_TOPIC",
    "SCHEMA_MAJOR",
    "SCHEMA_VERSION",
    "Alert",
    "AlertRule",
    "AlertSeverity",
    "AlertState",
    "GradientHealth",
    "Message",
    "RunFinished",
    "RunStarted",
    "RunStatus",
    "StepSummary",
    "WireError",
    "decode_alert_record",
    "decode_message",
    "encode_alert_record",
    "encode_message",
]
