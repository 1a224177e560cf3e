"""Per-row gradient flags: one definition of each flag bit and of its SQL predicate.

A ``layer_stats`` row (one layer at one step) carries the flags the consumer computed when it
built the frame (``consumer.frames``, the reference's rule: trustformers-debug
``gradient_flow``): ``is_vanishing`` (mean |g| below the run's vanishing threshold, or the
RMS in norms mode, and no NaN/Inf element), ``is_exploding`` (max |g| above the exploding
threshold, or the RMS in norms mode) and ``nonfinite`` (count of NaN/Inf elements). Every
reader of the store (the report, the analyses, the plots, the dashboard) takes a row's
flags from those stored columns through :func:`predicate` / :func:`flag_bits_sql`, never
from its own threshold test, so that ``gradstream report`` and ``gradstream analyze`` agree
on which layers vanish, explode or hold NaN/Inf. The consumer's alerts read the same flags
from the frame (``GradientFrame.is_vanishing`` ...), before they are stored.

Bits (a ``uint8`` bit set; the dashboard's JavaScript receives :data:`FLAG_BITS`):

- :data:`FLAG_VANISHING` = 1, :data:`FLAG_EXPLODING` = 2, :data:`FLAG_NONFINITE` = 4: the
  stored flags above (a grid cell has the bit when any row of the cell has it);
- :data:`FLAG_NO_DATA` = 8: a grid cell without any row (plots only);
- :data:`FLAG_ZERO` = 16: a grid cell whose largest gradient norm is exactly 0 (plots only);
- :data:`FLAG_DEAD` = 32: a row with ``nonfinite = 0`` and ``grad_norm = 0``, every gradient
  element exactly zero (analyses only).
"""

from __future__ import annotations

FLAG_VANISHING = 1
"""The row's stored ``is_vanishing``."""
FLAG_EXPLODING = 2
"""The row's stored ``is_exploding``."""
FLAG_NONFINITE = 4
"""``nonfinite > 0``: some gradient element was NaN or +-Inf."""
FLAG_NO_DATA = 8
"""Grid cell: the layer has no ``layer_stats`` row in the cell's frames."""
FLAG_ZERO = 16
"""Grid cell: the cell's largest gradient norm is exactly 0 (log10 undefined)."""
FLAG_DEAD = 32
"""``nonfinite = 0`` and ``grad_norm = 0``: every gradient element exactly zero."""
FLAG_ISSUE = FLAG_VANISHING | FLAG_EXPLODING | FLAG_NONFINITE | FLAG_DEAD
"""A row the analyses count as an issue: any of the row flags."""

FLAG_BITS: dict[str, int] = {
    "VANISHING": FLAG_VANISHING, "EXPLODING": FLAG_EXPLODING, "NONFINITE": FLAG_NONFINITE,
    "NO_DATA": FLAG_NO_DATA, "ZERO": FLAG_ZERO, "DEAD": FLAG_DEAD,
}
"""Every bit by name: sent as ``flag_bits`` with the dashboard's config and the animation's
data, where ``heatmap.js`` takes it (``GradHeatmap.useFlagBits``) as its ``FLAG`` table."""

_PREDICATES: dict[str, str] = {
    "vanishing": "{row}is_vanishing",
    "exploding": "{row}is_exploding",
    "nonfinite": "{row}nonfinite > 0",
    "dead": "({row}nonfinite = 0 AND {row}grad_norm = 0)",
}


def predicate(flag: str, row: str = "") -> str:
    """The SQL boolean of one row flag over ``layer_stats`` columns.

    Args:
        flag: ``"vanishing"``, ``"exploding"``, ``"nonfinite"`` or ``"dead"``.
        row: table alias of the ``layer_stats`` row (``"s"`` gives ``s.is_vanishing``);
            empty for bare column names.

    Returns:
        A parenthesisable SQL expression (BOOLEAN).

    Raises:
        KeyError: unknown flag.
    """
    return _PREDICATES[flag].format(row=f"{row}." if row else "")


def flag_bits_sql(row: str = "") -> str:
    """SQL ``UTINYINT`` bit set of a ``layer_stats`` row: :data:`FLAG_VANISHING`,
    :data:`FLAG_EXPLODING`, :data:`FLAG_NONFINITE` and :data:`FLAG_DEAD` (``row`` as in
    :func:`predicate`)."""
    terms = " + ".join(
        f"CASE WHEN {predicate(name, row)} THEN {bit} ELSE 0 END"
        for name, bit in (("vanishing", FLAG_VANISHING), ("exploding", FLAG_EXPLODING),
                          ("nonfinite", FLAG_NONFINITE), ("dead", FLAG_DEAD))
    )
    return f"({terms})::UTINYINT"
