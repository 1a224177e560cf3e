"""The deployment files (deploy/Dockerfile, deploy/docker-compose.yml, deploy/k8s/) agree with
the code.

No container engine runs on this machine, so nothing is started: the files are parsed
(PyYAML, a small Dockerfile reader) and checked against the Typer application (subcommands
and options), the settings classes (``GRADSTREAM_*`` names and values), the topic and group
constants of ``schemas.topics``, the package layout of pyproject.toml, and each other (image
names, ports, partitions against replicas, KRaft quorum).
"""

from __future__ import annotations

import base64
import fnmatch
import importlib
import json
import os
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import typer
import yaml
from packaging.specifiers import SpecifierSet
from pydantic import AliasChoices

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
K8S_DIR = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"

SETTINGS_OF = {
    "consume": ("consumer.settings", "ConsumerSettings"),
    "store": ("consumer.store_writer_settings", "StoreWriterSettings"),
    "maintain": ("consumer.iceberg_maintenance", "MaintenanceSettings"),
}
"""gradstream subcommand -> module and class of the settings it reads from the environment."""

KAFKA_IMAGE_REPO = "apache/kafka"
EXPECTED_BROKERS = 3
EXPECTED_REPLICATION_FACTOR = 3

# ----------------------------------------------------------------------------- readers


def _topics(name: str) -> str:
    """A constant of schemas.topics, looked up when a test needs it (AttributeError = fail)."""
    return getattr(importlib.import_module("schemas.topics"), name)


def _settings_class(subcommand: str) -> type:
    module, name = SETTINGS_OF[subcommand]
    return getattr(importlib.import_module(module), name)


@cache
def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str


@cache
def _dockerfile() -> tuple[Instruction, ...]:
    """Instructions of deploy/Dockerfile with line continuations joined, comments dropped."""
    out: list[Instruction] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.partition(" ")
        out.append(Instruction(keyword.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"
    return tuple(out)


def _docker_values(keyword: str) -> list[str]:
    return [i.value for i in _dockerfile() if i.keyword == keyword]


@cache
def _dockerfile_labels() -> dict[str, str]:
    labels: dict[str, str] = {}
    for value in _docker_values("LABEL"):
        for token in shlex.split(value):
            key, _, val = token.partition("=")
            labels[key] = val
    return labels


def _gradstream_image() -> str:
    """The image reference the Dockerfile's OCI labels name: ``<title>:<version>``."""
    labels = _dockerfile_labels()
    return (
        f"{labels['org.opencontainers.image.title']}:"
        f"{labels['org.opencontainers.image.version']}"
    )


def _dockerfile_user() -> tuple[int, int]:
    users = _docker_values("USER")
    assert users, "the Dockerfile sets no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    return int(uid), int(gid or uid)


@cache
def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@cache
def _k8s_docs() -> tuple[tuple[str, dict[str, Any]], ...]:
    docs: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs.extend((path.name, d) for d in yaml.safe_load_all(path.read_text()) if d)
    return tuple(docs)


def _k8s(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in _k8s_docs() if d["kind"] == kind]


def _configmaps() -> dict[str, dict[str, str]]:
    return {c["metadata"]["name"]: dict(c.get("data", {})) for c in _k8s("ConfigMap")}


def _as_str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Container:
    """One container of compose or Kubernetes, with its environment resolved to strings."""

    where: str
    source: str  # "compose" or "k8s"
    image: str
    entrypoint: list[str] | None  # compose `entrypoint` / k8s `command` override
    args: list[str]  # compose `command` / k8s `args`, $(VAR) expanded (k8s)
    env: dict[str, str]
    replicas: int
    spec: dict[str, Any] = field(repr=False)  # compose service / k8s workload

    @property
    def is_gradstream(self) -> bool:
        return self.image.split(":")[0].rsplit("/", 1)[-1] == "gradstream"

    @property
    def subcommand(self) -> str:
        return self.args[0]


def _compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: _as_str(v) for k, v in env.items()}


def _compose_containers(compose: dict[str, Any] | None = None) -> list[Container]:
    out = []
    for name, svc in (compose or _compose())["services"].items():
        command = svc.get("command")
        entry = svc.get("entrypoint")
        out.append(
            Container(
                where=f"compose:{name}",
                source="compose",
                image=svc["image"],
                entrypoint=shlex.split(entry) if isinstance(entry, str) else entry,
                args=shlex.split(command) if isinstance(command, str) else list(command or []),
                env=_compose_env(svc),
                replicas=int((svc.get("deploy") or {}).get("replicas", 1)),
                spec=svc,
            )
        )
    return out


_K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _k8s_expand(text: str, env: dict[str, str], where: str) -> str:
    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        assert name in env, f"{where}: $({name}) is not in the container's environment"
        return env[name]

    return _K8S_VAR.sub(sub, text)


def _k8s_env(container: dict[str, Any], where: str,
             docs: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """The container's environment from its ConfigMaps and Secrets (those of deploy/k8s, or
    of ``docs``)."""
    if docs is None:
        maps = _configmaps()
    else:
        maps = {d["metadata"]["name"]: dict(d.get("data") or d.get("stringData") or {})
                for d in docs if d["kind"] in ("ConfigMap", "Secret")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = (source.get("configMapRef") or source["secretRef"])["name"]
        assert ref in maps, f"{where}: envFrom {ref!r} is not in deploy/k8s"
        env.update(maps[ref])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = _as_str(item["value"])
        else:
            source = item["valueFrom"]
            ref = source.get("configMapKeyRef") or source["secretKeyRef"]
            assert ref["name"] in maps, f"{where}: ConfigMap {ref['name']!r} missing"
            assert ref["key"] in maps[ref["name"]], f"{where}: key {ref['key']!r} missing"
            env[item["name"]] = maps[ref["name"]][ref["key"]]
    return env


def _pod_template(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a workload (a CronJob's is in its job template)."""
    spec = doc["spec"]["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else doc["spec"]
    return spec["template"]


def _k8s_containers(docs: list[dict[str, Any]] | None = None) -> list[Container]:
    out = []
    for doc in [d for _, d in _k8s_docs()] if docs is None else docs:
        if doc["kind"] not in ("Deployment", "StatefulSet", "Job", "CronJob"):
            continue
        pod = _pod_template(doc)["spec"]
        replicas = int(doc["spec"].get("replicas", 1)) if doc["kind"] in (
            "Deployment", "StatefulSet") else 1
        for c in pod["containers"]:
            where = f"k8s:{doc['kind']}/{doc['metadata']['name']}/{c['name']}"
            env = _k8s_env(c, where, docs)
            out.append(
                Container(
                    where=where,
                    source="k8s",
                    image=c["image"],
                    entrypoint=c.get("command"),
                    args=[_k8s_expand(a, env, where) for a in c.get("args", [])],
                    env=env,
                    replicas=replicas,
                    spec=doc,
                )
            )
    return out


def _all_containers() -> list[Container]:
    return _compose_containers() + _k8s_containers()


def _gradstream_containers() -> list[Container]:
    return [c for c in _all_containers() if c.is_gradstream]


def _brokers() -> dict[str, dict[str, Any]]:
    """Compose services running a Kafka broker (apache/kafka with a KRaft node id)."""
    return {
        name: svc
        for name, svc in _compose()["services"].items()
        if svc["image"].startswith(KAFKA_IMAGE_REPO + ":") and "KAFKA_NODE_ID" in _compose_env(svc)
    }


def _topic_creators() -> list[Container]:
    """Containers running kafka-topics.sh --create (compose one-shot service, k8s Job)."""
    return [
        c for c in _all_containers()
        if not c.is_gradstream and "kafka-topics.sh" in " ".join(c.args)
        and "--create" in " ".join(c.args)
    ]


def _workers(source: str) -> list[Container]:
    return [c for c in _gradstream_containers() if c.source == source and c.subcommand == "consume"]


def _store(source: str) -> Container:
    stores = [c for c in _gradstream_containers() if c.source == source and c.subcommand == "store"]
    assert len(stores) == 1, f"{source}: expected exactly one store container, found {stores}"
    return stores[0]


@cache
def _root_command() -> Any:
    """The click group behind the Typer app (Typer ships its own click, so no click types)."""
    from deploy.cli import app

    command = typer.main.get_command(app)
    assert hasattr(command, "commands"), "gradstream has no subcommands"
    return command


def _parse(args: list[str], where: str) -> Any:
    """Parse ``gradstream <args>`` with the real Typer app, without running the command;
    returns the click context (``.params``: option name -> converted value)."""
    group = _root_command()
    assert args, f"{where}: no gradstream subcommand given"
    name = args[0]
    assert name in group.commands, (
        f"{where}: `gradstream {name}` is not a subcommand (have {sorted(group.commands)})"
    )
    try:
        return group.commands[name].make_context(name, list(args[1:]))
    except Exception as exc:  # click's UsageError/BadParameter (typer vendors click)
        message = exc.format_message() if hasattr(exc, "format_message") else repr(exc)
        pytest.fail(f"{where}: `gradstream {' '.join(args)}` does not parse: {message}")


def _env_names(settings: type) -> set[str]:
    """Environment names a pydantic-settings class reads: ``<env_prefix><FIELD>`` for every
    field plus string validation aliases (e.g. ``KAFKA_BOOTSTRAP_SERVERS``), upper-cased
    (the classes are case-insensitive)."""
    assert not settings.model_config.get("case_sensitive", False)
    prefix = settings.model_config.get("env_prefix", "")
    names: set[str] = set()
    for name, info in settings.model_fields.items():
        names.add(f"{prefix}{name}".upper())
        alias = info.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
        names.update(c.upper() for c in choices if isinstance(c, str))
        if isinstance(info.alias, str):
            names.add(info.alias.upper())
    return names


def _settings_from_env(
    settings: type, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Any:
    """Instantiate ``settings`` with exactly ``env`` as the GRADSTREAM_/KAFKA_ environment."""
    for key in list(os.environ):
        if key.upper().startswith(("GRADSTREAM_", "KAFKA_")):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return settings()


_SHELL_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def _topic_commands(container: Container) -> list[dict[str, str | bool]]:
    """The kafka-topics.sh invocations of a topic-creating container's shell script, with
    shell variables expanded from its environment, as ``{--flag: value-or-True}``."""
    script = "\n".join(container.args)
    if container.source == "compose":
        # Compose interpolates `$VAR` from the host; `$$` is a literal `$` for the shell.
        assert "$" not in script.replace("$$", ""), (
            f"{container.where}: a single `$` is interpolated by compose from the host "
            "environment; write `$$` for shell variables"
        )
        script = script.replace("$$", "$")

    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in container.env, f"{container.where}: ${name} is not in its environment"
        return container.env[name]

    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        if "kafka-topics.sh" not in line:
            continue
        tokens = shlex.split(_SHELL_VAR.sub(sub, line))
        assert tokens[0] == "/opt/kafka/bin/kafka-topics.sh", tokens[0]
        flags: dict[str, str | bool] = {}
        for i, token in enumerate(tokens[1:], start=1):
            if not token.startswith("--"):
                continue
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            flags[token] = nxt if nxt is not None and not nxt.startswith("--") else True
        commands.append(flags)
    return commands


def _listeners(value: str) -> dict[str, tuple[str, int]]:
    """``NAME://host:port,...`` -> {NAME: (host, port)} (empty host = all interfaces)."""
    out = {}
    for item in value.split(","):
        name, _, address = item.partition("://")
        host, _, port = address.rpartition(":")
        out[name] = (host, int(port))
    return out


# ----------------------------------------------------------------------------- Dockerfile


def test_dockerfile_base_image_satisfies_requires_python() -> None:
    froms = _docker_values("FROM")
    assert froms == ["python:3.11-slim"], froms
    version = froms[-1].split(":")[1].split("-")[0]
    assert version in SpecifierSet(_pyproject()["project"]["requires-python"])


def test_dockerfile_installs_the_repository_package_with_pip() -> None:
    """`pip install .` runs where pyproject.toml, its readme and every package directory of
    [tool.setuptools.packages.find] have been copied."""
    workdir = PurePosixPath("/")
    copied: set[PurePosixPath] = set()
    installed_in: PurePosixPath | None = None
    for ins in _dockerfile():
        if ins.keyword == "WORKDIR":
            workdir = workdir / ins.value
        elif ins.keyword == "COPY":
            parts = [p for p in shlex.split(ins.value) if not p.startswith("--")]
            *sources, dest = parts
            target = workdir / dest
            if dest.endswith("/") or len(sources) > 1:
                copied.update(target / PurePosixPath(s).name for s in sources)
            else:
                copied.add(target)
        elif ins.keyword == "RUN":
            tokens = shlex.split(ins.value)
            for i in range(len(tokens) - 1):
                if tokens[i] == "pip" and tokens[i + 1] == "install":
                    targets = [t for t in tokens[i + 2:] if not t.startswith("-")]
                    extras = [t[2:-1].split(",") for t in targets if t.startswith(".[")]
                    if "." in targets or extras:
                        installed_in = workdir
                    for extra in (e for names in extras for e in names):
                        assert extra in _pyproject()["project"]["optional-dependencies"], extra
    assert installed_in is not None, "no `pip install .` in the Dockerfile"
    project = _pyproject()
    needed = ["pyproject.toml", project["project"]["readme"]]
    includes = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted({p.split("*")[0].split(".")[0] for p in includes})
    assert packages and all((ROOT / p / "__init__.py").is_file() for p in packages), packages
    needed += packages
    missing = [n for n in needed if installed_in / n not in copied]
    assert not missing, f"copied into {installed_in} before `pip install .`: missing {missing}"


def test_dockerfile_entrypoint_is_the_console_script() -> None:
    entrypoints = _docker_values("ENTRYPOINT")
    assert entrypoints, "no ENTRYPOINT"
    assert json.loads(entrypoints[-1]) == ["gradstream"]
    target = _pyproject()["project"]["scripts"]["gradstream"]
    module, _, func = target.partition(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_dockerfile_runs_unprivileged_and_exposes_the_metrics_ports() -> None:
    uid, gid = _dockerfile_user()
    assert uid != 0 and gid != 0
    exposed = {int(p.split("/")[0]) for v in _docker_values("EXPOSE") for p in v.split()}
    used = {int(c.env["GRADSTREAM_METRICS_PORT"]) for c in _gradstream_containers()}
    assert used and used <= exposed, f"metrics ports {used}, EXPOSE {exposed}"


def _dockerignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        pat = pattern.strip("/")
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pat):
                return True
            if pat.startswith("**/"):
                tail = pat[3:]
                segs = prefix.split("/")
                if any(fnmatch.fnmatchcase("/".join(segs[j:]), tail) for j in range(len(segs))):
                    return True
    return False


def test_dockerignore_keeps_build_inputs_and_drops_local_state() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert not [p for p in patterns if p.startswith("!")], "negations are not checked here"
    for local in (".venv/bin/python", "out/demo.duckdb", "x/gradstream.duckdb", ".git/HEAD"):
        assert _dockerignored(local, patterns), f"{local} would be sent to the build"
    sources = [
        p for v in _docker_values("COPY") for p in shlex.split(v)[:-1] if not p.startswith("--")
    ]
    files = []
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"COPY source {src} does not exist"
        if path.is_file():
            files.append(src)
            continue
        files += [
            str(f.relative_to(ROOT)) for f in path.rglob("*")
            if f.is_file() and f.suffix in {".py", ".xml", ".properties"}
            and "__pycache__" not in f.parts
        ]
    dropped = [f for f in files if _dockerignored(f, patterns)]
    assert not dropped, f".dockerignore drops build inputs: {dropped[:10]}"


# ----------------------------------------------------------------------------- images


def test_image_names_agree_between_dockerfile_compose_and_k8s() -> None:
    image = _gradstream_image()
    assert image == f"gradstream:{_pyproject()['project']['version']}"
    containers = _gradstream_containers()
    assert {c.source for c in containers} == {"compose", "k8s"}
    wrong = {c.where: c.image for c in containers if c.image != image}
    assert not wrong, f"expected {image}: {wrong}"
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    (entry,) = [i for i in kustomization["images"] if i["name"] == image.split(":")[0]]
    assert entry["newTag"] == image.split(":")[1]


def test_every_image_is_gradstream_or_the_pinned_kafka_release() -> None:
    from deploy.broker import KAFKA_VERSION

    assert KAFKA_VERSION.split(".")[0] == "4"
    kafka = f"{KAFKA_IMAGE_REPO}:{KAFKA_VERSION}"
    others = {c.where: c.image for c in _all_containers() if not c.is_gradstream}
    assert others and set(others.values()) == {kafka}, others


def test_compose_builds_the_image_from_the_repository() -> None:
    for name, svc in _compose()["services"].items():
        if svc["image"] != _gradstream_image():
            continue
        build = svc["build"]
        context = (COMPOSE_FILE.parent / build["context"]).resolve()
        assert context == ROOT, f"{name}: build context {context}"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE, name


# ----------------------------------------------------------------------------- commands


@pytest.mark.parametrize("container", _gradstream_containers(), ids=lambda c: c.where)
def test_commands_are_real_subcommands_and_options(container: Container) -> None:
    assert container.entrypoint is None, (
        f"{container.where}: keep the image's ENTRYPOINT gradstream; give only arguments"
    )
    assert container.subcommand in SETTINGS_OF, container.args
    _parse(container.args, container.where)


def test_scale_out_roles_in_compose_and_k8s() -> None:
    """Workers publish frames (no DuckDB of their own); one store writes the DuckDB file."""
    for source in ("compose", "k8s"):
        workers = _workers(source)
        assert workers, f"{source}: no `gradstream consume` worker"
        for w in workers:
            params = _parse(w.args, w.where).params
            assert params.get("frames_topic"), f"{w.where}: not in scale-out mode (--frames-topic)"
            assert "--db" not in w.args, f"{w.where}: a worker must not write DuckDB"
        store = _store(source)
        assert _parse(store.args, store.where).params.get("db"), f"{store.where}: no --db"
        assert store.replicas == 1, f"{store.where}: one DuckDB file has one writing process"


def test_consume_has_a_workers_option() -> None:
    """`gradstream consume --workers N` starts N worker processes on one host."""
    params = _parse(["consume", "--workers", "2", "--frames-topic", "t"], "consume").params
    assert params["workers"] == 2


def _readme_commands() -> list[list[str]]:
    text = (DEPLOY / "README.md").read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if line.startswith("gradstream "):
                commands.append(shlex.split(line, comments=True)[1:])
            elif " run --rm " in line and "docker compose" in line:
                tokens = shlex.split(line, comments=True)
                at = tokens.index("run") + 1
                while tokens[at].startswith("-"):  # --rm, --no-deps: flags without values
                    at += 1
                commands.append(tokens[at + 1:])  # after the service name
    return commands


def test_deploy_readme_commands_parse() -> None:
    commands = _readme_commands()
    assert commands, "deploy/README.md shows no gradstream command"
    for args in commands:
        _parse(args, "deploy/README.md")


# ----------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    "container",
    [c for c in _all_containers() if c.where.split(":")[-1] not in _brokers()],
    ids=lambda c: c.where,
)
def test_environment_names_are_real_settings(container: Container) -> None:
    """Every variable given to a gradstream process is a setting of that process's settings
    class; the topic-creating containers only use names of those settings."""
    if container.is_gradstream:
        allowed = _env_names(_settings_class(container.subcommand))
    else:
        allowed = set().union(*(_env_names(_settings_class(s)) for s in SETTINGS_OF))
    unknown = sorted(k for k in container.env if k.upper() not in allowed)
    assert not unknown, f"{container.where}: not settings of {container.args[:1]}: {unknown}"


@pytest.mark.parametrize("container", _gradstream_containers(), ids=lambda c: c.where)
def test_environment_and_flags_load_into_the_settings(
    container: Container, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings class accepts the environment, and every flag given on the command line
    that is also a setting agrees with the environment's value."""
    settings = _settings_from_env(_settings_class(container.subcommand), container.env, monkeypatch)
    ctx = _parse(container.args, container.where)
    for name, value in ctx.params.items():
        if ctx.get_parameter_source(name).name != "COMMANDLINE":
            continue
        if name in type(settings).model_fields:
            assert str(getattr(settings, name)) == str(value), (
                f"{container.where}: --{name.replace('_', '-')} {value} but the environment "
                f"gives {getattr(settings, name)}"
            )
    frames_topic = _topics("DEFAULT_FRAMES_TOPIC")
    assert settings.frames_topic == frames_topic
    if container.subcommand == "consume":
        assert settings.topic == _topics("DEFAULT_SUMMARIES_TOPIC")
        assert settings.dlq_topic == _topics("DEFAULT_DLQ_TOPIC")
        assert settings.group_id == _topics("DEFAULT_CONSUMER_GROUP")
        assert settings.replication_factor == EXPECTED_REPLICATION_FACTOR
    else:
        assert settings.group_id == _topics("DEFAULT_STORE_GROUP")
        assert settings.group_id != _topics("DEFAULT_CONSUMER_GROUP")
        assert str(settings.db) == str(ctx.params["db"])


def test_workers_and_store_use_the_same_kafka() -> None:
    for source in ("compose", "k8s"):
        servers = {c.env.get("KAFKA_BOOTSTRAP_SERVERS") for c in _all_containers()
                   if c.source == source and (c.is_gradstream or c in _topic_creators())}
        assert len(servers) == 1 and None not in servers, f"{source}: {servers}"


def test_producer_messages_fit_the_compose_brokers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message of the producer's default max_request_size is accepted and replicated."""
    from producer.settings import ProducerSettings

    largest = _settings_from_env(ProducerSettings, {}, monkeypatch).max_request_size
    for name, svc in _brokers().items():
        env = _compose_env(svc)
        assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) >= largest, name
        assert int(env["KAFKA_REPLICA_FETCH_MAX_BYTES"]) >= largest, name


# ----------------------------------------------------------------------------- topics


@pytest.mark.parametrize("creator", _topic_creators(), ids=lambda c: c.where)
def test_topics_created_match_the_code(creator: Container) -> None:
    commands = [c for c in _topic_commands(creator) if c.get("--create")]
    expected = {
        _topics(n) for n in (
            "DEFAULT_SUMMARIES_TOPIC", "DEFAULT_FRAMES_TOPIC", "DEFAULT_DLQ_TOPIC",
            "DEFAULT_ALERTS_TOPIC",
        )
    }
    created = [c["--topic"] for c in commands]
    assert sorted(created) == sorted(expected), created
    workers = _workers(creator.source)
    worker_env = workers[0].env
    total_workers = sum(w.replicas for w in workers)
    for cmd in commands:
        topic = cmd["--topic"]
        assert cmd.get("--if-not-exists") is True, f"{topic}: re-runs must not fail"
        assert cmd["--bootstrap-server"] == worker_env["KAFKA_BOOTSTRAP_SERVERS"], topic
        partitions = int(cmd["--partitions"])
        assert partitions == int(worker_env["GRADSTREAM_PARTITIONS"]), topic
        assert partitions >= total_workers, (
            f"{topic}: {partitions} partitions < {total_workers} workers (some would idle)"
        )
        rf = int(cmd["--replication-factor"])
        assert rf == EXPECTED_REPLICATION_FACTOR == int(worker_env["GRADSTREAM_REPLICATION_FACTOR"])


def test_there_are_topic_creators_in_compose_and_k8s() -> None:
    assert sorted(c.source for c in _topic_creators()) == ["compose", "k8s"]
    (job,) = [c for c in _topic_creators() if c.source == "k8s"]
    assert job.spec["kind"] == "Job"
    assert job.spec["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")


def test_compose_start_order() -> None:
    services = _compose()["services"]
    (creator,) = [c for c in _topic_creators() if c.source == "compose"]
    creator_name = creator.where.split(":")[1]
    brokers = _brokers()
    depends = services[creator_name]["depends_on"]
    for broker in brokers:
        assert depends[broker]["condition"] == "service_healthy", broker
        assert "healthcheck" in services[broker], broker
    assert services[creator_name].get("restart") == "no"
    for c in _gradstream_containers():
        if c.source == "compose":
            cond = c.spec["depends_on"][creator_name]["condition"]
            assert cond == "service_completed_successfully", c.where


# ----------------------------------------------------------------------------- KRaft


def test_compose_has_three_kraft_brokers_with_consistent_quorum() -> None:
    brokers = _brokers()
    assert len(brokers) == EXPECTED_BROKERS, sorted(brokers)
    envs = {name: _compose_env(svc) for name, svc in brokers.items()}
    node_ids = {name: int(env["KAFKA_NODE_ID"]) for name, env in envs.items()}
    assert len(set(node_ids.values())) == len(node_ids), f"node ids not unique: {node_ids}"

    cluster_ids = {env["CLUSTER_ID"] for env in envs.values()}
    assert len(cluster_ids) == 1, cluster_ids
    (cluster_id,) = cluster_ids
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16, "CLUSTER_ID: 16-byte UUID"

    voters_values = {env["KAFKA_CONTROLLER_QUORUM_VOTERS"] for env in envs.values()}
    assert len(voters_values) == 1, voters_values
    voters = {}
    for voter in voters_values.pop().split(","):
        node, _, address = voter.partition("@")
        host, _, port = address.rpartition(":")
        voters[int(node)] = (host, int(port))
    assert set(voters) == set(node_ids.values()), "every node must be a quorum voter"

    for name, env in envs.items():
        svc = brokers[name]
        hostname = svc.get("hostname", name)
        roles = set(env["KAFKA_PROCESS_ROLES"].split(","))
        assert roles == {"broker", "controller"}, f"{name}: combined nodes expected"
        listeners = _listeners(env["KAFKA_LISTENERS"])
        protocol_map = env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
        protocols = dict(p.split(":") for p in protocol_map.split(","))
        assert set(listeners) <= set(protocols), f"{name}: listener without a protocol"
        controller_names = env["KAFKA_CONTROLLER_LISTENER_NAMES"].split(",")
        controller_ports = {listeners[n][1] for n in controller_names}
        host, port = voters[node_ids[name]]
        assert host in (hostname, name) and port in controller_ports, (
            f"{name}: voter {host}:{port} is not its controller listener {controller_ports}"
        )
        advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
        assert set(advertised) <= set(listeners) - set(controller_names), name
        inter = env["KAFKA_INTER_BROKER_LISTENER_NAME"]
        assert advertised[inter] == (hostname, listeners[inter][1]), name
        # Published ports: host port -> container port of a listener advertised as localhost.
        for mapping in svc.get("ports", []):
            host_port, _, container_port = str(mapping).rpartition(":")
            (listener,) = [n for n, (_, p) in listeners.items() if p == int(container_port)]
            assert advertised[listener] == ("localhost", int(host_port)), f"{name}: {mapping}"
        log_dir = env["KAFKA_LOG_DIRS"]
        assert any(str(v).split(":", 1)[1] == log_dir for v in svc.get("volumes", [])), (
            f"{name}: {log_dir} is not on a volume"
        )
        health = " ".join(svc["healthcheck"]["test"])
        assert f"localhost:{listeners[inter][1]}" in health, f"{name}: healthcheck port"

        rf = int(env["KAFKA_DEFAULT_REPLICATION_FACTOR"])
        min_isr = int(env["KAFKA_MIN_INSYNC_REPLICAS"])
        assert rf == EXPECTED_REPLICATION_FACTOR and 1 <= min_isr < rf, name
        assert int(env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"]) == rf, name
        assert int(env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"]) == rf, name
        assert int(env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"]) < rf, name

    # gradstream reaches every broker through its inter-broker (in-network) listener.
    inter_addresses = set()
    for env in envs.values():
        inter = env["KAFKA_INTER_BROKER_LISTENER_NAME"]
        host, port = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])[inter]
        inter_addresses.add(f"{host}:{port}")
    for c in _all_containers():
        if c.source == "compose" and "KAFKA_BOOTSTRAP_SERVERS" in c.env:
            assert set(c.env["KAFKA_BOOTSTRAP_SERVERS"].split(",")) == inter_addresses, c.where


# ----------------------------------------------------------------------------- store volume


def test_compose_store_writes_duckdb_on_a_named_volume() -> None:
    store = _store("compose")
    db = PurePosixPath(str(_parse(store.args, store.where).params["db"]))
    named = _compose().get("volumes") or {}
    mounts = {}
    for v in store.spec.get("volumes", []):
        source, _, target = str(v).partition(":")
        mounts[target.split(":")[0]] = source
    assert str(db.parent) in mounts, f"{db.parent} is not a mount of {store.where}"
    assert mounts[str(db.parent)] in named, "the DuckDB directory must be a named volume"


def test_k8s_store_is_a_statefulset_with_a_volume_claim() -> None:
    store = _store("k8s")
    sts = store.spec
    assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] == 1
    db = PurePosixPath(str(_parse(store.args, store.where).params["db"]))
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts.get(str(db.parent)) in claims, f"{db.parent} is not on a volumeClaimTemplate"
    _, gid = _dockerfile_user()
    assert sts["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == gid
    services = {s["metadata"]["name"]: s for s in _k8s("Service")}
    governing = services[sts["spec"]["serviceName"]]
    assert governing["spec"].get("clusterIP") == "None"


def test_k8s_workers_are_a_deployment_within_the_partition_count() -> None:
    (worker,) = _workers("k8s")
    assert worker.spec["kind"] == "Deployment"
    assert 1 <= worker.replicas <= int(worker.env["GRADSTREAM_PARTITIONS"])
    text = (K8S_DIR / "worker-deployment.yaml").read_text()
    assert "GRADSTREAM_PARTITIONS" in text.split("kind: Deployment")[0], (
        "say in a comment that replicas may be raised up to the partition count"
    )


# ----------------------------------------------------------------------------- k8s objects


def test_k8s_pods_run_as_the_image_user_and_select_their_labels() -> None:
    uid, gid = _dockerfile_user()
    for c in _gradstream_containers():
        if c.source != "k8s":
            continue
        template = c.spec["spec"]["template"]
        ctx = template["spec"]["securityContext"]
        assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["runAsNonRoot"]) == (uid, gid, True)
        selector = c.spec["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), c.where


@pytest.mark.parametrize("container", _gradstream_containers(), ids=lambda c: c.where)
def test_metrics_port_is_exposed_and_scraped(container: Container) -> None:
    port = int(container.env["GRADSTREAM_METRICS_PORT"])
    assert int(_parse(container.args, container.where).params["metrics_port"]) == port
    if container.source == "compose":
        exposed = {str(p).split(":")[-1] for p in container.spec.get("expose", [])}
        exposed |= {str(p).split(":")[-1] for p in container.spec.get("ports", [])}
        assert str(port) in exposed, container.where
        return
    template = container.spec["spec"]["template"]
    (spec,) = [
        c for c in template["spec"]["containers"] if c["image"] == container.image
    ]
    named = {p["name"]: p["containerPort"] for p in spec["ports"]}
    assert named.get("metrics") == port, container.where
    labels = template["metadata"]["labels"]
    services = [
        s for s in _k8s("Service") if s["spec"]["selector"].items() <= labels.items()
    ]
    assert services, f"{container.where}: no Service selects its pods"
    for svc in services:
        (svc_port,) = svc["spec"]["ports"]
        assert svc_port["port"] == port and svc_port["targetPort"] in ("metrics", port)
        notes = svc["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert notes["prometheus.io/port"] == str(port)


def test_k8s_objects_share_the_namespace_and_kustomization_lists_every_file() -> None:
    (namespace,) = _k8s("Namespace")
    name = namespace["metadata"]["name"]
    for file, doc in _k8s_docs():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == name, f"{file}: {doc['metadata']['name']}"
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == name
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


# ----------------------------------------------------------------------------- Iceberg team shape
# deploy/docker-compose.iceberg.yml (an override of docker-compose.yml) and deploy/k8s/iceberg/
# (a kustomization of the base's files but the DuckDB store, and its own): PostgreSQL catalog,
# S3-compatible object store, several Iceberg stores, the maintenance job.

ICEBERG_COMPOSE_FILE = DEPLOY / "docker-compose.iceberg.yml"
ICEBERG_K8S_DIR = K8S_DIR / "iceberg"
SEQUENCES_REPLACED = ("command", "entrypoint")
"""Compose override keys whose sequences replace the base's (Compose Specification, "Merge
and override"); other sequences are appended, mappings merged key by key."""


def _compose_merge(base: Any, override: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for k, v in override.items():
            merged[k] = _compose_merge(base[k], v, k) if k in base else v
        return merged
    if isinstance(base, list) and isinstance(override, list) and key not in SEQUENCES_REPLACED:
        return base + [v for v in override if v not in base]
    return override


@cache
def _iceberg_compose() -> dict[str, Any]:
    """docker-compose.yml with docker-compose.iceberg.yml over it (`-f` both)."""
    return _compose_merge(_compose(), yaml.safe_load(ICEBERG_COMPOSE_FILE.read_text()))


@cache
def _iceberg_k8s() -> tuple[dict[str, Any], ...]:
    """The documents deploy/k8s/iceberg/kustomization.yaml lists, in its namespace."""
    kustomization = yaml.safe_load((ICEBERG_K8S_DIR / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        path = ICEBERG_K8S_DIR / resource
        assert path.is_file(), f"deploy/k8s/iceberg: resource {resource} is not a file"
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return tuple(docs)


def _iceberg_containers() -> list[Container]:
    """Every container of the team shape: compose services not in a profile, or in the
    profile `maintenance`; every k8s workload."""
    compose = _iceberg_compose()
    active = {"services": {n: s for n, s in compose["services"].items()
                           if set(s.get("profiles", [])) <= {"maintenance"}}}
    return _compose_containers(active) + _k8s_containers(list(_iceberg_k8s()))


def _iceberg_gradstream() -> list[Container]:
    """The shape's own gradstream processes (stores, maintenance): the workers are the
    base's, checked above."""
    return [c for c in _iceberg_containers() if c.is_gradstream and c.subcommand != "consume"]


def _iceberg_stores(source: str) -> list[Container]:
    return [c for c in _iceberg_gradstream() if c.source == source and c.subcommand == "store"]


def _iceberg_one(source: str, image_repo: str) -> list[Container]:
    return [c for c in _iceberg_containers()
            if c.source == source and c.image.split(":")[0].endswith(image_repo)]


def test_iceberg_kustomization_is_the_base_without_the_duckdb_store_plus_its_files() -> None:
    kustomization = yaml.safe_load((ICEBERG_K8S_DIR / "kustomization.yaml").read_text())
    base = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert {r[3:] for r in listed if r.startswith("../")} == set(base["resources"]) - {
        "store-statefulset.yaml"}
    own = {p.name for p in ICEBERG_K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert {r for r in listed if not r.startswith("../")} == own
    assert kustomization["namespace"] == base["namespace"]
    assert kustomization["images"] == base["images"]
    for doc in _iceberg_k8s():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == base["namespace"], doc["metadata"]
    names = [(d["kind"], d["metadata"]["name"]) for d in _iceberg_k8s()]
    assert len(names) == len(set(names)), "a kind/name twice"
    assert ("StatefulSet", "gradstream-store") not in names


def test_compose_iceberg_shape_replaces_the_duckdb_store() -> None:
    services = _iceberg_compose()["services"]
    assert services["store"].get("profiles") == ["duckdb"], "the DuckDB store still starts"
    assert services["maintain"].get("profiles") == ["maintenance"]
    assert services["maintain"].get("restart") == "no"
    named = _iceberg_compose().get("volumes") or {}
    for name in ("catalog", "object-store"):
        sources = [str(v).split(":")[0] for v in services[name].get("volumes", [])]
        assert sources and all(s in named for s in sources), f"{name}: not on a named volume"


@pytest.mark.parametrize("container", _iceberg_gradstream(), ids=lambda c: c.where)
def test_iceberg_commands_and_environment_load_into_the_settings(
    container: Container, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for the base: real subcommands and options, every variable a setting of the
    process (or a standard AWS variable the Iceberg output reads), flags agreeing with it."""
    from schemas.iceberg_catalog import S3_ENVIRONMENT

    assert container.entrypoint is None, container.where
    assert container.subcommand in SETTINGS_OF, container.args
    ctx = _parse(container.args, container.where)
    settings_class = _settings_class(container.subcommand)
    allowed = _env_names(settings_class) | set(S3_ENVIRONMENT)
    unknown = sorted(k for k in container.env if k.upper() not in allowed)
    assert not unknown, f"{container.where}: not settings of {container.subcommand}: {unknown}"
    gradstream_env = {k: v for k, v in container.env.items() if k not in S3_ENVIRONMENT}
    settings = _settings_from_env(settings_class, gradstream_env, monkeypatch)
    for name, value in ctx.params.items():
        if ctx.get_parameter_source(name).name == "COMMANDLINE" and name in type(
                settings).model_fields:
            assert str(getattr(settings, name)) == str(value), (container.where, name)
    assert settings.iceberg_catalog.startswith("postgresql+psycopg2://"), container.where
    assert settings.iceberg_warehouse.startswith("s3://"), container.where
    assert set(S3_ENVIRONMENT) - {"AWS_SESSION_TOKEN"} <= set(container.env), container.where
    if container.subcommand == "store":
        assert settings.store_output == "iceberg", container.where
        assert settings.group_id == _topics("DEFAULT_STORE_GROUP")
        assert settings.frames_topic == _topics("DEFAULT_FRAMES_TOPIC")
        assert settings.assigned_partitions, f"{container.where}: reads every partition"


def test_iceberg_stores_share_the_partitions_and_the_tables() -> None:
    """Each source runs several stores, one process each, reading disjoint partitions that
    together are every partition of the topics; every gradstream process of the shape uses
    the same Kafka, catalog, warehouse and namespace."""
    for source in ("compose", "k8s"):
        stores = _iceberg_stores(source)
        assert len(stores) >= 2, f"{source}: one store is not the team shape"
        partitions = int(_workers(source)[0].env["GRADSTREAM_PARTITIONS"])
        read = [int(p) for s in stores for p in s.env["GRADSTREAM_ASSIGNED_PARTITIONS"].split(",")]
        assert sorted(read) == list(range(partitions)), f"{source}: partitions read {read}"
        for store in stores:
            assert store.replicas == 1, f"{store.where}: two processes would read the same"
            if source == "k8s":
                assert store.spec["kind"] == "StatefulSet", store.where
        kafka = {_workers(source)[0].env["KAFKA_BOOTSTRAP_SERVERS"]} | {
            s.env["KAFKA_BOOTSTRAP_SERVERS"] for s in stores}
        assert len(kafka) == 1, f"{source}: {kafka}"
        tables = {tuple(c.env.get(k) for k in ("GRADSTREAM_ICEBERG_CATALOG",
                                                "GRADSTREAM_ICEBERG_WAREHOUSE",
                                                "GRADSTREAM_ICEBERG_NAMESPACE",
                                                "AWS_ENDPOINT_URL"))
                  for c in _iceberg_gradstream() if c.source == source}
        assert len(tables) == 1, f"{source}: processes disagree on the tables: {tables}"


def test_iceberg_catalog_and_object_store_match_the_urls() -> None:
    """The catalog URL names the PostgreSQL service with its user, password and database;
    the S3 endpoint is the MinIO service, the keys its root user; the bucket the one-shot
    creates is the warehouse's."""
    from sqlalchemy.engine import make_url

    services = {s["metadata"]["name"]: s for s in _iceberg_k8s() if s["kind"] == "Service"}
    for source in ("compose", "k8s"):
        (store, *_) = _iceberg_stores(source)
        url = make_url(store.env["GRADSTREAM_ICEBERG_CATALOG"])
        (postgres,) = _iceberg_one(source, "postgres")
        minio, bucket_job = sorted(_iceberg_one(source, "minio/minio"),
                                   key=lambda c: "mb" in c.args)
        endpoint = store.env["AWS_ENDPOINT_URL"]
        if source == "compose":
            assert url.host == postgres.where.split(":")[1] and url.port == 5432
            assert endpoint == f"http://{minio.where.split(':')[1]}:9000"
        else:
            for host, port, target in ((url.host, url.port, postgres),
                                       *[(h, int(p), minio) for h, p in
                                         [endpoint.removeprefix("http://").split(":")]]):
                service = services[host]
                (svc_port,) = service["spec"]["ports"]
                labels = _pod_template(target.spec)["metadata"]["labels"]
                assert svc_port["port"] == port and service["spec"]["selector"].items() <= (
                    labels.items()), f"Service {host} does not reach {target.where}"
        assert (url.drivername, url.username, url.password, url.database) == (
            "postgresql+psycopg2", postgres.env["POSTGRES_USER"],
            postgres.env["POSTGRES_PASSWORD"], postgres.env["POSTGRES_DB"]), source
        assert (store.env["AWS_ACCESS_KEY_ID"], store.env["AWS_SECRET_ACCESS_KEY"]) == (
            minio.env["MINIO_ROOT_USER"], minio.env["MINIO_ROOT_PASSWORD"]), source
        assert bucket_job.args[-3:-1] == ["mb", "--ignore-existing"]
        alias, _, bucket = bucket_job.args[-1].partition("/")
        scheme, _, rest = endpoint.partition("://")
        keys = f"{minio.env['MINIO_ROOT_USER']}:{minio.env['MINIO_ROOT_PASSWORD']}"
        assert bucket_job.env[f"MC_HOST_{alias}"] == f"{scheme}://{keys}@{rest}", source
        warehouse = store.env["GRADSTREAM_ICEBERG_WAREHOUSE"]
        assert warehouse.removeprefix("s3://").split("/")[0] == bucket, source


def test_iceberg_images_are_pinned_and_the_same_in_compose_and_k8s() -> None:
    """gradstream's image is the Dockerfile's, which installs the PostgreSQL driver; every
    other image has a release tag, the same in both shapes."""
    image = _gradstream_image()
    images = {source: {c.image for c in _iceberg_containers() if c.source == source}
              for source in ("compose", "k8s")}
    assert images["compose"] == images["k8s"], images
    for name in images["k8s"]:
        repo, _, tag = name.rpartition(":")
        assert repo and tag and tag != "latest", name
    assert image in images["k8s"]
    extras = [t for v in _docker_values("RUN") for t in shlex.split(v) if t.startswith(".[")]
    installed = {e for t in extras for e in t[2:-1].split(",")}
    optional = _pyproject()["project"]["optional-dependencies"]
    assert any("sql-postgres" in dep for e in installed for dep in optional[e]), installed


def test_iceberg_store_metrics_are_exposed_and_scraped() -> None:
    services = [s for s in _k8s("Service")]
    for store in [*_iceberg_stores("compose"), *_iceberg_stores("k8s")]:
        port = int(store.env["GRADSTREAM_METRICS_PORT"])
        assert int(_parse(store.args, store.where).params["metrics_port"]) == port
        if store.source == "compose":
            assert str(port) in {str(p) for p in store.spec.get("expose", [])}, store.where
            assert not store.spec.get("ports"), f"{store.where}: replicas share no host port"
            continue
        template = _pod_template(store.spec)
        (spec,) = template["spec"]["containers"]
        assert {p["name"]: p["containerPort"] for p in spec["ports"]}["metrics"] == port
        selecting = [s for s in services
                     if s["spec"]["selector"].items() <= template["metadata"]["labels"].items()]
        assert selecting, f"{store.where}: no metrics Service selects its pod"
        for svc in selecting:
            assert svc["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        assert store.spec["spec"]["serviceName"] in {s["metadata"]["name"] for s in selecting}


def test_iceberg_start_order_and_maintenance_schedule() -> None:
    services = _iceberg_compose()["services"]
    for store in _iceberg_stores("compose"):
        depends = store.spec["depends_on"]
        assert depends["kafka-topics"]["condition"] == "service_completed_successfully"
        assert depends["catalog"]["condition"] == "service_healthy"
        assert depends["object-store-bucket"]["condition"] == "service_completed_successfully"
    assert services["object-store-bucket"]["restart"] == "no"
    assert services["object-store-bucket"]["depends_on"]["object-store"]["condition"] == (
        "service_healthy")
    for name in ("catalog", "object-store"):
        assert services[name]["healthcheck"]["test"], name
    uid, gid = _dockerfile_user()
    (cron,) = [d for d in _iceberg_k8s() if d["kind"] == "CronJob"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert len(cron["spec"]["schedule"].split()) == 5
    pod = _pod_template(cron)["spec"]
    assert pod["restartPolicy"] in ("OnFailure", "Never")
    (container,) = pod["containers"]
    assert container["args"][0] == "maintain"
    for doc in _iceberg_k8s():
        if doc["kind"] in ("StatefulSet", "CronJob") and _pod_template(doc)["spec"][
                "containers"][0]["image"] == _gradstream_image():
            ctx = _pod_template(doc)["spec"]["securityContext"]
            assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["runAsNonRoot"]) == (uid, gid, True)
