"""The flight recorder of a rank's local view: its last K local-view summaries, sent only
when something went wrong.

The local view (the statistics of a rank's own gradient before the cross-rank reduction)
names the rank where NaN/Inf or an explosion started, but sent every step it costs
``world_size x layers`` rows per step. A :class:`FlightRecorder` keeps the last
``steps`` entries in a ring buffer instead (bounded in entries and in bytes) and hands
them out as a :class:`Dump` when a *local trigger* fires on the newest entry:

- ``nonfinite``: some layer holds a NaN/Inf element (``nonfinite > 0``);
- ``exploding``: some layer's max |g| (over its finite elements) is above the run's
  exploding threshold;
- ``norm_spike``: the rank's local total norm ``n_t = sqrt(sum over layers of sum_sq)``
  is above ``spike_factor`` times the median of the total norms of the previous entries
  in the buffer, once there are at least ``min_window`` of them:
  ``n_t > spike_factor * median(n_{t-w}, ..., n_{t-1})``. The median rather than the
  mean: it is what the rule looks for that would move a mean (one earlier spike in the
  window raises a mean by ``spike / w`` and can hide the next one), while the median
  ignores up to half the window being outliers and needs no variance estimate. A window
  whose median is 0 (gradients exactly zero) makes any positive norm a spike;
- ``sample`` (optional, ``sample_every > 0``): every ``sample_every`` steps
  (``step % sample_every == 0``) the newest entry alone, a sparse baseline.

When several fire at once the first of this order names the dump. A dump holds every
entry of the buffer not sent before, oldest first (the newest included): entries already
sent are never sent again, so a rank whose gradient stays NaN sends one entry per step
after its first dump, and a rank in steady state sends nothing.

Size of an entry (:attr:`LocalEntry.nbytes`): the bytes of its six arrays, ``m`` layers
each of 8 bytes (int64 ``layer_indices``, ``numel``, ``nonfinite``; float64 ``sum_abs``,
``sum_sq``, ``max_abs``): ``48 * m`` bytes. The buffer drops its oldest entries while it
holds more than ``steps`` entries or more than ``max_bytes`` bytes, but always keeps the
newest entry (so that a trigger can send it even when it alone exceeds ``max_bytes``).

River-style (``update`` an observation, ``get`` the result)::

>>> import numpy as np
>>> def entry(step, norm, nonfinite=0):
...     return LocalEntry(step, 0.0, np.array([0]), np.array([4]), np.array([norm]),
...                       np.array([norm * norm]), np.array([norm / 2]),
...                       np.array([nonfinite]))
>>> rec = FlightRecorder(steps=4, exploding_threshold=1e3)
>>> for step in range(6):
...     rec.update(entry(step, 1.0))
>>> rec.get()
()
>>> rec.update(entry(6, 1.0, nonfinite=2))
>>> (dump,) = rec.get()
>>> dump.trigger, dump.trigger_step, [e.step for e in dump.entries]
('nonfinite', 6, [3, 4, 5, 6])
>>> rec.update(entry(7, 50.0))  # 50 > 10 x median(1, 1, 1): a spike; 3..6 were sent
>>> [(d.trigger, [e.step for e in d.entries]) for d in rec.get()]
[('norm_spike', [7])]
>>> entry(0, 1.0).nbytes
48
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from producer.summary import LayerSummaries
from schemas.wire import LocalTrigger

__all__ = ["DEFAULT_MAX_BYTES", "Dump", "FlightRecorder", "LocalEntry"]

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
"""Default byte bound of a rank's buffer: 4 MiB holds 32 entries of 2730 layers each
(48 bytes a layer, :attr:`LocalEntry.nbytes`)."""


@dataclass(frozen=True, slots=True)
class LocalEntry:
    """One step of a rank's local view, as the recorder keeps it.

    Attributes:
        step: optimiser step. wall_time: unix time (s) it was recorded.
        layer_indices: int64[m] ``layer_index`` of each layer (the run's layer list).
        numel, nonfinite: int64[m] elements and NaN/Inf elements per layer.
        sum_abs, sum_sq: float64[m] sum |g| and sum g^2 over the finite elements (+inf
            when a float64 sum overflowed). max_abs: float64[m] max |g| over them.
    """

    step: int
    wall_time: float
    layer_indices: np.ndarray
    numel: np.ndarray
    sum_abs: np.ndarray
    sum_sq: np.ndarray
    max_abs: np.ndarray
    nonfinite: np.ndarray

    @classmethod
    def from_summaries(
        cls, step: int, wall_time: float, local: LayerSummaries,
        layer_index: Mapping[str, int],
    ) -> LocalEntry | None:
        """The entry of ``local``'s layers that ``layer_index`` names (others left out);
        its arrays are copies. None when no layer is named.

        Raises:
            ValueError: ``local`` has no ``sum_abs`` / ``max_abs`` (norms mode).
        """
        if local.sum_abs is None or local.max_abs is None:
            raise ValueError("the local view needs sum_abs and max_abs (full statistics)")
        keep = [i for i, name in enumerate(local.names) if name in layer_index]
        if not keep:
            return None
        sel = np.asarray(keep, np.int64)
        return cls(
            int(step), float(wall_time),
            np.fromiter((layer_index[local.names[i]] for i in keep), np.int64, len(keep)),
            np.asarray(local.numel, np.int64)[sel], np.asarray(local.sum_abs, np.float64)[sel],
            np.asarray(local.sum_sq, np.float64)[sel], np.asarray(local.max_abs, np.float64)[sel],
            np.asarray(local.nonfinite, np.int64)[sel],
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the six arrays (``48 * m`` for m layers of int64 / float64)."""
        return sum(int(a.nbytes) for a in (self.layer_indices, self.numel, self.sum_abs,
                                           self.sum_sq, self.max_abs, self.nonfinite))

    @property
    def total_norm(self) -> float:
        """The rank's local total norm ``sqrt(sum over layers of sum_sq)`` (inf when a
        sum overflowed)."""
        return float(np.sqrt(self.sum_sq.sum()))


@dataclass(frozen=True, slots=True)
class Dump:
    """Entries the recorder hands out: the ``trigger`` that fired, the step it fired at
    (``trigger_step``, the newest entry's) and the entries not sent before, oldest first."""

    trigger: LocalTrigger
    trigger_step: int
    entries: tuple[LocalEntry, ...]


class FlightRecorder:
    """A rank's ring buffer of local-view entries and its local triggers (module doc).

    Parameters:
        steps: K, the most entries kept (> 0).
        max_bytes: the most bytes of entries kept (:attr:`LocalEntry.nbytes`, > 0); the
            newest entry is always kept.
        exploding_threshold: the run's max |g| threshold (``RunStarted``).
        spike_factor: a total norm above this times the window's median is a spike (> 1).
        sample_every: send the newest entry every this many steps (0: never).
        min_window: previous entries needed before a spike can fire (>= 1).

    Raises:
        ValueError: a parameter out of its range.
    """

    def __init__(
        self, steps: int = 32, max_bytes: int = DEFAULT_MAX_BYTES, *,
        exploding_threshold: float = 1e3, spike_factor: float = 10.0, sample_every: int = 0,
        min_window: int = 4,
    ) -> None:
        if steps < 1 or max_bytes < 1 or min_window < 1 or sample_every < 0:
            raise ValueError("steps, max_bytes and min_window must be >= 1, sample_every >= 0")
        if not spike_factor > 1.0 or not exploding_threshold > 0.0:
            raise ValueError("spike_factor must be > 1 and exploding_threshold > 0")
        self.steps = steps
        self.max_bytes = max_bytes
        self.exploding_threshold = exploding_threshold
        self.spike_factor = spike_factor
        self.sample_every = sample_every
        self.min_window = min_window
        self._entries: deque[LocalEntry] = deque()
        self._norms: deque[float] = deque()
        self._sent: deque[bool] = deque()
        self._bytes = 0
        self._dumps: list[Dump] = []

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of the entries kept now."""
        return self._bytes

    def trigger(self, entry: LocalEntry) -> LocalTrigger | None:
        """The trigger ``entry`` fires as the newest entry after those kept now, or None.
        O(layers + K)."""
        if entry.nonfinite.any():
            return "nonfinite"
        if (entry.max_abs > self.exploding_threshold).any():
            return "exploding"
        if (len(self._norms) >= self.min_window
                and entry.total_norm > self.spike_factor * float(np.median(self._norms))):
            return "norm_spike"
        if self.sample_every and entry.step % self.sample_every == 0:
            return "sample"
        return None

    def update(self, entry: LocalEntry) -> None:
        """Record ``entry`` as the newest, evaluate the triggers on it, and keep the
        buffer within ``steps`` entries and ``max_bytes`` bytes (oldest dropped first)."""
        fired = self.trigger(entry)
        self._entries.append(entry)
        self._norms.append(entry.total_norm)
        self._sent.append(False)
        self._bytes += entry.nbytes
        while len(self._entries) > 1 and (len(self._entries) > self.steps
                                          or self._bytes > self.max_bytes):
            self._bytes -= self._entries.popleft().nbytes
            self._norms.popleft()
            self._sent.popleft()
        if fired == "sample":
            self._sent[-1] = True
            self._dumps.append(Dump("sample", entry.step, (entry,)))
        elif fired is not None:
            unsent = tuple(e for e, sent in zip(self._entries, self._sent, strict=True)
                           if not sent)
            self._sent = deque(True for _ in self._sent)
            self._dumps.append(Dump(fired, entry.step, unsent))

    def get(self) -> tuple[Dump, ...]:
        """The dumps fired since the last call, oldest first (empty: nothing to send);
        each entry is handed out once."""
        dumps, self._dumps = tuple(self._dumps), []
        return dumps
