"""The options of the ``gradstream`` commands that more than one command takes, each
declared once: its flag, help text and environment variable.

A command takes one by annotating a parameter with its type, e.g.
``bootstrap_servers: BootstrapServersOption = None``; the default is written at the
parameter (an ``Annotated`` ``typer.Option`` takes none). An option left at ``None`` is
filled in by the settings class of the process the command starts (``GRADSTREAM_<SETTING>``
or ``KAFKA_BOOTSTRAP_SERVERS``, then the class default), as its help text says. Options only
one command takes are declared next to that command.

:func:`given` keeps the options given on the command line, for a settings class.
:class:`OptionGroup` and :func:`with_option_groups` hand a whole set of options to several
commands: e.g. every option of the consumer worker, taken by ``consume`` and by ``serve``,
which runs the same worker.

This module imports typer, :mod:`consumer.defaults` (a constant) and
:mod:`schemas.nonfinite_verdict` (standard library only) only, so a package's command module
can use these types without loading DuckDB, Kafka clients or pydantic, and without
importing the command modules of :mod:`deploy.cli`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from consumer.defaults import DEFAULT_DB
from schemas.nonfinite_verdict import NONFINITE_VERDICTS

__all__ = [
    "DEFAULT_DB",
    "AlertRoutingOptions",
    "AlertRulesOption",
    "AlertSetOption",
    "AlertsTopicOption",
    "BootstrapServersOption",
    "DbOption",
    "DlqTopicOption",
    "DurationOption",
    "ExcludeRoundingOption",
    "FramesTopicOption",
    "FromStepOption",
    "GroupOption",
    "IcebergOptions",
    "IgnoreLayersOption",
    "LogFormatOption",
    "LogLevelOption",
    "MaxFramesOption",
    "MaxReadersOption",
    "MetricsPortOption",
    "NonfiniteVerdictChoice",
    "NonfiniteVerdictOption",
    "OptionGroup",
    "PartitionsOption",
    "ReadEndpointOption",
    "ReadPortOption",
    "RunOption",
    "RunsTopicOption",
    "ShardTimeoutOption",
    "StuckPartitionTimeoutOption",
    "SummariesTopicOption",
    "ToStepOption",
    "TokenOption",
    "WebhookOption",
    "WriteDbOption",
    "given",
    "nonfinite_rule",
    "with_option_groups",
]

# --------------------------------------------------------------------------- Kafka

BootstrapServersOption = Annotated[
    str | None,
    typer.Option("--bootstrap-servers",
                 help="Kafka bootstrap servers host:port[,host:port]. "
                 "Default: $KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092."),
]
GroupOption = Annotated[str | None, typer.Option("--group", help="Kafka consumer group.")]
GroupInstanceIdOption = Annotated[
    str | None,
    typer.Option("--group-instance-id", metavar="ID",
                 help="Static group membership (Kafka KIP-345), unique per worker: a worker "
                 "restarted with the same id takes its partitions back at once instead of "
                 "waiting for its predecessor's session to expire. With --workers N, worker "
                 "i uses ID-i. Default: $GRADSTREAM_GROUP_INSTANCE_ID or dynamic membership."),
]
PartitionsOption = Annotated[
    int | None, typer.Option("--partitions", help="Partitions of topics this worker creates.")
]

# --------------------------------------------------------------------------- topics

SummariesTopicOption = Annotated[
    str | None, typer.Option("--topic", help="Summaries topic to consume.")
]
DlqTopicOption = Annotated[
    str | None,
    typer.Option(metavar="TOPIC", help="Dead-letter topic for unusable messages. "
                 "Default: $GRADSTREAM_DLQ_TOPIC or gradstream.dlq."),
]
"""The flag is the parameter's name: ``--dlq-topic`` for the worker, ``--topic`` for
``gradstream dlq``, whose subject the dead-letter topic is."""
AlertsTopicOption = Annotated[
    str | None,
    typer.Option("--alerts-topic", metavar="TOPIC",
                 help="Topic of alert events and run statuses. "
                 "Default: $GRADSTREAM_ALERTS_TOPIC or gradstream.alerts."),
]
FramesTopicOption = Annotated[
    str | None,
    typer.Option("--frames-topic", metavar="TOPIC",
                 help="Scale-out mode: the topic of finished frames, which `consume` "
                 "workers publish instead of writing DuckDB (as many workers as the "
                 "summaries topic has partitions, on any hosts) and `store` writes to DuckDB. "
                 "Default: $GRADSTREAM_FRAMES_TOPIC, else off (consume) or gradstream.frames "
                 "(store)."),
]
RunsTopicOption = Annotated[
    str | None,
    typer.Option("--runs-topic", metavar="TOPIC",
                 help="Scale-out mode: compacted topic where workers keep each run's start "
                 "record, so a worker taking over a partition knows its runs. "
                 "Default: $GRADSTREAM_RUNS_TOPIC or gradstream.runs."),
]

# --------------------------------------------------------------------------- the store

WriteDbOption = Annotated[
    Path | None,
    typer.Option("--db", help="DuckDB file to write (created if absent). "
                 f"Default: $GRADSTREAM_DB or ./{DEFAULT_DB}."),
]
"""The store a process writes; ``None`` leaves it to the settings (``GRADSTREAM_DB``)."""


def store_location(value: str | os.PathLike[str]) -> Path | str:
    """A ``--db`` of a command that reads: a DuckDB file's path as a ``Path``, or a store
    URL (``iceberg+...``, :mod:`analysis.read.store_url`) as the ``str`` given (a ``Path``
    would fold its ``//``).

    Raises:
        typer.BadParameter: a store URL of an unknown kind.
    """
    from analysis.read.store_url import store_url_scheme

    text = os.fspath(value)
    try:
        return text if store_url_scheme(text) is not None else Path(text)
    except Exception as exc:  # StoreError, without importing DuckDB for the check
        raise typer.BadParameter(str(exc)) from None


DbOption = Annotated[
    Path,
    typer.Option("--db", envvar="GRADSTREAM_DB", show_default=True, metavar="PATH|URL",
                 parser=store_location,
                 help="DuckDB store written by `gradstream consume` (env GRADSTREAM_DB), or "
                 "an Apache Iceberg table set: iceberg+<catalog>?warehouse=<warehouse>"
                 "[&namespace=<ns>], e.g. iceberg+sqlite:////abs/catalog.db?warehouse="
                 "file:///abs/wh (S3 settings from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
                 "AWS_SECRET_ACCESS_KEY, AWS_REGION; needs pip install 'gradstream[iceberg]')."),
]
"""The store a command reads; write the default as ``= Path(DEFAULT_DB)``. A store URL
comes as a ``str`` (:func:`store_location`)."""
RunOption = Annotated[
    str | None,
    typer.Option("--run", show_default=False,
                 help="Run id. Optional when the store holds exactly one run."),
]
FromStepOption = Annotated[
    int | None,
    typer.Option("--from-step", min=0, help="First optimiser step included (inclusive)."),
]
ToStepOption = Annotated[
    int | None,
    typer.Option("--to-step", min=0, help="Last optimiser step included (inclusive)."),
]

# --------------------------------------------------------------------------- the worker

ShardTimeoutOption = Annotated[
    float | None,
    typer.Option("--shard-timeout",
                 help="Seconds to wait for every rank of a step before storing the frame as "
                 "partial (a late rank rewrites it)."),
]
MaxFramesOption = Annotated[
    int | None,
    typer.Option("--max-frames",
                 help="Rolling window of run health in frames; 0 = whole run."),
]
IgnoreLayersOption = Annotated[
    list[str] | None,
    typer.Option("--ignore-layers", metavar="PATTERN", show_default=False,
                 help="Leave the layers whose name matches this shell-style pattern (e.g. "
                 "'*.attention.self.key.bias') out of health, issue frames and the "
                 "vanishing / exploding alerts, besides each run's own ignore_layers; "
                 "NaN/Inf still counts. Repeatable. Default: $GRADSTREAM_IGNORE_LAYERS "
                 "(comma-separated), else none."),
]
ExcludeRoundingOption = Annotated[
    bool | None,
    typer.Option("--exclude-rounding-level/--count-rounding-level", show_default=False,
                 help="Also leave out the vanishing flag of layers whose gradient has been "
                 "at floating-point rounding level since their first frame (likely zero by "
                 "construction). Off by default: every layer counts, as in the reference "
                 "implementation, and such layers are a finding of the report. Default: "
                 "$GRADSTREAM_EXCLUDE_ROUNDING_LEVEL, else off."),
]
NonfiniteVerdictChoice = StrEnum(  # type: ignore[misc]
    "NonfiniteVerdictChoice", [(v.upper(), v) for v in NONFINITE_VERDICTS],
    module=__name__)
NonfiniteVerdictChoice.__doc__ = (
    """The choices of ``--nonfinite-rule``: one member per
    :data:`schemas.nonfinite_verdict.NONFINITE_VERDICTS` (``CRITICAL = "critical"``,
    ``REFERENCE = "reference"``), built from that tuple so the two cannot differ.""")

NonfiniteVerdictOption = Annotated[
    NonfiniteVerdictChoice | None,
    typer.Option("--nonfinite-rule", show_default=False, case_sensitive=False,
                 help="How NaN/Inf gradients count in the health: critical (gradstream's "
                 "rule: a layer with NaN/Inf elements makes the run Critical) or reference "
                 "(trustformers-debug's verdict exactly: an Inf element makes the "
                 "layer exploding, a NaN-only layer is no issue; needs the NaN count of "
                 "wire schema 1.7). Default: $GRADSTREAM_NONFINITE_RULE, else critical."),
]


def nonfinite_rule(value: NonfiniteVerdictChoice | None) -> str:
    """``--nonfinite-rule`` as given, else ``$GRADSTREAM_NONFINITE_RULE`` (any case), else
    ``critical``; for the commands that read no settings model (the report).

    Raises:
        typer.BadParameter: the environment variable holds another value.
    """
    if value is not None:
        return value.value
    env = os.environ.get("GRADSTREAM_NONFINITE_RULE", "").strip().lower() or "critical"
    if env not in NONFINITE_VERDICTS:
        raise typer.BadParameter(f"GRADSTREAM_NONFINITE_RULE={env!r}: expected "
                                 f"{' or '.join(NONFINITE_VERDICTS)}")
    return env


MetricsPortOption = Annotated[
    int | None,
    typer.Option("--metrics-port", min=0, max=65535, metavar="PORT",
                 help="Serve Prometheus metrics on http://0.0.0.0:PORT/metrics; 0 = off. "
                 "Default: $GRADSTREAM_METRICS_PORT or off."),
]

StuckPartitionTimeoutOption = Annotated[
    float | None,
    typer.Option("--stuck-partition-timeout", min=0, metavar="SECONDS",
                 help="Seconds a partition with records to read may keep its position "
                 "before it counts as stuck: logged, counted, re-sought, then (still "
                 "stuck as long again) read by a new Kafka consumer; nothing lost or "
                 "stored twice. 0 = off. Default: $GRADSTREAM_STUCK_PARTITION_TIMEOUT_S or 30."),
]

# --------------------------------------------------------------------------- reads while writing

ReadEndpointOption = Annotated[
    bool,
    typer.Option("--read-endpoint/--no-read-endpoint", envvar="GRADSTREAM_READ_ENDPOINT",
                 help="Answer reads while writing: DuckDB lets no other process open the "
                 "file, so this process serves `gradstream query`, `report`, `export`, "
                 "notebooks... on a loopback endpoint advertised (with its token) in "
                 "<db>.serve.json, removed on stop. --no-read-endpoint: hold the file and "
                 "answer nothing."),
]
ReadPortOption = Annotated[
    int,
    typer.Option("--read-port", envvar="GRADSTREAM_READ_PORT", min=0, max=65535,
                 metavar="PORT",
                 help="TCP port of the read endpoint on 127.0.0.1; 0 = any free port "
                 "(readers find it in <db>.serve.json)."),
]


def _token(value: str | None) -> str | None:
    """Check a chosen token (:func:`analysis.read.sidecar.check_token`)."""
    from analysis.read.sidecar import check_token

    if value is None:
        return None
    try:
        return check_token(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="GRADSTREAM_TOKEN", metavar="TOKEN", callback=_token,
                 show_default=False,
                 help="Secret every read of the endpoint and the dashboard requires (scripts "
                 "send 'Authorization: Bearer TOKEN'; the printed URL /?token=TOKEN lets a "
                 "browser in). Default: $GRADSTREAM_TOKEN, else a random one; either way it "
                 "is in <db>.serve.json. Prefer the variable: a flag shows in `ps`."),
]
MaxReadersOption = Annotated[
    int,
    typer.Option("--max-readers", envvar="GRADSTREAM_MAX_READERS", min=1, metavar="N",
                 help="Read requests answered at once (default: half the cores, at least 1); "
                 "the others wait. In a process that writes the store, each read also runs at "
                 "the lowest CPU priority, so that long queries never hold up ingestion."),
]

# --------------------------------------------------------------------------- alerts

AlertRulesOption = Annotated[
    Path | None,
    typer.Option("--alert-rules", metavar="FILE",
                 help="Alert rules and thresholds, a .toml or .yaml file (see `gradstream "
                 "alert-rules --help`). Default: $GRADSTREAM_ALERT_RULES or built-in."),
]
AlertSetOption = Annotated[
    list[str] | None,
    typer.Option("--alert-set", metavar="RULE.FIELD=VALUE",
                 help="Override one rule setting, e.g. exploding.consecutive=5 "
                 "(repeatable; applied over the rule file)."),
]
WebhookOption = Annotated[
    str | None,
    typer.Option("--webhook", metavar="URL",
                 help="POST every alert event as Slack-compatible JSON to this URL "
                 "(e.g. a Slack incoming webhook). Default: $GRADSTREAM_WEBHOOK_URL."),
]

AlertmanagerUrlOption = Annotated[
    str | None,
    typer.Option("--alertmanager-url", metavar="URL",
                 help="Send every incident to this Prometheus Alertmanager (API v2: POST "
                 "URL/api/v2/alerts, e.g. http://alertmanager:9093) when it fires, again "
                 "every re-send interval while it fires, and when it resolves. "
                 "Default: $GRADSTREAM_ALERTMANAGER_URL, else none."),
]
AlertmanagerResendOption = Annotated[
    float | None,
    typer.Option("--alertmanager-resend-interval", min=0.001, metavar="SECONDS",
                 help="Seconds between re-sends of the firing incidents to Alertmanager, "
                 "which resolves an alert that is not re-sent before its endsAt. "
                 "Default: $GRADSTREAM_ALERTMANAGER_RESEND_INTERVAL_S or 60 "
                 "(Prometheus's resend delay)."),
]
AlertmanagerLeaseOption = Annotated[
    float | None,
    typer.Option("--alertmanager-lease", min=0.001, metavar="SECONDS",
                 help="endsAt of a firing incident, seconds after each send: if gradstream "
                 "stops re-sending it, Alertmanager resolves it then. More than the re-send "
                 "interval. Default: $GRADSTREAM_ALERTMANAGER_LEASE_S or 4 re-send "
                 "intervals (Prometheus's rule)."),
]
PagerDutyRoutingKeyOption = Annotated[
    str | None,
    typer.Option("--pagerduty-routing-key", metavar="KEY", show_default=False,
                 help="Trigger a PagerDuty alert when an incident fires and resolve it when it "
                 "resolves (Events API v2; KEY: the 32-character integration key). Prefer "
                 "$GRADSTREAM_PAGERDUTY_ROUTING_KEY: a flag shows in `ps`. Default: that "
                 "variable, else none."),
]
PagerDutyUrlOption = Annotated[
    str | None,
    typer.Option("--pagerduty-url", metavar="URL",
                 help="PagerDuty Events API v2 endpoint. Default: $GRADSTREAM_PAGERDUTY_URL or "
                 "https://events.pagerduty.com/v2/enqueue."),
]
DashboardUrlOption = Annotated[
    str | None,
    typer.Option("--dashboard-url", metavar="URL",
                 help="Base URL of gradstream's dashboard as the people paged reach it (where "
                 "`gradstream serve` answers): Alertmanager's generatorURL and PagerDuty's "
                 "link open URL/?run=RUN. Default: $GRADSTREAM_DASHBOARD_URL, else no link."),
]


# --------------------------------------------------------------------------- running

LogLevelOption = Annotated[str, typer.Option("--log-level",
                                             help="DEBUG, INFO, WARNING or ERROR.")]
LogFormatOption = Annotated[
    str,
    typer.Option("--log-format", envvar="GRADSTREAM_LOG_FORMAT",
                 help="'text' (human-readable) or 'json' (one JSON object per line, for "
                 "log collectors)."),
]
DurationOption = Annotated[
    float | None,
    typer.Option("--duration", min=0,
                 help="Stop after this many seconds (default: until Ctrl-C)."),
]


# --------------------------------------------------------------------------- values


def given(**values: Any) -> dict[str, Any]:
    """The options given on the command line among ``values`` (those not left at ``None``),
    paths as text: keyword arguments for a settings class, which takes the environment and
    its defaults for the others."""
    return {k: os.fspath(v) if isinstance(v, os.PathLike) else v
            for k, v in values.items() if v is not None}


# --------------------------------------------------------------------------- groups


class OptionGroup:
    """Base of a dataclass whose fields are options several commands take together.

    Each field is annotated with an option type and has the option's default. A command
    decorated with :func:`with_option_groups` declares one parameter annotated with the
    group class; the command line then has one option per field, and the command receives
    their values as one instance of the group.
    """


_Command = TypeVar("_Command", bound=Callable[..., Any])


def with_option_groups(command: _Command) -> _Command:
    """Expand the :class:`OptionGroup` parameters of ``command`` into their options.

    Typer reads the returned function's signature: every parameter of ``command`` stays
    where it is (all keyword-only), except that each parameter annotated with an
    ``OptionGroup`` dataclass becomes that dataclass's fields, in their order. When the
    command runs, the fields' values are collected back into an instance of the group.

    Raises:
        TypeError: a group's field has the name of another parameter or field.
    """
    signature = inspect.signature(command, eval_str=True)
    parameters: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for parameter in signature.parameters.values():
        group = parameter.annotation
        if not (isinstance(group, type) and issubclass(group, OptionGroup)):
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
            continue
        hints = typing.get_type_hints(group, include_extras=True)
        fields = dataclasses.fields(group)
        groups[parameter.name] = (group, [f.name for f in fields])
        parameters += [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                              annotation=hints[f.name])
            for f in fields
        ]
    names = [p.name for p in parameters]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TypeError(f"{command.__qualname__}: option groups repeat {repeated}")

    @functools.wraps(command)
    def run(**values: Any) -> Any:
        for name, (group, fields) in groups.items():
            values[name] = group(**{f: values.pop(f) for f in fields})
        return command(**values)

    run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in parameters}
    return typing.cast(_Command, run)


@dataclasses.dataclass(frozen=True)
class AlertRoutingOptions(OptionGroup):
    """Where incidents are routed besides the webhook: Prometheus Alertmanager and
    PagerDuty, and the dashboard their links point at
    (``consumer.settings.AlertingSettings``); taken by ``consume``, ``serve``, ``store``
    and ``demo``, the commands that take ``--webhook``."""

    alertmanager_url: AlertmanagerUrlOption = None
    alertmanager_resend_interval: AlertmanagerResendOption = None
    alertmanager_lease: AlertmanagerLeaseOption = None
    pagerduty_routing_key: PagerDutyRoutingKeyOption = None
    pagerduty_url: PagerDutyUrlOption = None
    dashboard_url: DashboardUrlOption = None

    def settings(self) -> dict[str, Any]:
        """The options given, as ``AlertingSettings`` fields (see :func:`given`)."""
        return given(
            alertmanager_url=self.alertmanager_url,
            alertmanager_resend_interval_s=self.alertmanager_resend_interval,
            alertmanager_lease_s=self.alertmanager_lease,
            pagerduty_routing_key=self.pagerduty_routing_key,
            pagerduty_url=self.pagerduty_url, dashboard_url=self.dashboard_url,
        )


IcebergCatalogOption = Annotated[
    str | None,
    typer.Option("--iceberg-catalog", help="Write the store to Apache Iceberg tables in this "
                 "SQL catalog instead of the DuckDB file (sqlite:///catalog.db, "
                 "postgresql+psycopg2://user:pw@host/db). Default: "
                 "$GRADSTREAM_ICEBERG_CATALOG; needs pip install 'gradstream[iceberg]'."),
]
IcebergWarehouseOption = Annotated[
    str | None,
    typer.Option("--iceberg-warehouse", help="Where the Iceberg tables' files go: "
                 "file:///path or s3://bucket/path (S3 endpoint and credentials from "
                 "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION). "
                 "Default: $GRADSTREAM_ICEBERG_WAREHOUSE."),
]
IcebergNamespaceOption = Annotated[
    str | None,
    typer.Option("--iceberg-namespace", help="Iceberg namespace of the store's tables "
                 "(created if absent). Default: $GRADSTREAM_ICEBERG_NAMESPACE or gradstream."),
]


@dataclasses.dataclass(frozen=True)
class IcebergOptions(OptionGroup):
    """Where a process that writes the store writes it when not to DuckDB: an Apache
    Iceberg table set (``consumer.settings.LoopSettings.iceberg_*``,
    :mod:`consumer.outputs.iceberg`); taken by ``consume`` and ``store``."""

    iceberg_catalog: IcebergCatalogOption = None
    iceberg_warehouse: IcebergWarehouseOption = None
    iceberg_namespace: IcebergNamespaceOption = None

    def settings(self) -> dict[str, Any]:
        """The options given, as ``LoopSettings`` fields (see :func:`given`)."""
        return given(iceberg_catalog=self.iceberg_catalog,
                     iceberg_warehouse=self.iceberg_warehouse,
                     iceberg_namespace=self.iceberg_namespace)
