"""The conformance harness: one gradient history through the reference and through gradstream.

:class:`Case` is a run: layers in model order, the full f64 gradient of every layer at every
step, how many ranks hold it (disjoint shards, replicas, or both), the order in which the
ranks' step summaries are sent, whether dtypes are declared, and the window. :func:`reference_of`
feeds the gradients to :mod:`tests.conformance.reference`; :class:`Pipeline` sends them through
the real path (``producer.GradientProducer`` -> Kafka -> ``consumer.worker.Worker`` writing
DuckDB, served by ``deploy.serve.ServedWorker``) and reads back through
``analysis.read.reader.open_reader`` (the writer's endpoint): the stored frame values, the report,
the CSV and JSON exports, the ASCII heatmap. :func:`compare` lists every difference;
:class:`Tally` counts cases, comparisons and differences for the whole session.

Presentation options used so that gradstream's output is the reference's, byte for byte:
``export(..., style="reference")`` (CSV names raw; JSON pretty-printed as serde_json; name
order), ``heatmap(..., style="reference")``, ``report(..., order="name")`` (layer lists
by name, as the reference sorts them) and the non-finite rule ``"reference"`` (the report's
``nonfinite_rule``, the worker's ``--nonfinite-rule``: the reference's verdict on NaN/Inf
gradients). The per-(step, layer) values are read through
``analysis.nonfinite.reference_stats_sql``, the stored rows with the reference's values of
the layers holding NaN/Inf (rebuilt from the finite sums and the NaN and Inf counts, wire
schema 1.7), which the reference styles present too. Compared by kind: recommendations
(gradstream writes its own sentences; an extra gradstream line, e.g. the NaN/Inf advice, is
counted as an extra, not a difference). CSV and JSON are compared byte for byte where the
case's sums are exact, else field by field to 1e-12.
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from analysis.nonfinite import reference_stats_sql
from analysis.read.reader import StoreReader
from analysis.read.sql import STATS_SQL
from analysis.report import _HEALTH_LINE, NAMES_IN_TEXT  # gradstream's sentence per class
from producer import GradientProducer
from producer.summary import summarize
from tests.conformance.reference import (
    EXPLODING_THRESHOLD,
    VANISHING_THRESHOLD,
    GradientFlowAnimator,
    GradientFlowSummary,
)

Layout = Literal["shards", "replicas", "hsdp"]


@dataclass
class Case:
    """One run of the conformance suite.

    Attributes:
        label: what the case covers (quoted in differences).
        layers: layer names in model order.
        grads: ``grads[i][name]`` = the full gradient (float64 or float32, flat) of layer
            ``name`` at the i-th step of ``steps``.
        steps: optimiser steps, ascending.
        ranks: ranks of the run. ``layout`` ``shards``: each layer's elements are split in
            ``ranks`` contiguous pieces, one per rank (ZeRO/FSDP-style); ``replicas``:
            every rank sends the whole gradient (DDP, ``replicated=True``); ``hsdp``: two
            pieces, each held by ``ranks // 2`` replicas.
        send_seed: seed of the order in which (rank, step) summaries are sent: ranks
            interleaved at random and each rank's steps permuted (None: in order).
        declare_dtypes: pass ``dtypes=`` to ``start_run``.
        window: the reference's ``max_frames`` (0 = all); gradstream's report then covers
            the last ``window`` steps (``from_step``).
        thresholds: (vanishing, exploding): the reference's ``with_vanishing_threshold`` /
            ``with_exploding_threshold``, gradstream's ``start_run`` thresholds.
        exact: sums are exact in any order (dyadic values), so every value and the CSV
            bytes must be equal; otherwise values are compared to 1e-12 relative.
        departures: documented departures expected in this case (field names), each
            counted apart from differences.
    """

    label: str
    layers: list[str]
    grads: list[dict[str, np.ndarray]]
    steps: list[int]
    ranks: int = 1
    layout: Layout = "shards"
    send_seed: int | None = None
    declare_dtypes: bool = False
    window: int = 0
    thresholds: tuple[float, float] = (VANISHING_THRESHOLD, EXPLODING_THRESHOLD)
    exact: bool = True
    departures: frozenset[str] = frozenset()


@dataclass
class Tally:
    """Counts of the session: cases run, comparisons made, differences and documented
    departures found (each difference a line naming the case and the field)."""

    cases: int = 0
    comparisons: int = 0
    differences: list[str] = field(default_factory=list)
    departures: list[str] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def summary(self) -> dict[str, object]:
        """The figures as a JSON-able dict."""
        return {"cases": self.cases, "comparisons": self.comparisons,
                "differences": len(self.differences), "departures": len(self.departures),
                "difference_lines": self.differences[:200],
                "departure_lines": self.departures[:200],
                "extra_recommendation_lines": self.extras[:50]}


TALLY = Tally()
"""The session's figures (printed at the end of the session by ``conftest.py``)."""


def reference_of(case: Case) -> GradientFlowAnimator:
    """The reference animator fed with the case's full gradients, step by step."""
    animator = GradientFlowAnimator(case.window, *case.thresholds)
    for step, grads in zip(case.steps, case.grads, strict=True):
        animator.record_step(step, {n: grads[n].astype(np.float64).tolist() for n in case.layers})
    return animator


# -- the real path ---------------------------------------------------------------------------


@dataclass
class Observed:
    """What gradstream answered for one case."""

    rows: dict[tuple[int, str], dict[str, object]]
    report: object
    live_health: str | None
    live_window: int
    csv: str
    json_text: str
    heatmap: str


class Pipeline:
    """A served worker and a reader of its store, shared by a module's cases.

    Args:
        bootstrap: Kafka bootstrap servers.
        topic: the summaries topic of this pipeline.
        reader: :func:`analysis.read.reader.open_reader` of the worker's store.
        worker: the :class:`consumer.worker.Worker`.
        out: a directory for exports.
        max_frames: the worker's ``max_frames`` (window of its live health; 0 = whole run).
        nonfinite_rule: the worker's ``nonfinite_rule``, also asked of the report
            (``"reference"``: the reference's verdict on NaN/Inf gradients).
    """

    def __init__(self, bootstrap: str, topic: str, reader: StoreReader, worker: object,
                 out: Path, max_frames: int = 0, nonfinite_rule: str = "reference") -> None:
        self.bootstrap, self.topic, self.reader, self.worker, self.out = (
            bootstrap, topic, reader, worker, out)
        self.max_frames = max_frames
        self.nonfinite_rule = nonfinite_rule

    def send(self, case: Case, run_id: str) -> None:
        """Send the case's summaries: every rank's producer, in the case's order."""
        producers = [GradientProducer(run_id, rank=r, world_size=case.ranks,
                                      bootstrap_servers=self.bootstrap, topic=self.topic)
                     for r in range(case.ranks)]
        numel = {n: int(case.grads[0][n].size) for n in case.layers}
        dtypes = ({n: str(case.grads[0][n].dtype) for n in case.layers}
                  if case.declare_dtypes else None)
        for p in producers:
            p.start_run(numel, dtypes=dtypes, vanishing_threshold=case.thresholds[0],
                        exploding_threshold=case.thresholds[1])
        order = [(r, i) for i in range(len(case.steps)) for r in range(case.ranks)]
        if case.send_seed is not None:
            rng = random.Random(case.send_seed)
            per_rank = {r: rng.sample(range(len(case.steps)), len(case.steps))
                        for r in range(case.ranks)}
            cursor = dict.fromkeys(range(case.ranks), 0)
            order = []
            pending = [r for r in range(case.ranks) for _ in case.steps]
            rng.shuffle(pending)
            for r in pending:
                order.append((r, per_rank[r][cursor[r]]))
                cursor[r] += 1
        for rank, i in order:
            step, grads = case.steps[i], case.grads[i]
            piece, pieces = _piece_of(case, rank)
            mine = {n: np.array_split(grads[n], pieces)[piece] for n in case.layers}
            if case.layout == "shards":
                producers[rank].record_step(step, mine)
            elif case.layout == "replicas":
                producers[rank].record_step(step, mine, replicated=True)
            else:
                producers[rank].record_summaries(step, summarize(mine).with_layout(piece, pieces))
        for p in producers:
            p.finish_run()
            stats = p.close()
            assert stats.dropped == 0 and stats.failed == 0, stats

    def observe(self, case: Case, run_id: str, timeout: float = 90.0) -> Observed:
        """Wait until the worker stored the run, then read everything back."""
        assert self.worker.wait_for_runs([run_id], timeout), (  # type: ignore[attr-defined]
            f"run {run_id} not finished: {self.worker.error}")  # type: ignore[attr-defined]
        expected = len(case.steps) * len(case.layers)
        deadline = time.monotonic() + timeout
        while True:  # the last transaction may still be on the sink's writer thread
            n = self.reader.sql("SELECT count(*) AS n FROM layer_stats WHERE run_id = $run "
                                "AND (SELECT count(*) FROM run_ranks WHERE run_id = $run) "
                                "= $ranks", {"run": run_id, "ranks": case.ranks})
            if n.column("n")[0].as_py() == expected:
                break
            assert time.monotonic() < deadline, f"run {run_id}: {n} of {expected} rows"
            time.sleep(0.05)
        values = reference_stats_sql() if self.nonfinite_rule == "reference" else STATS_SQL
        table = self.reader.sql(
            f"SELECT step, name, mean_abs_grad, max_abs_grad, grad_norm, is_vanishing, "
            f"is_exploding, flow_intensity, nonfinite, nan FROM ({values})",
            {"run_id": run_id, "from_step": None, "to_step": None}).to_pylist()
        rows = {(r["step"], r["name"]): r for r in table}
        from_step = case.steps[-case.window] if case.window else None
        report = self.reader.report(run_id, from_step=from_step, order="name",
                                    nonfinite_rule=self.nonfinite_rule)
        live = report.live_health.health.value if report.live_health else None
        csv_path = self.out / f"{run_id}.csv"
        json_path = self.out / f"{run_id}.json"
        self.reader.export(run_id, "csv", csv_path, from_step=from_step, style="reference")
        self.reader.export(run_id, "json", json_path, from_step=from_step, style="reference")
        heatmap = self.reader.heatmap(run_id, from_step=from_step, style="reference")
        return Observed(rows, report, live, self.max_frames,
                        csv_path.read_bytes().decode("utf-8"),
                        json_path.read_bytes().decode("utf-8"), heatmap)

    def run(self, case: Case) -> list[str]:
        """Send, observe and compare one case; returns its differences (also tallied)."""
        run_id = f"conf-{uuid.uuid4().hex[:12]}"
        self.send(case, run_id)
        observed = self.observe(case, run_id)
        return compare(case, reference_of(case), observed)


def _piece_of(case: Case, rank: int) -> tuple[int, int]:
    if case.layout == "shards":
        return rank, case.ranks
    if case.layout == "replicas":
        return 0, 1
    return rank % 2, 2


# -- comparison -------------------------------------------------------------------------------


def _same(a: float | None, b: float, exact: bool) -> bool:
    if a is None:
        return False
    if math.isnan(b) or math.isnan(a):
        return math.isnan(a) and math.isnan(b)
    if exact or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


_KINDS = (
    ("vanishing_layers", re.compile(r"^vanishing gradients", re.I)),
    ("initialisation", re.compile(r"initiali[sz]ation", re.I)),
    ("exploding_layers", re.compile(r"^exploding gradients", re.I)),
    ("learning_rate", re.compile(r"learning rate", re.I)),
)


def recommendation_kinds(lines: list[str], health_line: str
                         ) -> tuple[list[str], list[str], list[str]]:
    """gradstream's recommendations as reference kinds, the lines of no reference kind, and
    the line of each kind (aligned with the kinds).

    The last line is the health line when it equals ``health_line`` (gradstream's sentence
    for the report's class)."""
    kinds, extras, of_kind = [], [], []
    for i, line in enumerate(lines):
        if i == len(lines) - 1 and line == health_line:
            kinds.append("health")
            of_kind.append(line)
            continue
        for kind, pattern in _KINDS:
            if pattern.search(line):
                kinds.append(kind)
                of_kind.append(line)
                break
        else:
            extras.append(line)
    return kinds, extras, of_kind


def compare(case: Case, ref: GradientFlowAnimator, got: Observed) -> list[str]:
    """Every difference between the reference and gradstream for one case.

    Compared: each (step, layer) value and flag of the retained frames; the report's
    total_steps, health, layer lists (name order), issue frames, recommendation kinds (and that
    each layer line names the layers); the consumer's live health (when its ``max_frames``
    is the case's window); the CSV
    and JSON bytes (``exact`` cases; else field by field to 1e-12); the heatmap text.
    A difference in a field listed in ``case.departures`` is counted as a departure.
    """
    diffs: list[str] = []
    departures: list[str] = []
    n = 0

    def check(field_name: str, ok: bool, detail: str) -> None:
        nonlocal n
        n += 1
        if not ok:
            line = f"[{case.label}] {field_name}: {detail}"
            line = line if len(line) <= 400 else line[:400] + " ..."
            (departures if field_name.split("[")[0] in case.departures else diffs).append(line)

    for frame in ref.frames:
        for ly in frame.layers:
            row = got.rows.get((frame.step, ly.name))
            key = f"step {frame.step} layer {ly.name!r}"
            check("row", row is not None, f"{key} missing")
            if row is None:
                continue
            for name in ("mean_abs_grad", "max_abs_grad", "grad_norm", "flow_intensity"):
                want = getattr(ly, name)
                check(name, _same(row[name], want, case.exact),
                      f"{key}: gradstream {row[name]!r}, reference {want!r}")
            for name in ("is_vanishing", "is_exploding"):
                want = getattr(ly, name)
                check(name, row[name] == want,
                      f"{key}: gradstream {row[name]!r}, reference {want!r}")

    want: GradientFlowSummary = ref.summary_report()
    rep = got.report
    check("total_steps", rep.total_steps == want.total_steps,
          f"gradstream {rep.total_steps}, reference {want.total_steps}")
    check("health", rep.overall_health.value == want.overall_health.value,
          f"gradstream {rep.overall_health.value}, reference {want.overall_health.value}")
    for mine, theirs, name in (
        (rep.layers_with_vanishing_grads, want.layers_with_vanishing_grads, "vanishing_layers"),
        # the report asked with order="name": lists in the reference's order
        (rep.layers_with_exploding_grads, want.layers_with_exploding_grads, "exploding_layers"),
    ):
        extra, missing = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        check(name, mine == theirs,
              f"gradstream lists {extra[:10]} that the reference does not; the reference "
              f"lists {missing[:10]} that gradstream does not")
    check("issue_frames", (rep.issue_frames, rep.frames) == (want.issue_frames, want.frames),
          f"gradstream {rep.issue_frames}/{rep.frames}, reference "
          f"{want.issue_frames}/{want.frames}")
    kinds, extras, kind_lines = recommendation_kinds(rep.recommendations,
                                                     _HEALTH_LINE[rep.overall_health])
    check("recommendations", kinds == want.recommendation_kinds,
          f"gradstream kinds {kinds}, reference {want.recommendation_kinds}")
    for kind, names in (("vanishing_layers", want.layers_with_vanishing_grads),
                        ("exploding_layers", want.layers_with_exploding_grads)):
        if kind in kinds:  # names quoted in name order, the first NAMES_IN_TEXT of them
            line = kind_lines[kinds.index(kind)]  # extra lines (NaN/Inf advice) skipped
            ordered = list(names)
            named = all(nm in line for nm in ordered[:NAMES_IN_TEXT]) and (
                len(ordered) <= NAMES_IN_TEXT
                or f"and {len(ordered) - NAMES_IN_TEXT} more" in line)
            check("recommendations", named,
                  f"{kind} line {line[:200]!r} does not name {ordered[:NAMES_IN_TEXT]}")
    if case.window == got.live_window:  # the consumer's window is the reference's
        check("live_health", got.live_health == want.overall_health.value,
              f"consumer {got.live_health}, reference {want.overall_health.value}")

    ref_csv = ref.export_csv()
    if case.exact:
        check("csv", got.csv == ref_csv, _first_line_diff(got.csv, ref_csv))
    else:
        check("csv", _csv_close(got.csv, ref_csv), _first_line_diff(got.csv, ref_csv))
    ref_text = ref.export_json()
    got_frames, ref_frames = json.loads(got.json_text), json.loads(ref_text)
    if case.exact:
        check("json", got.json_text == ref_text, _first_line_diff(got.json_text, ref_text))
    else:
        check("json", _json_close(got_frames, ref_frames, False),
              _first_json_diff(got_frames, ref_frames))
    ref_map = ref.to_ascii_animation()
    check("heatmap", got.heatmap == ref_map, _first_line_diff(got.heatmap, ref_map))

    with TALLY.lock:
        TALLY.cases += 1
        TALLY.comparisons += n
        TALLY.differences.extend(diffs)
        TALLY.departures.extend(departures)
        TALLY.extras.extend(f"[{case.label}] {e}" for e in extras)
    return diffs


def _first_line_diff(got: str, want: str) -> str:
    a, b = got.splitlines(), want.splitlines()
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"line {i + 1}: gradstream {x!r}, reference {y!r}"
    return f"gradstream {len(a)} lines, reference {len(b)} lines"


def _csv_close(got: str, want: str) -> bool:
    a, b = got.splitlines(), want.splitlines()
    if len(a) != len(b) or a[:1] != b[:1]:
        return False
    for x, y in zip(a[1:], b[1:], strict=True):
        fx, fy = x.rsplit(",", 5), y.rsplit(",", 5)
        if fx[0] != fy[0] or fx[4:] != fy[4:]:
            return False
        for u, v in zip(fx[1:4], fy[1:4], strict=True):
            if not _same(float(u), float(v), False):
                return False
    return True


def _json_close(got: list[dict], want: list[dict], exact: bool) -> bool:
    if [f["step"] for f in got] != [f["step"] for f in want]:
        return False
    for fg, fw in zip(got, want, strict=True):
        if [ly["name"] for ly in fg["layers"]] != [ly["name"] for ly in fw["layers"]]:
            return False
        for lg, lw in zip(fg["layers"], fw["layers"], strict=True):
            if list(lg) != list(lw):
                return False
            for key, value in lw.items():
                mine = lg[key]
                if isinstance(value, float) or (value is None and key != "name"):
                    if value is None or mine is None:
                        if value is not mine:
                            return False
                    elif not _same(float(mine), value, exact):
                        return False
                elif mine != value:
                    return False
    return True


def _first_json_diff(got: list[dict], want: list[dict]) -> str:
    for fg, fw in zip(got, want, strict=False):
        if fg != fw:
            for lg, lw in zip(fg.get("layers", []), fw.get("layers", []), strict=False):
                if lg != lw:
                    return f"step {fw['step']}: gradstream {lg}, reference {lw}"
            return f"step {fw['step']}: frames differ"
    return f"gradstream {len(got)} frames, reference {len(want)}"
