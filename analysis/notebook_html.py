"""The Jupyter rendering of a run summary: HTML with the health badge, the flagged layers,
the recommendations and the heatmap as an inline PNG (its bytes from
:func:`analysis.plots.png.heatmap_png`; used by
:meth:`analysis.notebook.RunReport._repr_html_`)."""

from __future__ import annotations

import base64
import html

from analysis.blocks.terminal import more_suffix
from analysis.report import NAMES_IN_TABLE, GradientFlowSummary, summary_rows


def _names(names: list[str], limit: int = NAMES_IN_TABLE) -> str:
    """HTML of a list of layer names, ``limit`` shown, then "... and N more"."""
    if not names:
        return "none"
    shown = ", ".join(f"<code>{html.escape(name)}</code>" for name in names[:limit])
    return shown + more_suffix(len(names), limit)


def report_html(summary: GradientFlowSummary, heatmap: bytes | None = None,
                note: str = "") -> str:
    """HTML of a run summary for Jupyter: the health badge (``class="gradstream-health"``,
    colour of :data:`analysis.plots.colors.HEALTH_COLORS`), the rows the terminal report
    shows (:func:`analysis.report.summary_rows`: counts, flagged layers, exclusions, where
    NaN/Inf or an explosion started), the findings, the recommendations, then ``heatmap`` (PNG
    bytes) as an ``<img src="data:image/png;base64,...">``, or ``note`` when there is none.
    Every text from the store is HTML-escaped."""
    from analysis.plots.colors import HEALTH_COLORS

    health = summary.overall_health.value
    colour = HEALTH_COLORS.get(health, "#616161")
    badge = (f'<span class="gradstream-health" style="background:{colour};color:#fff;'
             f'padding:2px 8px;border-radius:10px;font-weight:600">{html.escape(health)}</span>')
    table = "".join(
        f'<tr><th style="text-align:left;padding-right:1em">{html.escape(row.label)}</th>'
        f'<td style="text-align:left">{html.escape(row.text)}'
        f'{"" if row.names is None else _names(row.names)}{html.escape(row.tail)}</td></tr>'
        for row in summary_rows(summary)
    )
    recommendations = "".join(f"<li>{html.escape(text)}</li>"
                              for text in summary.recommendations)
    findings = "".join(f"<li>{html.escape(text)}</li>" for text in summary.findings)
    picture = (
        f'<img src="data:image/png;base64,{base64.b64encode(heatmap).decode("ascii")}" '
        f'alt="gradient-norm heatmap of run {html.escape(summary.run_id)}" '
        'style="max-width:100%">'
        if heatmap is not None else (f"<p><em>{html.escape(note)}</em></p>" if note else "")
    )
    return (
        '<div class="gradstream-report">'
        f"<p><strong>gradient flow of run <code>{html.escape(summary.run_id)}</code></strong> "
        f"{badge}</p>"
        f"<table>{table}</table>"
        + (f"<p><strong>Findings</strong></p><ul>{findings}</ul>" if findings else "")
        + (f"<p><strong>Recommendations</strong></p><ul>{recommendations}</ul>"
           if recommendations else "")
        + picture + "</div>"
    )
