"""Data-parallel training of the demo MLP across N OS processes, with per-rank telemetry.

This is what ``gradstream demo`` really runs. Each rank is a separate process (multiprocessing,
``"spawn"`` context, like one process per GPU under ``torchrun``):

1. every rank builds the same initial parameters from the seed;
2. at step ``s`` every rank draws the same global minibatch (indices from ``(seed, s)``) and
   takes its own shard, rows ``rank::world_size``;
3. it computes the loss and gradients of its shard (:func:`deploy.demo.mlp.forward_backward`),
   its *local* gradients, and times that computation (``compute_time_s``; a straggling
   scenario's slow rank takes longer here, :meth:`~deploy.demo.scenarios.Scenario.
   compute_delay`);
4. it sends the local gradients to the parent process (the coordinator) through a
   :func:`multiprocessing.Pipe`; the parent averages them, weighted by shard size (an all-reduce
   emulation: with equal shards this is the plain mean that ``DistributedDataParallel`` uses,
   and in every case it equals the gradient of the mean loss over the whole global batch), and
   sends the average back;
5. it hands its telemetry the averaged gradient, the one SGD applies and the same (bit for
   bit) on every rank, together with its local gradients as the per-rank local view (in the
   real demo: the gradstream producer SDK, which sends the averaged gradient as a replicated
   layout, counted once by the consumer, and the local view apart), with its training
   scalars: its shard's loss, the learning rate, its samples and its compute time;
6. every rank applies the same SGD update to the same parameters, so the replicas stay
   bit-identical (checked at the end by comparing a checksum of every rank's parameters).

The pathologies of the scenarios (:mod:`deploy.demo.scenarios`) come from the training
itself: nothing in here invents or post-processes a gradient. In ``bad-rank`` one rank's
*input data* is corrupted (:meth:`~deploy.demo.scenarios.Scenario.shard_inputs`); what its
gradients and everyone's update do follows from the backpropagation and the all-reduce.

Failure handling: an exception in a rank is sent to the parent and re-raised there as
:class:`RankError` naming the rank; a rank that dies without reporting is detected through its
pipe and process sentinel. On any error, and on :class:`KeyboardInterrupt` in the parent, the
parent closes the pipes (ranks blocked on them exit), waits briefly, then terminates and finally
kills what is left, so no process outlives :func:`run_data_parallel`. Ranks ignore SIGINT:
Ctrl-C in a terminal reaches the whole process group, and the parent alone decides the shutdown.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deploy.demo.mlp import (
    Params,
    forward_backward,
    load_digits_dataset,
    sgd_update,
)
from deploy.demo.scenarios import SCENARIOS
from deploy.demo.telemetry import Telemetry


class RankError(RuntimeError):
    """A training rank failed; raised in the parent by :func:`run_data_parallel`.

    Attributes:
        rank: the failed rank.
        step: the optimiser step at which it failed, or None if unknown.
        exitcode: the process exit code if it died without a report, else None.
        remote_traceback: the formatted traceback from the rank, or ``""``.
    """

    def __init__(
        self,
        rank: int,
        message: str,
        *,
        step: int | None = None,
        exitcode: int | None = None,
        remote_traceback: str = "",
    ) -> None:
        where = f"rank {rank}" + (f" at step {step}" if step is not None else "")
        text = f"{where} failed: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback in {where} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)
        self.rank = rank
        self.step = step
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback

    @classmethod
    def exited(cls, rank: int, proc: Any, step: int | None, when: str) -> RankError:
        """The error of a rank process that died, after waiting up to 5 s for its exit code.

        Args:
            rank: the rank.
            proc: its ``multiprocessing.Process``.
            step: the optimiser step the parent was at, or None.
            when: what the rank had not done yet, e.g. ``"without reporting"``.
        """
        proc.join(timeout=5)
        return cls(rank, f"process exited (exit code {proc.exitcode}) {when}", step=step,
                   exitcode=proc.exitcode)


@dataclass
class TrainingResult:
    """The outcome of :func:`run_data_parallel`.

    Attributes:
        scenario: scenario name.
        world_size: number of ranks.
        steps: optimiser steps completed.
        losses: global loss per step (shard losses weighted by shard size, i.e. the mean
            cross-entropy over the global batch); may contain inf/nan.
        params_checksum: :func:`params_checksum` of the final parameters of rank 0.
        rank_checksums: the same checksum from every rank, index = rank.
        wall_time_s: seconds from the first process start to the last rank's report.
        final_params: rank 0's final parameters (float32, model order).
    """

    scenario: str
    world_size: int
    steps: int
    losses: list[float]
    params_checksum: str
    rank_checksums: list[str]
    wall_time_s: float
    final_params: Params = field(repr=False)

    @property
    def params_identical(self) -> bool:
        """True if every rank ended with bit-identical parameters."""
        return all(c == self.params_checksum for c in self.rank_checksums)


def params_checksum(params: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the names, dtypes, shapes and raw bytes of the parameters, in order.

    Args:
        params: name -> array.

    Returns:
        Hex digest; equal for bit-identical parameters (nan payloads included).
    """
    digest = hashlib.sha256()
    for name, p in params.items():
        arr = np.ascontiguousarray(p)
        digest.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
        digest.update(arr.tobytes())
    return digest.hexdigest()


class _CoordinatorGoneError(Exception):
    """The parent closed the pipe (it is shutting down)."""


def _call_abort(telemetry: object) -> None:
    abort = getattr(telemetry, "abort", None)
    if callable(abort):
        with contextlib.suppress(Exception):  # best effort while shutting down
            abort()


def _rank_main(
    rank: int,
    world_size: int,
    scenario_name: str,
    steps: int,
    seed: int,
    x: np.ndarray,
    y: np.ndarray,
    make_telemetry: Callable[[int, int], Telemetry],
    conn: multiprocessing.connection.Connection,
) -> None:
    """Body of one rank process (see the module docstring). Protocol over ``conn``:

    rank -> parent: ``("grads", step, loss, n_rows, flat_float32)`` each step, then
    ``("done", checksum, params_or_None)``, or ``("error", step, "Type: msg", traceback)``.
    parent -> rank: ``("avg", step, flat_float32)``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides the shutdown
    telemetry: Telemetry | None = None
    step = -1

    def send(msg: tuple[Any, ...]) -> None:
        try:
            conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise _CoordinatorGoneError from exc

    def recv() -> Any:
        try:
            return conn.recv()
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise _CoordinatorGoneError from exc

    try:
        scenario = SCENARIOS[scenario_name]
        params = scenario.init_params(seed)
        names = list(params)
        shapes = [params[n].shape for n in names]
        sizes = [params[n].size for n in names]
        offsets = np.cumsum([0, *sizes])
        tel = telemetry = make_telemetry(rank, world_size)
        tel.start({n: int(s) for n, s in zip(names, sizes, strict=True)})
        for step in range(steps):
            started = time.perf_counter()
            rows = scenario.batch_indices(step, seed, len(x))[rank::world_size]
            xs = scenario.shard_inputs(x, rows, rank, world_size, step)
            ys = scenario.shard_labels(y, rows, step, scenario.layer_sizes[-1])
            loss, grads = forward_backward(params, xs, ys, scenario.activation)
            time.sleep(scenario.compute_delay(rank, world_size, step))
            compute_s = time.perf_counter() - started
            flat = np.concatenate([grads[n].ravel() for n in names])
            send(("grads", step, loss, len(rows), flat))
            tag, avg_step, avg = recv()
            if tag != "avg" or avg_step != step:
                raise RuntimeError(f"protocol error: expected avg of step {step}, got {tag}")
            applied = {
                n: avg[offsets[i] : offsets[i + 1]].reshape(shapes[i])
                for i, n in enumerate(names)
            }
            tel.step(step, applied, weights=params, local=grads, scalars={
                "loss": loss, "lr": scenario.lr_at(step), "samples": float(len(rows)),
                "compute_time_s": compute_s})
            sgd_update(params, applied, scenario.lr_at(step))
        step = -1  # a failure from here on is not tied to a step
        telemetry = None  # finish() was called: no abort() on a failure in it
        tel.finish()
        send(("done", params_checksum(params), params if rank == 0 else None))
    except _CoordinatorGoneError:
        _call_abort(telemetry)
    except BaseException as exc:
        _call_abort(telemetry)
        with contextlib.suppress(Exception):  # the parent may be gone already
            conn.send(
                (
                    "error",
                    step if step >= 0 else None,
                    f"{type(exc).__name__}: {exc}",
                    traceback.format_exc(),
                )
            )
        raise SystemExit(1) from None
    finally:
        conn.close()


def _receive_all(
    conns: list[multiprocessing.connection.Connection],
    procs: list[Any],
    expected: str,
    step: int | None,
    timeout: float | None,
) -> list[tuple[Any, ...]]:
    """One message from every rank, failing fast on the first rank that errors or dies."""
    pending = set(range(len(conns)))
    messages: list[tuple[Any, ...] | None] = [None] * len(conns)
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        wait_for: list[Any] = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait(wait_for, timeout=remaining)
        if not ready:
            rank = min(pending)
            raise RankError(
                rank, f"no {expected!r} message within {timeout:g} s (hung?)", step=step
            )
        for rank in sorted(pending):
            conn, proc = conns[rank], procs[rank]
            if conn.poll():
                try:
                    msg = conn.recv()
                except (EOFError, ConnectionResetError, OSError):
                    raise RankError.exited(rank, proc, step, "without reporting") from None
                if msg[0] == "error":
                    _, err_step, text, tb = msg
                    raise RankError(rank, text, step=err_step, remote_traceback=tb)
                if msg[0] != expected or (step is not None and msg[1] != step):
                    raise RankError(rank, f"protocol error: got {msg[0]!r}, expected {expected!r}")
                messages[rank] = msg
                pending.discard(rank)
            elif not proc.is_alive():
                raise RankError.exited(rank, proc, step, "without reporting")
    return [m for m in messages if m is not None]


def _send_avg(
    rank: int,
    conn: multiprocessing.connection.Connection,
    proc: Any,
    step: int,
    avg: np.ndarray,
) -> None:
    """Send the averaged gradient to one rank; a dead rank becomes a :class:`RankError`."""
    try:
        conn.send(("avg", step, avg))
    except (BrokenPipeError, ConnectionResetError, OSError):
        raise RankError.exited(rank, proc, step,
                               "before receiving the averaged gradient") from None


def _shutdown(
    procs: list[Any], conns: list[multiprocessing.connection.Connection], grace: float
) -> None:
    """Close the pipes, give the ranks ``grace`` seconds, then terminate, then kill."""
    for conn in conns:
        conn.close()
    try:
        deadline = time.monotonic() + grace
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:  # also on a second Ctrl-C during the grace period
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()


def run_data_parallel(
    scenario: str,
    world_size: int,
    steps: int | None,
    make_telemetry: Callable[[int, int], Telemetry],
    on_step: Callable[[int, float], None] | None = None,
    seed: int = 0,
    *,
    rank_timeout: float | None = 300.0,
    shutdown_grace: float = 10.0,
) -> TrainingResult:
    """Train ``scenario`` data-parallel on ``world_size`` processes; each rank emits telemetry.

    Args:
        scenario: a key of :data:`SCENARIOS`.
        world_size: number of rank processes, ``1 <= world_size <= batch_size``.
        steps: optimiser steps (>= 0); None for the scenario's default.
        make_telemetry: ``make_telemetry(rank, world_size) -> Telemetry``, called inside each
            rank process; it must be picklable (a module-level function or class, or a
            ``functools.partial`` of one), e.g. ``NullTelemetry``,
            ``partial(RecordingTelemetry, directory)`` or ``partial(kafka_telemetry, ...)``.
        on_step: called in the parent as ``on_step(step, loss)`` after the gradients of
            ``step`` have been averaged (global batch loss; may be nan). An exception in it
            (including KeyboardInterrupt) stops the training and is re-raised.
        seed: run seed (initial parameters and minibatch order).
        rank_timeout: seconds to wait for any expected message from the ranks before giving up
            (None: forever); the first report includes process start-up and the data transfer.
        shutdown_grace: seconds the ranks get to exit by themselves after an error or an
            interrupt (e.g. to close a Kafka producer) before they are terminated.

    Returns:
        A :class:`TrainingResult`.

    Raises:
        ValueError: unknown scenario, ``world_size``/``steps`` out of range, or a scenario
            whose corrupted rank a run of ``world_size`` ranks does not have.
        TypeError: ``make_telemetry`` cannot be pickled.
        ImportError: scikit-learn (the data set) is missing.
        RankError: a rank raised an exception, died, hung beyond ``rank_timeout`` or ended with
            parameters different from rank 0's. Every rank process has been ended and joined
            before this (or any other exception, including KeyboardInterrupt) propagates.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {sorted(SCENARIOS)}")
    sc = SCENARIOS[scenario]
    n_steps = sc.steps if steps is None else int(steps)
    if n_steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not 1 <= world_size <= sc.batch_size:
        raise ValueError(f"world_size must be in [1, {sc.batch_size}], got {world_size}")
    sc.corrupted_rank(world_size)  # the corrupted rank must exist
    try:
        pickle.dumps(make_telemetry)
    except Exception as exc:
        raise TypeError(
            "make_telemetry must be picklable (a module-level function/class or a "
            f"functools.partial of one): {exc}"
        ) from exc
    x, y = load_digits_dataset(np.float32)
    x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)

    ctx = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    conns: list[multiprocessing.connection.Connection] = []
    losses: list[float] = []
    start = time.perf_counter()
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            conns.append(parent_end)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, world_size, scenario, n_steps, seed, x, y, make_telemetry, child_end),
                name=f"gradstream-demo-rank{rank}",
                daemon=True,
            )
            procs.append(proc)
            proc.start()
            child_end.close()  # the child holds its end; a dead child then reads as EOF here
        for step in range(n_steps):
            msgs = _receive_all(conns, procs, "grads", step, rank_timeout)
            rows = np.array([m[3] for m in msgs], dtype=np.float64)
            weights = rows / rows.sum()
            with np.errstate(all="ignore"):
                avg64 = np.zeros(msgs[0][4].shape, dtype=np.float64)
                for w, m in zip(weights, msgs, strict=True):
                    avg64 += w * m[4]
                avg = avg64.astype(np.float32)
                loss = float(sum(w * m[2] for w, m in zip(weights, msgs, strict=True)))
            for rank, conn in enumerate(conns):
                _send_avg(rank, conn, procs[rank], step, avg)
            losses.append(loss)
            if on_step is not None:
                on_step(step, loss)
        done = _receive_all(conns, procs, "done", None, rank_timeout)
        wall = time.perf_counter() - start
    finally:
        _shutdown(procs, conns, shutdown_grace)

    checksums = [m[1] for m in done]
    for rank, checksum in enumerate(checksums):
        if checksum != checksums[0]:
            raise RankError(rank, "parameters differ from rank 0's after training")
    return TrainingResult(
        scenario=scenario,
        world_size=world_size,
        steps=n_steps,
        losses=losses,
        params_checksum=checksums[0],
        rank_checksums=checksums,
        wall_time_s=wall,
        final_params=done[0][2],
    )
