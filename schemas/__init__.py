"""gradstream's contract: pydantic wire models, topic names and DuckDB table definitions.

Every other package imports this one; it imports none of them. It stays light (pydantic
only) because the producer SDK loads it inside users' training jobs.
"""

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
