"""Helpers shared by the alert rules: JSON-safe numbers, name previews for messages, the
per-frame layer lookup (:class:`FrameView`) and :class:`LocalOrigin` (where a kind of bad
gradient started, from the producers' per-rank local view)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from consumer.frames import GradientFrame

NO_LAYERS = np.empty(0, np.int64)
"""int64[0]: no layer indices."""


def json_number(x: Any) -> float | int | None:
    """A JSON-safe number: ints stay ints, non-finite floats become None."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return int(x)
    value = float(x)
    return value if math.isfinite(value) else None


def preview(names: list[str], limit: int = 3) -> str:
    """``"a, b, c and 4 more"`` for a message."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class LocalOrigin:
    """Where a kind of bad gradient started in a run, from the per-rank local view: the
    earliest step at which some rank's *local* gradient (before the cross-rank reduction)
    was bad, and every rank that was bad at that step.

    Frames may arrive out of order and a late rank's rows come in a rewrite of the frame,
    so an earlier step replaces the origin and the same step adds its ranks. O(1) state;
    :meth:`update` is O(rows of the frame's local view), vectorised.

    Attributes:
        step: the earliest bad step seen, or None. ranks: its bad ranks (ascending).
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self.ranks: list[int] = []

    def update(self, step: int, bad_ranks: np.ndarray) -> None:
        """Take a frame's bad local rows into account.

        Args:
            step: the frame's optimiser step.
            bad_ranks: int[m] ranks of the local rows that are bad (repeats allowed; empty:
                nothing bad at this step).
        """
        if bad_ranks.size == 0 or (self.step is not None and step > self.step):
            return
        ranks = np.unique(bad_ranks).tolist()
        if self.step is None or step < self.step:
            self.step, self.ranks = step, ranks
        else:
            self.ranks = sorted(set(self.ranks) | set(ranks))

    def values(self) -> dict[str, Any]:
        """``{"local_origin": {"step": s, "ranks": [...]}}``, or ``{}`` when unknown."""
        if self.step is None:
            return {}
        return {"local_origin": {"step": self.step, "ranks": list(self.ranks)}}

    def phrase(self, what: str) -> str:
        """``"; {what} first in rank 2's local gradient at step 20"`` (several ranks: "in
        the local gradients of ranks 0, 1"), or ``""`` when unknown."""
        if self.step is None:
            return ""
        if len(self.ranks) == 1:
            where = f"rank {self.ranks[0]}'s local gradient"
        else:
            where = f"the local gradients of ranks {', '.join(map(str, self.ranks))}"
        return f"; {what} first in {where} at step {self.step}"


class FrameView:
    """One frame as the rules see it: layer index -> row of the frame, layer names, and the
    per-layer values written into ``Alert.values``.

    Args:
        frame: the frame. names: object[L] layer names of the run (model order).
        limit: at most this many layers get values (``max_layer_values``).

    Attributes:
        row: int64[L], the frame's row of each layer, -1 for layers not in the frame.
    """

    def __init__(self, frame: GradientFrame, names: np.ndarray, limit: int) -> None:
        self.frame = frame
        self.names = names
        self.limit = limit
        self.row = np.full(len(names), -1, np.int64)
        self.row[frame.layer_index] = np.arange(len(frame.layer_index))

    def layer_values(
        self, layers: np.ndarray, key: np.ndarray, extra: dict[str, np.ndarray] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Values of at most ``limit`` of ``layers`` (int[k] layer indices), the ones with
        the largest ``key`` (float[k]), in model order; ``extra`` adds aligned columns
        (name -> array[k]). Each layer maps to ``grad_norm``, ``max_abs_grad``,
        ``mean_abs_grad``, ``nonfinite``, ``numel`` (when in the frame) plus ``extra``;
        non-finite numbers are None."""
        if layers.size > self.limit:
            keep = np.sort(np.argsort(-key, kind="stable")[: self.limit])
            layers = layers[keep]
            extra = {k: v[keep] for k, v in (extra or {}).items()}
        f = self.frame
        out: dict[str, dict[str, Any]] = {}
        # at most `limit` layers (default 16): building the JSON dicts is per layer
        for i, layer in enumerate(layers.tolist()):
            values: dict[str, Any] = {}
            r = int(self.row[layer])
            if r >= 0:
                values = {
                    "grad_norm": json_number(f.grad_norm[r]),
                    "max_abs_grad": json_number(f.max_abs_grad[r]),
                    "mean_abs_grad": json_number(f.mean_abs_grad[r]),
                    "nonfinite": int(f.nonfinite[r]),
                    "numel": int(f.numel[r]),
                }
            for name, column in (extra or {}).items():
                values[name] = json_number(column[i])
            out[str(self.names[layer])] = values
        return out
