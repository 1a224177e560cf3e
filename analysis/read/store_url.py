"""Store URLs: a store given as ``<scheme>+<URL>`` instead of a DuckDB file's path.

A store is named either by the path of its DuckDB file or by a URL whose scheme starts with
a registered store kind and a ``+``, as SQLAlchemy writes ``dialect+driver://`` (RFC 3986
allows ``+`` in a scheme): ``iceberg+sqlite:////abs/catalog.db?warehouse=file:///abs/wh``
names an Apache Iceberg table set (:mod:`analysis.read.iceberg`). :data:`STORE_URL_SCHEMES`
maps each kind to the function that opens its reader, one line per kind; every reader of
the store (:func:`analysis.read.reader.open_reader`, the notebook's ``Store``, the CLI's
``--db``) asks :func:`store_url_scheme` whether a name is such a URL.

Loading this module loads nothing but the standard library: the reader of a kind is
imported when a URL of that kind is opened (the CLI's option parser imports it to tell a
URL from a path).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from analysis.read.reader import StoreReader

_URL = re.compile(r"(?P<kind>[A-Za-z][A-Za-z0-9.-]*)\+[A-Za-z][A-Za-z0-9+.-]*://")
"""``<kind>+<scheme>://``: the beginning of a store URL (RFC 3986 scheme characters, the
first ``+`` ending the store kind)."""


def _open_iceberg(url: str, timeout_s: float | None) -> StoreReader:
    """An :class:`analysis.read.iceberg.IcebergReader` of ``url``."""
    from analysis.read.iceberg import IcebergReader

    return IcebergReader(url, timeout_s)


STORE_URL_SCHEMES: dict[str, Callable[[str, float | None], StoreReader]] = {
    "iceberg": _open_iceberg,
}
"""Store kind (the URL scheme before ``+``) -> the function that opens a reader of a URL of
that kind (``url``, ``timeout_s``; it raises ``StoreError`` with what to do). Add a line to
read another kind of store."""


def store_url_scheme(db: str | os.PathLike[str]) -> str | None:
    """The store kind of ``db`` when it is a store URL (``<kind>+<scheme>://...``), else
    None (a DuckDB file's path; a ``pathlib.Path`` is always a path).

    Raises:
        StoreError: ``db`` has the form of a store URL but its kind is not registered in
            :data:`STORE_URL_SCHEMES` (the message lists the kinds).
    """
    if not isinstance(db, str):
        return None
    match = _URL.match(db)
    if match is None:
        return None
    kind = match.group("kind").lower()
    if kind not in STORE_URL_SCHEMES:
        from analysis.read.connect import StoreError

        raise StoreError(
            f"the store URL kind {kind!r} (before the '+') is unknown; known: "
            f"{', '.join(f'{k}+...' for k in STORE_URL_SCHEMES)} (a DuckDB store is given by "
            "its file's path)"
        )
    return kind


def open_url_reader(url: str, timeout_s: float | None = None) -> StoreReader:
    """The reader of the store URL ``url`` (:data:`STORE_URL_SCHEMES`).

    Raises:
        StoreError: ``url`` is not a store URL of a registered kind, or its reader cannot
            open it (the message says what to do).
    """
    kind = store_url_scheme(url)
    if kind is None:
        from analysis.read.connect import StoreError

        raise StoreError(f"{url!r} is not a store URL (<kind>+<scheme>://...)")
    return STORE_URL_SCHEMES[kind](url, timeout_s)
