"""PyTorch adapter: one gradient summary per optimiser step, computed on the gradients' device.

:class:`GradientTap` watches a model's parameters. Attached to an optimiser with
:meth:`GradientTap.attach_optimizer`, it summarises the accumulated ``.grad`` of every
selected parameter right before ``optimizer.step()`` consumes them (through
``optimizer.register_step_pre_hook``), so gradient accumulation over several ``backward()``
calls gives exactly one summary per optimiser step. :meth:`GradientTap.step` does the same
by hand.

The statistics are computed by :mod:`producer.adapters.torch_summary`; which piece of a
parameter a rank's gradient is, and the layouts refused, by
:mod:`producer.adapters.torch_layout`; under FSDP v1 (``FullyShardedDataParallel``, flat
parameters or ``use_orig_params=True``) the original parameters and each one's piece of the
flat gradient by :mod:`producer.adapters.torch_fsdp1`. The result goes to the producer as a ready
:class:`~producer.summary.LayerSummaries` through ``record_summaries``: the gradients
themselves never leave their device.

The per-rank local view (DDP): :meth:`GradientTap.attach_ddp` registers a communication
hook that summarises each bucket's local gradients (this rank's own, before the
all-reduce) and then runs DDP's default all-reduce; the next summary carries them as the
local view. Under FSDP the local gradient exists only inside the reduce-scatter of the
unsharded gradient: it is not exposed cheaply, so FSDP runs have no local view.

Importing this module does not import torch; torch is imported when a tap is built or a
function here is called.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from producer.adapters import torch_device as device_path
from producer.adapters.naming import normalize_name, normalized_names
from producer.adapters.optional import import_torch
from producer.adapters.torch_fsdp1 import original_parameters, unsupported_fsdp1
from producer.adapters.torch_layout import (
    UnsupportedParallelismError,
    full_numel,
    gradient_piece,
)
from producer.adapters.torch_reduce import InBandReducer, replica_layout
from producer.adapters.torch_run_layers import RunLayers, gather_run_layers, replica_group
from producer.adapters.torch_scalars import DEFAULT_TIMED_PARAMETERS, StepScalars
from producer.adapters.torch_summary import (
    Accumulate,
    PendingSummaries,
    launch_summaries,
    summarize_tensors,
)
from producer.selection import select_names
from producer.summary import LayerSummaries
from schemas.scalars import RankScalars

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

log = logging.getLogger("gradstream.adapters.torch")


class SummaryRecorder(Protocol):
    """What a tap needs from a producer (``GradientProducer`` satisfies it)."""

    def start_run(
        self,
        layer_numel: Mapping[str, int],
        *,
        vanishing_threshold: float = ...,
        exploding_threshold: float = ...,
        config: Mapping[str, Any] | None = ...,
        dtypes: Mapping[str, str] | None = ...,
        ignore_layers: Sequence[str] = ...,
    ) -> None:
        """Announce the layer list (see ``GradientProducer.start_run``)."""

    def record_summaries(
        self, step: int, summaries: LayerSummaries, *,
        scalars: Mapping[str, object] | None = None, rank_scalars: RankScalars | None = None,
    ) -> None:
        """Queue precomputed statistics and training scalars of one step (see
        ``GradientProducer``)."""


Reduce = Literal["auto", "in_band", "off"]
"""Where a distributed run's statistics are reduced (see :class:`GradientTap`)."""


def dtype_name(dtype: Any) -> str:
    """A torch dtype's short name (``torch.bfloat16`` -> ``"bfloat16"``), as on the wire."""
    return str(dtype).removeprefix("torch.")


def check_every_n_steps(value: object) -> int:
    """``value`` as a sampling period: an int >= 1.

    Raises:
        TypeError: not an int (a bool is not one).
        ValueError: below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"every_n_steps must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"every_n_steps must be >= 1, got {value}")
    return value


class GradientTap:
    """Summarise a torch model's gradients once per optimiser step and hand them to a producer.

    Typical use::

        tap = GradientTap(model, producer, exclude="*.bias")
        tap.start_run()                    # producer.start_run(tap.layer_numel())
        tap.attach_optimizer(optimizer)    # summary taken in optimizer.step()'s pre-hook
        for step, batch in ...:
            for micro in chunks(batch):    # gradient accumulation: still one summary
                loss(model, micro).backward()
            optimizer.step()
            optimizer.zero_grad()

    The layer list is fixed when the tap is built: every parameter of
    ``model.named_parameters()`` (model order, shared parameters once) whose normalised
    name passes ``include``/``exclude``, frozen ones (``requires_grad=False``) included so
    that unfreezing later is picked up. A parameter whose ``.grad`` is ``None`` at a step
    is left out of that step's summary and counted in :attr:`skipped_without_grad`.

    With ``torch.amp.GradScaler``, ``scaler.step(optimizer)`` skips ``optimizer.step()``
    when the gradients hold Inf/NaN, so the pre-hook does not see those steps; call
    ``scaler.unscale_(optimizer)`` then :meth:`step` by hand to see them.

    Args:
        model: a ``torch.nn.Module`` (possibly wrapped in DDP, ``torch.compile``,
            FSDP2, FSDP v1, checkpoint wrappers: names are normalised with ``name_fn``;
            under FSDP v1 the layers are the original parameters with their full sizes,
            never the flat parameters or a rank's slices).
        producer: an object with ``start_run(layer_numel, ...)`` and
            ``record_summaries(step, summaries)``, normally a ``GradientProducer``.
        every_n_steps: summarise only the optimiser steps whose number is a multiple of
            n (n >= 1; step 0 included). When the producer has ``settings.every_n_steps``
            (a ``GradientProducer`` does) the tap uses the least common multiple of both,
            so it never computes a summary the producer would drop; default: the
            producer's value (else 1).
        include: fnmatch glob pattern(s) on normalised names; only matching parameters are
            watched (default all). The producer's ``settings.include`` / ``exclude``, when
            present, are applied as well.
        exclude: fnmatch glob pattern(s) on normalised names; matching parameters are not
            watched.
        name_fn: ``str -> str`` applied to raw parameter names (default
            :func:`~producer.adapters.naming.normalize_name`).
        host_numpy: summarise CPU gradients with NumPy (see :func:`summarize_tensors`);
            False uses torch reductions for them too.
        accumulate: accumulation dtype of the torch reductions, ``"auto"`` (float64 on the
            CPU, float32 on accelerators), ``"float32"`` or ``"float64"``; error bound in
            :func:`summarize_tensors`.
        defer: read a step's statistics at the next summarised step (or :meth:`flush`)
            instead of waiting for the device: the training thread then never waits for
            the GPU; the one small copy per step is ``non_blocking`` into pinned memory with
            a CUDA event. The gradients are not kept, so a layer whose fast statistics are
            NaN/Inf is reported with ``nonfinite = numel`` and zero sums (counted in
            :attr:`inexact_layers`) and the tap switches to synchronous reads for the rest
            of the run (exact counts from then on). Off by default (exact counts at every
            step); opt in where the wait for the device shows in the step time. Call
            :meth:`flush` (the framework callbacks do) before ``finish_run``.
        emulate_device: summarise CPU gradients with the accelerator path, exactly as on
            a GPU (see :func:`summarize_tensors`): for tests and CPU smoke runs.
        reduce: where a distributed run's statistics are reduced. ``"in_band"``: inside
            training (:mod:`producer.adapters.torch_reduce`): the replicas of a parameter
            divide the layers between them (each rank reads about 1/R of the gradient, plus
            a rotating cross-check), two small asynchronous collectives per summarised step
            on a gloo group sum the pieces, and rank 0 alone sends the whole parameters'
            statistics, one message per step; the local view (:meth:`attach_ddp`) goes to
            the producer's ``record_local``. ``"off"``: every rank sends its own pieces and
            the consumer merges them. ``"auto"`` (default): in-band when
            ``torch.distributed`` is initialised with the producer's ``world_size`` (> 1)
            ranks at :meth:`start_run`, else off. The reduction is set up by
            :meth:`start_run` (collective: every rank calls it). In-band, a rank's own
            statistics are read at once (``defer`` does not apply) and the reduction is
            what waits until the next summarised step.
        check_slices: in-band mode: the cross-check covers a replica's layers in this many
            slices (>= 1): extra reading about ``1 / (check_slices R)`` of the gradient per
            rank; a diverging replica is named within ``check_slices (R - 1)`` summarised
            steps.
        timed_parameters: how many parameters, first in model order, time the end of the
            rank's backward pass for ``compute_time_s`` (0: none;
            :mod:`producer.adapters.torch_scalars`).

    Training scalars (``schemas.scalars``) go with every summarised step: the learning
    rates of the attached optimiser's parameter groups, the loss scale of a GradScaler
    given to :meth:`attach_scaler`, what :meth:`record_scalars` was given (the rank's
    ``loss``, ``tokens``...), and this rank's measured ``step_time_s`` and
    ``compute_time_s`` (:mod:`producer.adapters.torch_scalars`). In-band, the per-rank ones
    of every rank are gathered with the reduction and sent by rank 0.

    Training-thread time: everything :meth:`step` does (collecting the gradients,
    reductions, copies, ``record_summaries``) is counted in the producer's
    ``stats().training_thread_s`` when the producer has ``add_training_time`` (a
    ``GradientProducer`` does).

    Raises:
        TypeError: ``model`` has no ``named_parameters``; a pattern is not a ``str``.
        ValueError: ``every_n_steps < 1``; no parameter selected; two parameters normalise
            to the same name.

    A model gradstream cannot summarise exactly (FSDP v1 over tensor-parallel DTensors, or
    with its unit outside the model given:
    :func:`~producer.adapters.torch_fsdp1.unsupported_fsdp1`) builds a tap whose
    :attr:`unsupported` says why; :meth:`start_run`, :meth:`layer_numel` and :meth:`step`
    then raise :class:`UnsupportedParallelismError`.

    Attributes:
        skipped_without_grad: (parameter, step) pairs left out because ``.grad`` was
            ``None``, over the steps that were summarised.
        skipped_not_local: (parameter, step) pairs left out because the gradient is a
            DTensor with a pending ``Partial`` reduction, this rank is outside its mesh, or
            its local shard is empty.
        steps_recorded: summaries handed to the producer.
        steps_without_gradients: summarised steps where no watched parameter had a
            gradient (nothing is sent for them).
        inexact_layers: (layer, step) pairs reported without an exact non-finite count
            (deferred mode only, see ``defer``).
        every_n_steps: the effective sampling period (see the argument).
        next_step: the step number :meth:`step` uses when called without one.
        unsupported: why this model cannot be summarised exactly, or None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        producer: SummaryRecorder,
        *,
        every_n_steps: int | None = None,
        include: str | Iterable[str] | None = None,
        exclude: str | Iterable[str] | None = None,
        name_fn: Callable[[str], str] = normalize_name,
        host_numpy: bool = True,
        accumulate: Accumulate = "auto",
        defer: bool = False,
        emulate_device: bool = False,
        reduce: Reduce = "auto",
        check_slices: int = 4,
        timed_parameters: int = DEFAULT_TIMED_PARAMETERS,
    ) -> None:
        import_torch()
        if reduce not in ("auto", "in_band", "off"):
            raise ValueError(f"reduce must be 'auto', 'in_band' or 'off', got {reduce!r}")
        if isinstance(check_slices, bool) or not isinstance(check_slices, int) \
                or check_slices < 1:
            raise ValueError(f"check_slices must be an int >= 1, got {check_slices!r}")
        device_path.check_accumulate(accumulate)
        if not hasattr(model, "named_parameters"):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        own_n = 1 if every_n_steps is None else check_every_n_steps(every_n_steps)
        settings = getattr(producer, "settings", None)
        producer_n = getattr(settings, "every_n_steps", 1) or 1
        # FSDP v1: the original parameters (names, full sizes) replace the flat ones or
        # the local slices named_parameters() yields (producer.adapters.torch_fsdp1).
        self.unsupported = unsupported_fsdp1(model)
        originals = None if self.unsupported is not None else original_parameters(model)
        named = (list(model.named_parameters()) if originals is None
                 else [(p.raw_name, p.tensor) for p in originals])
        names = normalized_names([raw for raw, _ in named], name_fn)
        by_name = {name: param for name, (_, param) in zip(names, named, strict=True)}
        slot_of = {} if originals is None else dict(zip(names, originals, strict=True))
        size_of = {name: slot_of[name].numel if name in slot_of else full_numel(param)
                   for name, param in by_name.items()}
        kept = select_names(names, include, exclude)
        kept = select_names(
            kept, getattr(settings, "include", None) or None, getattr(settings, "exclude", None)
        )
        self._params = [(name, by_name[name]) for name in kept if size_of[name] > 0]
        if not self._params:
            raise ValueError(
                f"no parameters selected (model has {len(named)}; include={include!r}, "
                f"exclude={exclude!r})"
            )
        self._layer_numel = {name: size_of[name] for name, _ in self._params}
        self._slots = [slot_of.get(name) for name, _ in self._params]
        self.producer = producer
        self.every_n_steps = math.lcm(own_n, int(producer_n))
        self.host_numpy = host_numpy
        self.next_step = 0
        self.skipped_without_grad = 0
        self.skipped_not_local = 0
        self.steps_recorded = 0
        self.steps_without_gradients = 0
        self._handles: list[Any] = []
        self._name_of = {id(param): name for (name, param), slot in
                         zip(self._params, self._slots, strict=True)
                         if slot is None or not slot.flat}  # a flat parameter is no layer's
        self._local_rows: dict[str, tuple[int, float, float, float, int]] = {}
        self.accumulate = accumulate
        self.emulate_device = emulate_device
        self._inside = 0.0
        self.defer = defer
        self.inexact_layers = 0
        self._pending: tuple[int, PendingSummaries, np.ndarray, np.ndarray,
                             LayerSummaries | None, dict[str, float]] | None = None
        # The hot path: plain (non-DTensor) parameters, all with a gradient, need no
        # per-parameter work beyond reading .grad (layout arrays built once).
        self._tensors = [param for _, param in self._params]
        self._names = tuple(name for name, _ in self._params)
        self._plain = originals is None and not any(
            hasattr(param, "placements") and hasattr(param, "to_local")
            for param in self._tensors
        )
        self._whole_index = np.zeros(len(self._params), dtype=np.int64)
        self._whole_count = np.ones(len(self._params), dtype=np.int64)
        self.reduce = reduce
        self.check_slices = check_slices
        self.reducer: InBandReducer | None = None
        self.run_layers: RunLayers | None = None
        self.scalars = StepScalars(self._tensors, timed_parameters)

    @property
    def layer_names(self) -> list[str]:
        """Normalised names of the watched parameters, in model order."""
        return [name for name, _ in self._params]

    def layer_numel(self) -> dict[str, int]:
        """Layer name -> full parameter size, in model order (the ``start_run`` argument).

        Returns:
            A new dict; a DTensor parameter counts its global size.

        Raises:
            UnsupportedParallelismError: the model cannot be summarised exactly
                (:attr:`unsupported`).
        """
        self._refuse_unsupported()
        return dict(self._layer_numel)

    def _refuse_unsupported(self) -> None:
        """Raise :class:`UnsupportedParallelismError` when :attr:`unsupported` is set."""
        if self.unsupported is not None:
            raise UnsupportedParallelismError(self.unsupported)

    def layer_name_of(self, param: Any) -> str | None:
        """The layer name this tap gives a parameter (the object itself, not a copy), or
        None when the tap does not watch it (not selected, or not a parameter of the
        model)."""
        return self._name_of.get(id(param))

    def start_run(
        self,
        *,
        vanishing_threshold: float = 1e-7,
        exploding_threshold: float = 1e3,
        config: Mapping[str, Any] | None = None,
        ignore_layers: Sequence[str] = (),
    ) -> None:
        """Call ``producer.start_run`` with this tap's layer list.

        Args:
            vanishing_threshold: mean |g| below which a layer is vanishing.
            exploding_threshold: max |g| above which a layer is exploding.
            config: free-form JSON-serialisable run configuration.
            ignore_layers: layer-name patterns the run leaves out of its health,
                explicitly (``GradientProducer.start_run``).

        Raises:
            UnsupportedParallelismError: the model cannot be summarised exactly
                (:attr:`unsupported`), or two ranks declare one layer name differently
                (:mod:`producer.adapters.torch_run_layers`);
                nothing is sent.
            Whatever ``producer.start_run`` raises (e.g. RuntimeError if already started).
        """
        self._refuse_unsupported()
        world = getattr(self.producer, "world_size", None)
        layers = self._gather_layers(world)
        self._set_up_reduction(world, layers)
        self.run_layers = layers
        self.producer.start_run(
            dict(zip(layers.names, layers.numel.tolist(), strict=True)),
            vanishing_threshold=vanishing_threshold,
            exploding_threshold=exploding_threshold,
            config=config,
            dtypes=dict(zip(layers.names, layers.dtypes, strict=True)),
            ignore_layers=list(ignore_layers),
        )

    def _distributed(self, world: object) -> bool:
        """Whether ``torch.distributed`` runs the producer's ``world`` (> 1) ranks."""
        dist = import_torch().distributed
        return (isinstance(world, int) and world > 1 and dist.is_available()
                and dist.is_initialized() and dist.get_world_size() == world)

    def _layout_of(self, i: int) -> Any:
        """What knows watched parameter ``i``'s replica layout: its FSDP v1 original
        parameter, else the tensor itself."""
        slot = self._slots[i]
        return self._tensors[i] if slot is None else slot

    def _gather_layers(self, world: object) -> RunLayers:
        """The run's layer list: the union of every rank's (one ``all_gather_object`` when
        distributed), see :mod:`producer.adapters.torch_run_layers`.

        Raises:
            UnsupportedParallelismError: ranks declare one name differently.
        """
        dtypes = [dtype_name(param.dtype) for _, param in self._params]
        numel = list(self._layer_numel.values())
        if not self._distributed(world):
            return gather_run_layers(self._names, numel, dtypes, [None] * len(numel), 0, 1)
        dist = import_torch().distributed
        rank = dist.get_rank()
        described = []
        for i in range(len(self._params)):
            source = self._layout_of(i)
            if getattr(source, "placements", None) is None and \
                    not callable(getattr(source, "replica_layout", None)):
                described.append(None)  # a plain tensor: replicated where declared
                continue
            layout = replica_layout(source, rank, dist.get_world_size())
            described.append((layout.replicas, replica_group(layout.ranks)))
        return gather_run_layers(self._names, numel, dtypes, described, rank,
                                 dist.get_world_size())

    def _set_up_reduction(self, world: object, layers: RunLayers) -> None:
        """Build the in-band reducer when :attr:`reduce` asks for it (``start_run``).

        Raises:
            RuntimeError: ``reduce="in_band"`` without ``torch.distributed`` initialised
                with the producer's ``world_size`` ranks.
        """
        if self.reduce == "off" or self.reducer is not None:
            return
        dist = import_torch().distributed
        if not self._distributed(world):
            if self.reduce == "in_band":
                raise RuntimeError(
                    "reduce='in_band' needs torch.distributed initialised with the "
                    f"producer's world_size ({world!r}) ranks; use reduce='off' for a "
                    "single process or per-rank sending")
            return
        before_finish = getattr(self.producer, "before_finish", None)
        if before_finish is not None:  # the last step's reduction is sent before RunFinished
            before_finish(self.flush)
        rank, size = dist.get_rank(), dist.get_world_size()
        layouts = [replica_layout(self._layout_of(i), rank, size,
                                  holders=layers.declared_by[int(pos)])
                   for i, pos in enumerate(layers.positions.tolist())]
        self.reducer = InBandReducer.create(layers, layouts, check_slices=self.check_slices)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Take a summary in every ``optimizer.step()``, before it reads the gradients.

        Registers ``optimizer.register_step_pre_hook``; the hook calls :meth:`step` with
        the tap's own step counter (0, 1, 2, ... one per ``optimizer.step()``). When
        ``step`` is given a closure (``LBFGS``, or any ``optimizer.step(closure)``), the
        gradients do not exist yet when the pre-hook runs: the hook then wraps the closure
        and takes the summary right after its first call (the gradient at the step's
        starting point), once per ``optimizer.step()``. Attach one optimiser per tap; with
        several optimisers call :meth:`step` by hand.

        Args:
            optimizer: a ``torch.optim.Optimizer`` (torch >= 2.0).

        Returns:
            The hook handle (``handle.remove()`` detaches it; :meth:`detach` removes all).

        Raises:
            TypeError: the optimiser has no ``register_step_pre_hook``.
        """
        register = getattr(optimizer, "register_step_pre_hook", None)
        if register is None:
            raise TypeError(
                f"{type(optimizer).__name__} has no register_step_pre_hook "
                "(needs a torch.optim.Optimizer, torch >= 2.0); call tap.step() by hand"
            )

        def _pre_hook(hooked: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # torch passes step()'s own positional arguments, which start with the optimiser.
            pos = 1 if args and args[0] is hooked else 0
            closure = kwargs.get("closure", args[pos] if len(args) > pos else None)
            if closure is None:
                self.step()
                return None
            fired = False

            def summarising_closure() -> Any:
                nonlocal fired
                loss = closure()
                if not fired:
                    fired = True
                    self.step()
                return loss

            if "closure" in kwargs:
                return args, {**kwargs, "closure": summarising_closure}
            return (*args[:pos], summarising_closure, *args[pos + 1 :]), kwargs

        handle = register(_pre_hook)
        self._handles.append(handle)
        self.scalars.attach_optimizer(optimizer)
        return handle

    def attach_scaler(self, scaler: Any) -> None:
        """Send the loss scale of an AMP ``torch.amp.GradScaler`` (``loss_scale``) with every
        summarised step.

        Raises:
            TypeError: ``scaler`` has no ``get_scale()``.
        """
        self.scalars.attach_scaler(scaler)

    def record_scalars(self, values: Mapping[str, Any] | None = None, /, **named: Any) -> None:
        """Training scalars of the current step from the training loop, sent with its
        summary: ``tap.record_scalars(loss=loss.detach(), tokens=n)`` (a 0-d tensor is read
        when the step is summarised, so this costs no device synchronisation; names and
        meanings in ``schemas.scalars``: ``loss``, ``tokens`` and ``samples`` are this
        rank's own).

        Raises:
            ValueError: an invalid scalar name.
        """
        self.scalars.give({**(values or {}), **named})

    def attach_ddp(self, ddp_model: Any, process_group: Any = None) -> None:
        """Turn on the per-rank local view for a ``DistributedDataParallel`` model.

        Registers :meth:`comm_hook` with ``ddp_model.register_comm_hook`` (one hook per DDP
        model, before the first backward). Lightning users pass the hook instead:
        ``DDPStrategy(ddp_comm_hook=tap.comm_hook)``.

        Args:
            ddp_model: the DDP-wrapped model whose parameters this tap watches.
            process_group: the group DDP all-reduces over (None: the default group); handed
                to DDP's default all-reduce as its state.

        Raises:
            TypeError: ``ddp_model`` has no ``register_comm_hook`` (not DDP).
        """
        register = getattr(ddp_model, "register_comm_hook", None)
        if register is None:
            raise TypeError(
                f"{type(ddp_model).__name__} has no register_comm_hook: attach_ddp needs a "
                "torch.nn.parallel.DistributedDataParallel model"
            )
        register(process_group, self.comm_hook)

    @property
    def comm_hook(self) -> Callable[..., Any]:
        """This tap's DDP communication hook, ``hook(state, bucket)`` (see
        :meth:`summarize_bucket`); DDP refuses a hook whose ``bucket`` is annotated with
        anything but ``GradBucket``, so the hook itself carries no annotations."""
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            return self.summarize_bucket(state, bucket)

        return hook

    def summarize_bucket(self, state: Any, bucket: Any) -> Any:
        """DDP communication hook: summarise the bucket's local gradients, then all-reduce.

        The bucket holds this rank's own gradients of its parameters before the reduction
        (with ``no_sync`` gradient accumulation, the sum of the step's micro-batches;
        without it, DDP reduces at every micro-batch and the last reduction's input is
        kept). They are summarised like the frame statistics (:func:`summarize_tensors`,
        one small device-to-host copy per bucket on an accelerator) and handed to the next
        :meth:`step` as the local view; then DDP's default ``allreduce_hook`` runs.

        Args:
            state: the process group for the all-reduce (None: default group).
            bucket: the ``torch.distributed.GradBucket`` DDP passes.

        Returns:
            The all-reduce future of DDP's default hook.
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        names = []
        views = []
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            name = self._name_of.get(id(param))
            if name is not None and grad is not None and grad.numel() > 0:
                names.append(name)
                views.append(grad)
        if names:
            local = summarize_tensors(dict(zip(names, views, strict=True)),
                                      host_numpy=self.host_numpy, accumulate=self.accumulate,
                                      emulate_device=self.emulate_device)
            for i, name in enumerate(local.names):
                self._local_rows[name] = (
                    int(local.numel[i]), float(local.sum_abs[i]),  # type: ignore[index]
                    float(local.sum_sq[i]), float(local.max_abs[i]),  # type: ignore[index]
                    int(local.nonfinite[i]),
                )
        return default_hooks.allreduce_hook(state, bucket)

    def _take_local(self) -> LayerSummaries | None:
        """The local view gathered by :meth:`comm_hook` since the last step (model
        order), then forgotten; None when no hook ran."""
        if not self._local_rows:
            return None
        rows = self._local_rows
        self._local_rows = {}
        names = tuple(n for n, _ in self._params if n in rows)
        table = np.array([rows[n] for n in names], dtype=np.float64).reshape(len(names), 5)
        return LayerSummaries(
            names, table[:, 0].astype(np.int64), table[:, 1], table[:, 2], table[:, 3],
            table[:, 4].astype(np.int64),
        )

    def detach(self) -> None:
        """Remove every optimiser hook this tap registered (a deferred summary still
        waiting is handed over first, see :meth:`flush`)."""
        self.flush()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.scalars.detach()

    def flush(self) -> LayerSummaries | None:
        """Hand a deferred summary (``defer``) to the producer now, waiting for its copy.

        Returns:
            The summaries handed over, or None when none was waiting.

        Raises:
            Whatever ``producer.record_summaries`` raises.
        """
        t0 = time.perf_counter()
        handed, inside = self._hand_over_pending()
        reduced, inside_reduced = self._hand_over_reduced()
        self._count_time(time.perf_counter() - t0 - inside - inside_reduced)
        return reduced if reduced is not None else handed

    def _hand_over_reduced(self) -> tuple[LayerSummaries | None, float]:
        """Collect the in-band reduction in flight; on the sending rank record its result.
        (summaries or None, seconds spent inside ``record_summaries``)."""
        if self.reducer is None:
            return None, 0.0
        settings = getattr(self.producer, "settings", None)
        done = self.reducer.collect(norms_only=getattr(settings, "mode", "full") == "norms")
        if done is None or done.summaries is None:
            return None, 0.0
        t0 = time.perf_counter()
        self.producer.record_summaries(done.step, done.summaries, scalars=done.scalars,
                                       rank_scalars=done.rank_scalars)
        self.steps_recorded += 1
        return done.summaries, time.perf_counter() - t0

    def _local_piece(self, i: int, grad: Any) -> tuple[Any, int, int] | None:
        """This rank's piece of watched parameter ``i``'s gradient ``grad``: what
        :func:`gradient_piece` returns, or for an FSDP v1 original parameter what its
        :class:`~producer.adapters.torch_fsdp1.OriginalParameter` cuts from the flat chunk;
        None when there is nothing to summarise, counted in :attr:`skipped_without_grad`
        (no gradient) or :attr:`skipped_not_local` (no piece on this rank, an empty one, or
        a pending reduction)."""
        slot = self._slots[i]
        if grad is None and (slot is None or slot.local):
            self.skipped_without_grad += 1
            return None
        piece = gradient_piece(grad) if slot is None else slot.piece(grad)
        if piece is None or piece[0].numel() == 0:
            self.skipped_not_local += 1
            return None
        return piece

    def _reduce_step(self, step: int) -> LayerSummaries | None:
        """:meth:`step` in in-band mode: hand over the previous step's reduction, summarise
        this rank's owned and cross-checked pieces, launch their reduction (every rank
        joins it, with or without gradients)."""
        assert self.reducer is not None
        handed, inside = self._hand_over_reduced()
        self._inside += inside
        owned, checked = self.reducer.select(step)
        grads: dict[str, Any] = {}
        positions: list[int] = []
        assert self.run_layers is not None  # set by start_run with the reducer
        own = self.run_layers.positions
        for i in np.flatnonzero((owned | checked)[own]).tolist():
            piece = self._local_piece(i, self._tensors[i].grad)
            if piece is None:
                continue
            grads[self._names[i]] = piece[0]
            positions.append(int(own[i]))
        local = self._take_local()
        if local is not None:
            record_local = getattr(self.producer, "record_local", None)
            if record_local is not None:
                record_local(step, local)
        summaries = None
        if grads:
            settings = getattr(self.producer, "settings", None)
            summaries = launch_summaries(
                grads, host_numpy=self.host_numpy,
                norms_only=getattr(settings, "mode", "full") == "norms",
                accumulate=self.accumulate, keep_gradients=True,
                emulate_device=self.emulate_device,
            ).result()
        self.reducer.launch(step, np.asarray(positions, np.int64), summaries, owned, checked,
                            self.scalars.take(step))
        return handed

    def _hand_over_pending(self) -> tuple[LayerSummaries | None, float]:
        """Finish the waiting deferred summary and record it; (summaries or None, seconds
        spent inside ``record_summaries``)."""
        if self._pending is None:
            return None, 0.0
        step, pending, index, count, local, scalars = self._pending
        self._pending = None
        summaries = pending.result()
        if pending.inexact:
            self.inexact_layers += pending.inexact
            self.defer = False
            log.warning(
                "step %d: %d layer(s) had NaN/Inf gradients read after the step (deferred "
                "mode); reported with nonfinite = numel; reading synchronously from now on",
                step, pending.inexact,
            )
        return self._record(step, summaries, index, count, local, scalars)

    def _record(
        self, step: int, summaries: LayerSummaries, index: np.ndarray, count: np.ndarray,
        local: LayerSummaries | None, scalars: dict[str, float],
    ) -> tuple[LayerSummaries, float]:
        """Attach layout and local view, call ``record_summaries``; (the summaries handed
        over, seconds spent inside ``record_summaries``: the producer counts those)."""
        summaries = summaries.with_layout(index, count)
        if local is not None:
            summaries = summaries.with_local(local)
        t0 = time.perf_counter()
        self.producer.record_summaries(step, summaries, scalars=scalars)
        inside = time.perf_counter() - t0
        self.steps_recorded += 1
        return summaries, inside

    def _count_time(self, seconds: float) -> None:
        """Add the tap's own training-thread seconds to the producer's accounting."""
        add = getattr(self.producer, "add_training_time", None)
        if add is not None and seconds > 0:
            add(seconds)

    def step(self, step: int | None = None) -> LayerSummaries | None:
        """Summarise the current ``.grad`` of the watched parameters for one optimiser step.

        Call it after the last ``backward()`` of the step and before ``optimizer.step()``
        (or let :meth:`attach_optimizer` do it).

        Args:
            step: the optimiser step number, >= 0; default :attr:`next_step`. Afterwards
                :attr:`next_step` is ``step + 1``.

        Returns:
            The summaries handed to ``producer.record_summaries`` in this call, or ``None``
            when the step is not a multiple of ``every_n_steps``, no watched parameter has a
            gradient, or (deferred mode) nothing was waiting: in deferred mode a summarised
            step hands over the previous summarised step's statistics and queues its own.

        Raises:
            ValueError: a negative or non-integer step.
            TypeError: a gradient of a non-floating-point dtype.
            Whatever ``producer.record_summaries`` raises (e.g. RuntimeError before
            ``start_run``).
        """
        t0 = time.perf_counter()
        self._inside = 0.0
        try:
            return self._step(step)
        finally:
            self._count_time(time.perf_counter() - t0 - self._inside)

    def _step(self, step: int | None) -> LayerSummaries | None:
        """:meth:`step` without the time accounting (``self._inside`` collects the seconds
        spent inside ``record_summaries``)."""
        self._refuse_unsupported()
        if step is None:
            step = self.next_step
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        step = int(step)
        self.next_step = step + 1
        if step % self.every_n_steps:
            return None
        if self.reducer is not None:
            return self._reduce_step(step)
        handed, inside = self._hand_over_pending()
        self._inside += inside
        grads: dict[str, Any]
        current = [param.grad for param in self._tensors]
        if self._plain and not any(grad is None for grad in current):
            grads = dict(zip(self._names, current, strict=True))
            index, count = self._whole_index, self._whole_count
        else:
            grads = {}
            index_list: list[int] = []
            count_list: list[int] = []
            for i, ((name, _), grad) in enumerate(zip(self._params, current, strict=True)):
                piece = self._local_piece(i, grad)
                if piece is None:
                    continue
                grads[name] = piece[0]
                index_list.append(piece[1])
                count_list.append(piece[2])
            index, count = np.asarray(index_list), np.asarray(count_list)
        local = self._take_local()
        scalars = self.scalars.take(step)
        if not grads:
            self.steps_without_gradients += 1
            return handed
        settings = getattr(self.producer, "settings", None)
        norms_only = getattr(settings, "mode", "full") == "norms"
        pending = launch_summaries(
            grads, host_numpy=self.host_numpy, norms_only=norms_only,
            accumulate=self.accumulate, keep_gradients=not self.defer,
            emulate_device=self.emulate_device,
        )
        if self.defer:
            self._pending = (step, pending, index, count, local, scalars)
            return handed
        handed, inside = self._record(step, pending.result(), index, count, local, scalars)
        self._inside += inside
        return handed
