"""Colours shared by the PNGs, the HTML animation and the dashboard.

The gradient-norm scale is matplotlib's ``viridis`` (perceptually uniform, readable in
grey and by colour-blind readers; van der Walt & Smith, matplotlib 2.0). The browser pages
receive it as a table of hex colours sampled from matplotlib, so every picture uses the
same map. Flag colours are outside viridis's range (which runs purple -> green -> yellow)
so a marked cell cannot be mistaken for a norm.
"""

from __future__ import annotations

from functools import cache

NORM_CMAP = "viridis"
"""matplotlib colour map of log10 gradient norm."""

FLAG_COLORS: dict[str, str] = {
    "vanishing": "#4fc3f7",  # light blue: gradient too small
    "exploding": "#e53935",  # red: gradient too large
    "nonfinite": "#ff00ff",  # magenta: NaN/Inf elements
    "no_data": "#d9d9d9",  # light grey: layer absent from the frame
    "zero": "#000000",  # black: norm exactly 0 (log10 undefined)
}
"""Mark colours of flagged cells (keys match the FLAG_* bits of :mod:`analysis.plots.grid`)."""

LOSS_COLOR = "#1f77b4"
"""Colour of the loss curve above the heatmap (matplotlib's first cycle colour, ``tab:blue``:
no flag colour is near it, and viridis reaches blue only as a cell fill, never as a line)."""

HEALTH_COLORS: dict[str, str] = {
    "Healthy": "#2e7d32",
    "MinorIssues": "#f9a825",
    "ProblemsDetected": "#ef6c00",
    "Critical": "#c62828",
}
"""Badge colours of the run health classes (same hues as the terminal report)."""


@cache
def norm_palette(samples: int = 256) -> tuple[str, ...]:
    """``samples`` hex colours of :data:`NORM_CMAP`, from low to high, for the browser.

    Args:
        samples: table size (>= 2); 256 is matplotlib's own resolution of viridis.

    Returns:
        Tuple of ``"#rrggbb"`` strings.

    Raises:
        ValueError: ``samples`` < 2.
    """
    if samples < 2:
        raise ValueError(f"samples must be >= 2, got {samples}")
    import matplotlib
    import numpy as np
    from matplotlib.colors import to_hex

    cmap = matplotlib.colormaps[NORM_CMAP]
    return tuple(to_hex(c) for c in cmap(np.linspace(0.0, 1.0, samples)))
