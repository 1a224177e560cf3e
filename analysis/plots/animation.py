"""The gradient-flow animation (frames of per-layer flow intensity, step by step) as one
self-contained, offline HTML file.

The gradient-flow animator of trustformers-debug's ``gradient_flow`` module
(``GradientFlowAnimator``) records one *frame* per step (every layer's statistics
at that step) and renders the frames as an ASCII heatmap, step to the right and layer
down. Here the same frames play in a browser: a step slider and a play button move through
the frames; each frame shows every layer's flow intensity (``grad_norm / max_l grad_norm``
of the step, the ASCII rendering's bar length) coloured by log10 gradient norm, with vanishing,
exploding and non-finite layers marked; above it, the whole layers x steps heatmap with the
current frame outlined.

The file embeds its data (the :class:`~analysis.plots.grid.GradientGrid` as JSON) and its
JavaScript (``heatmap.js``, shared with the dashboard, and the page script); it loads
nothing from the network. A downsampled run says so in the page caption.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from analysis.plots.colors import FLAG_COLORS, norm_palette
from analysis.plots.grid import GradientGrid
from analysis.plots.page_json import page_json
from schemas.flags import FLAG_BITS

_JS_MARK = "/*__HEATMAP_JS__*/"
_DATA_MARK = "__DATA_JSON__"


def heatmap_js() -> str:
    """Source of the shared heatmap renderer (``analysis/plots/heatmap.js``)."""
    return resources.files("analysis.plots").joinpath("heatmap.js").read_text(encoding="utf-8")


def script_safe_json(value: object) -> str:
    """``value`` as JSON that can sit inside an HTML ``<script>`` element: ``<``, ``>`` and
    ``&`` are written as ``\\u003c``, ``\\u003e``, ``\\u0026`` (still the same JSON), so no
    layer name can close the element. Encoded by :func:`analysis.plots.page_json.page_json`
    (NumPy arrays as lists, non-finite floats as ``null``)."""
    text = page_json(value).decode("utf-8")
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_animation(grid: GradientGrid, title: str | None = None) -> str:
    """The animation page for ``grid`` as an HTML string.

    Args:
        grid: from :func:`analysis.plots.grid.load_grid` (its columns are the frames).
        title: page heading; default ``"Gradient flow animation: run <id>"``.

    Returns:
        A complete HTML document (UTF-8 text) with no external references.
    """
    template = resources.files("analysis.plots").joinpath("animation.html").read_text(
        encoding="utf-8"
    )
    data = {
        "title": title or f"Gradient flow animation: run {grid.run_id}",
        "grid": grid.to_json(),
        "palette": list(norm_palette()),
        "flag_colors": FLAG_COLORS,
        "flag_bits": FLAG_BITS,
    }
    head, rest = template.split(_JS_MARK, 1)
    middle, tail = rest.split(_DATA_MARK, 1)
    return head + heatmap_js() + middle + script_safe_json(data) + tail


def write_animation(
    grid: GradientGrid, path: str | os.PathLike[str], title: str | None = None
) -> Path:
    """Write :func:`render_animation` to ``path`` (UTF-8; parent directories created).

    Raises:
        OSError: the file cannot be written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_animation(grid, title), encoding="utf-8")
    return target
