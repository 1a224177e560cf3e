"""Downloads from a running ``gradstream serve`` (for commands run while it holds the store).

While ``serve`` writes the store no other process can open it, so ``gradstream export``
asks the server instead: ``GET /api/export`` runs the same ``COPY`` in the serving process
(inside a read-only transaction) and streams the file back.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from analysis.dashboard.sidecar import ServeInfo
from analysis.store import StoreError

CHUNK = 1 << 20
"""Bytes read per write to the output file."""


def fetch_export(
    info: ServeInfo,
    run_id: str,
    fmt: str,
    path: str | os.PathLike[str],
    from_step: int | None = None,
    to_step: int | None = None,
    order: str = "name",
    progress: Callable[[float | None], None] | None = None,
    timeout_s: float = 600.0,
) -> int:
    """Export ``run_id`` through the server into ``path`` (parent directories created).

    Args:
        info: the server's sidecar.
        run_id / fmt / from_step / to_step / order: as :func:`analysis.export.export_run`.
        path: output file; written to ``<path>.part`` first, renamed when complete.
        progress: called with the fraction of bytes received (``None`` if unknown).
        timeout_s: socket timeout, seconds.

    Returns:
        Rows written (frames for ``json``), as counted by the server's ``COPY``.

    Raises:
        StoreError: the server refused (unknown run, bad range...) or is unreachable, or
            the file cannot be written.
    """
    query = {"run": run_id, "format": fmt, "order": order}
    if from_step is not None:
        query["from_step"] = str(from_step)
    if to_step is not None:
        query["to_step"] = str(to_step)
    url = f"{info.url}/api/export?{urllib.parse.urlencode(query)}"
    target = Path(path)
    part = target.with_name(target.name + ".part")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=timeout_s) as response, part.open("wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            rows = int(response.headers.get("X-Gradstream-Rows") or 0)
            done = 0
            while chunk := response.read(CHUNK):
                out.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done / total if total else None)
        os.replace(part, target)
    except urllib.error.HTTPError as exc:
        part.unlink(missing_ok=True)
        try:
            message = json.loads(exc.read().decode("utf-8"))["error"]
        except (ValueError, KeyError, UnicodeDecodeError):
            message = f"HTTP {exc.code} {exc.reason}"
        raise StoreError(str(message)) from None
    except (urllib.error.URLError, OSError) as exc:
        part.unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        raise StoreError(f"export through `gradstream serve` at {info.url} failed: {reason}") \
            from None
    if progress is not None:
        progress(1.0)
    return rows
