"""The sidecar file by which a process serving reads of its store advertises itself.

``<db>.serve.json`` (e.g. ``gradstream.duckdb.serve.json``) holds the server's URL, its
process id and host, the ``gradstream`` command it runs, the store's absolute path, and the
token every route of the server requires (scripts send ``Authorization: Bearer <token>``,
a browser opens :func:`dashboard_url`). It is
written atomically with mode 0600 (only the store's owner can read the token) once the
server listens, and removed when the server stops. :func:`read_sidecar` ignores a
sidecar whose process is gone (a server that was killed) or that names another file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SUFFIX = ".serve.json"
"""Appended to the store's file name."""


@dataclass(frozen=True)
class ServeInfo:
    """Contents of a sidecar.

    Attributes:
        url: base URL, e.g. ``http://127.0.0.1:8765``.
        pid: process id of the server; host: its host name.
        db: absolute path of the store it owns.
        token: the secret every route of the server requires.
        writer: whether the server also writes the store (runs the consumer worker).
        started_at: unix time (s) the server started listening.
        command: the ``gradstream`` command of the process (``serve``, ``consume``,
            ``store``, ``demo``), shown to users whose reads go through it.
    """

    url: str
    pid: int
    host: str
    db: str
    token: str
    writer: bool
    started_at: float
    command: str = "serve"

    @property
    def dashboard_url(self) -> str:
        """The URL that opens the dashboard with the token (:func:`dashboard_url`)."""
        return dashboard_url(self.url, self.token)


def sidecar_path(db: str | os.PathLike[str]) -> Path:
    """``<db>.serve.json`` for the store ``db``."""
    path = Path(db)
    return path.with_name(path.name + SUFFIX)


TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~-]+")
"""Characters a token may have: unreserved in a URL and plain in a cookie, so
``/?token=<token>`` and the cookie carry it unquoted (those of
:func:`secrets.token_urlsafe`)."""

MIN_TOKEN_LENGTH = 16
"""Shortest token a user may choose (:func:`check_token`); :func:`new_token` makes 43."""


def new_token() -> str:
    """A random URL-safe token (32 bytes from :mod:`secrets`, 43 characters)."""
    return secrets.token_urlsafe(32)


def check_token(token: str) -> str:
    """``token`` when it can serve as a server's token (chosen by a user, e.g.
    ``GRADSTREAM_TOKEN``): at least :data:`MIN_TOKEN_LENGTH` characters of
    :data:`TOKEN_CHARS`.

    Raises:
        ValueError: too short or another character; the message says how to make one.
    """
    if len(token) < MIN_TOKEN_LENGTH or not TOKEN_CHARS.fullmatch(token):
        raise ValueError(
            f"a token needs at least {MIN_TOKEN_LENGTH} characters of A-Z a-z 0-9 . _ ~ - "
            "(make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'), "
            "or leave it unset for a random one")
    return token


def dashboard_url(url: str, token: str) -> str:
    """The URL that opens the dashboard at base ``url`` and lets the browser in:
    ``<url>/?token=<token>`` (the page sets a cookie and drops the token from the
    address; see :mod:`analysis.dashboard.server`)."""
    return f"{url}/?token={token}"


def write_sidecar(
    db: str | os.PathLike[str], url: str, token: str, writer: bool, command: str = "serve"
) -> Path:
    """Write the sidecar of this process for store ``db`` (atomic rename, mode 0600).

    Args:
        db: the store; url: where the server answers; token: its secret;
        writer: whether this process writes the store; command: the ``gradstream``
        command it runs (see :class:`ServeInfo`).

    Returns:
        The sidecar's path.

    Raises:
        OSError: the directory is not writable.
    """
    target = sidecar_path(db)
    info = ServeInfo(
        url=url, pid=os.getpid(), host=socket.gethostname(), db=str(Path(db).resolve()),
        token=token, writer=writer, started_at=time.time(), command=command,
    )
    temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(asdict(info), fh, indent=2)
    os.replace(temp, target)
    return target


def remove_sidecar(db: str | os.PathLike[str]) -> None:
    """Delete this process's sidecar of ``db`` (a sidecar of another process is kept)."""
    target = sidecar_path(db)
    info = _load(target)
    if info is not None and info.pid == os.getpid() and info.host == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            target.unlink()


def _load(path: Path) -> ServeInfo | None:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return ServeInfo(**raw)
    except (OSError, ValueError, TypeError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie (its state in
    ``/proc/<pid>/stat``, where ``/proc`` tells). A process of another user counts as
    alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
        return not stat[stat.rindex(")") + 2 :].startswith("Z")
    except (OSError, ValueError):
        return True


def read_sidecar(db: str | os.PathLike[str]) -> ServeInfo | None:
    """The live server of store ``db``, or ``None``.

    ``None`` when there is no readable sidecar, it names another store file, or its process
    (on this host) no longer exists. A sidecar from another host is trusted as is.
    """
    info = _load(sidecar_path(db))
    if info is None:
        return None
    if Path(info.db) != Path(db).resolve():
        return None
    if info.host == socket.gethostname() and not pid_alive(info.pid):
        return None
    return info
