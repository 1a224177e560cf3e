"""Which layers a producer watches: fnmatch glob patterns on layer names."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable


def _patterns(value: str | Iterable[str] | None, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    out = tuple(value)
    for p in out:
        if not isinstance(p, str):
            raise TypeError(f"{what} patterns must be str, got {type(p).__name__}")
    return out


def select_names(
    names: Iterable[str],
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
) -> list[str]:
    """Filter layer names with fnmatch-style glob patterns (case-sensitive).

    Args:
        names: layer names (normalised), in model order.
        include: a pattern or patterns; when given, a name is kept only if it matches at
            least one (``None`` keeps every name). ``*`` matches across dots, e.g.
            ``"encoder.*"`` or ``"*.weight"``.
        exclude: a pattern or patterns; a name matching any of them is dropped (applied
            after ``include``).

    Returns:
        The kept names, in the input order.

    Raises:
        TypeError: a pattern is not a ``str``.
    """
    inc = _patterns(include, "include")
    exc = _patterns(exclude, "exclude")
    kept = []
    for name in names:
        if inc is not None and not any(fnmatch.fnmatchcase(name, p) for p in inc):
            continue
        if exc is not None and any(fnmatch.fnmatchcase(name, p) for p in exc):
            continue
        kept.append(name)
    return kept
