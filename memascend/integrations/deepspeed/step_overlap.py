"""The optimizer step beside the next forward: the chunked step's sub-groups run on a worker thread
while the forward starts on the parameters they have already updated.

MemAscend's chunked step (:mod:`.chunked_step`) moves every byte of the NVMe-swapped optimizer state
through the disk once per step; on the default job it is the one phase that waits on I/O (about
1.2 of its 1.9 s) while the CPU is idle. Systems compared against ZeRO-Infinity hide that time
behind compute (GreedySnake, 2025: overlap the optimizer step with the next iteration's forward).
With ``enable_step_overlap``, stage 3's ``step`` (``DeepSpeedZeroOptimizer_Stage3.step``,
DeepSpeed 0.19.8) runs its prologue as stock does (partitioning, overflow check, the clipping norm,
:func:`~.chunked_step.adam_hparams`) and hands each sub-group's chunk loop and release, and the
bookkeeping of ``_post_step``, to a worker thread in stock's order; ``engine.step()`` returns and the
training loop goes on to the next forward. The forward's parameter fetches wait for exactly the
parameters they read:

* every 16-bit partition has an end offset in its sub-group's flat partition (stock's
  ``fp16_partitioned_groups`` order, the order the chunk loop writes); the chunk loop publishes,
  per sub-group, how many leading elements are written and visible (copied into DRAM, or written
  to the parameters' swap files and completed, :class:`~.chunk_param_writer.ParamWriter`);
* ``PartitionedParameterCoordinator.fetch_sub_module``, its all-gather of a module's and of the
  prefetched modules' parameters, and its NVMe prefetch wait (:meth:`StepOverlap.wait_for`) until
  every parameter they touch is visible;
* stock's ``_post_step`` all-gathers the persistent (small, never released) parameters once after
  the loop; here each is all-gathered, as stock does, just before the first module that uses it
  (once its partition is visible), and the rest at the join.

Everything else waits for the whole step (:meth:`StepOverlap.join`): the backward
(``backward_prologue``: it reuses the optimizer swapper's gradient files and handle), the next
``step``, checkpoint save and load and the 16-bit state dict (``checkpoint_event_prologue``),
``GatheredParameters`` and ``engine.destroy``. An exception on the worker is raised again on the
training thread at its next wait.

Bit-identity: the same Adam calls on the same values (the hyperparameters are taken before the
scheduler moves them, the clip factor before the loop, as stock), and no forward reads a parameter
before its update is complete; only when the work happens changes. The worker runs no collective:
with several ranks every all-gather stays on the training thread, in stock's order.

Eligible: every sub-group stepped in chunks with read-ahead (an asynchronous swap target: DeepSpeed's
aio handle), no ZeRO++ secondary partitions or quantized weights; otherwise the step is stock's
sequence (chunked or not).
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memascend.config.settings import MemAscendSettings

_IN_FLIGHT: weakref.WeakSet[StepOverlap] = weakref.WeakSet()
"""Overlaps whose step is queued or running (the coordinator's patches wait on these)."""


class StepOverlap:
    """One stage-3 optimizer's steps, each run on a worker thread beside the next forward.

    Args:
        opt: the ``DeepSpeedZeroOptimizer_Stage3``.
    """

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self._cond = threading.Condition()
        self._jobs: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._running = False
        self._visible_numel: dict[int, int] = {}
        self.deferring = False
        """True while stage 3's ``step`` runs on the training thread: the chunked sub-group methods
        queue their work (:meth:`defer`) instead of doing it."""
        self.param_end: dict[int, tuple[int, int]] = {}
        """``id(param)`` -> (sub-group, end offset of its partition in the sub-group's flat order)."""
        for sub_group_id, parts in enumerate(opt.fp16_partitioned_groups):
            end = 0
            for param, part in zip(opt.fp16_groups[sub_group_id], parts):
                end += int(part.ds_numel)
                self.param_end[id(param)] = (sub_group_id, end)
        self._persistent_pending: set[int] = set()
        self.steps = 0
        """Steps run on the worker."""
        self.wait_s = 0.0
        """Seconds the training thread waited for the worker (parameters, joins)."""
        self.worker_s = 0.0
        """Seconds the worker spent on steps."""

    # -- the step ---------------------------------------------------------------------------------
    def defer(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (a chunked sub-group's loop or release, or ``_post_step``'s bookkeeping)."""
        self._jobs.append(job)

    def launch(self) -> None:
        """Run the queued jobs on a worker thread, in order (nothing queued: an overflow skipped the
        step). The persistent parameters are all-gathered lazily (:meth:`wait_for`)."""
        jobs, self._jobs = self._jobs, []
        if not jobs:
            return
        self._visible_numel = {i: 0 for i in range(len(self.opt.fp16_groups))}
        self._persistent_pending = {id(p) for p in self.opt.persistent_parameters if id(p) in self.param_end}
        self._running = True
        _IN_FLIGHT.add(self)
        self._thread = threading.Thread(target=self._work, args=(jobs,), name="memascend-step", daemon=True)
        self._thread.start()

    def _work(self, jobs: list[Callable[[], None]]) -> None:
        from memascend.integrations.deepspeed.io_meter import count_as_step_worker

        count_as_step_worker()
        _raise_priority()
        start = time.perf_counter()
        try:
            with torch.no_grad():
                for job in jobs:
                    job()
        except BaseException as exc:  # raised again on the training thread
            self._error = exc
        finally:
            with self._cond:
                self._running = False
                self.worker_s += time.perf_counter() - start
                self.steps += 1
                self._cond.notify_all()

    def publish(self, sub_group_id: int, visible_numel: int) -> None:
        """The chunk loop's progress: the first ``visible_numel`` elements of sub-group
        ``sub_group_id``'s 16-bit partition hold this step's values (worker thread)."""
        with self._cond:
            if visible_numel > self._visible_numel.get(sub_group_id, 0):
                self._visible_numel[sub_group_id] = visible_numel
                self._cond.notify_all()

    def run_post_step(self, post_step: Callable[[], Any]) -> None:
        """``_post_step``'s bookkeeping on the worker, without its all-gather of the persistent
        parameters (a collective, and a write of parameters the forward reads): :meth:`wait_for`
        gathers each before its first use and :meth:`join` the rest."""
        opt = self.opt
        persistent, opt.persistent_parameters = opt.persistent_parameters, []
        try:
            post_step()
        finally:
            opt.persistent_parameters = persistent

    # -- the training thread ----------------------------------------------------------------------
    def in_flight(self) -> bool:
        """Whether a step is queued or running, or persistent parameters wait to be gathered."""
        return self._thread is not None

    def wait_for(self, params: Iterable[Any]) -> None:
        """Block until every parameter of ``params`` that this optimizer updates holds this step's
        values; all-gather the persistent ones among them (stock's ``param.all_gather``), as stock's
        ``_post_step`` would have. Training thread.

        Raises:
            BaseException: what the worker raised (after it stopped).
        """
        if self._thread is None:
            return
        params = list(params)
        needed = self._needed(params)
        if needed:
            start = time.perf_counter()
            with self._cond:
                while self._missing(needed):
                    self._cond.wait()
            self.wait_s += time.perf_counter() - start
        self._raise_error()
        self._gather_persistent([p for p in params if id(p) in self._persistent_pending])

    def visible(self, param: Any) -> bool:
        """Whether ``param`` holds this step's values (or is not one this optimizer updates)."""
        if self._thread is None:
            return True
        needed = self._needed([param])
        with self._cond:
            return not self._missing(needed)

    def _needed(self, params: list[Any]) -> dict[int, int]:
        """Per sub-group, the visible elements ``params`` need (those this optimizer updates)."""
        needed: dict[int, int] = {}
        for param in params:
            where = self.param_end.get(id(param))
            if where is not None and where[1] > needed.get(where[0], 0):
                needed[where[0]] = where[1]
        return needed

    def _missing(self, needed: dict[int, int]) -> bool:
        """Whether the worker still runs and has not made ``needed`` visible (``_cond`` held)."""
        return self._running and any(self._visible_numel.get(g, 0) < n for g, n in needed.items())

    def join(self) -> None:
        """Complete the step in flight and all-gather the persistent parameters no forward has
        gathered yet. Training thread; a no-op without a step in flight.

        Raises:
            BaseException: what the worker raised.
        """
        thread = self._thread
        if thread is None:
            return
        start = time.perf_counter()
        thread.join()
        self.wait_s += time.perf_counter() - start
        self._raise_error()
        pending = [p for p in self.opt.persistent_parameters if id(p) in self._persistent_pending]
        self._gather_persistent(pending)
        self._done()

    def settle(self) -> None:
        """Wait for the worker to stop and drop the step in flight: its error, and the persistent
        parameters not gathered (cleanup after another error)."""
        if self._thread is not None:
            self._thread.join()
        self._error = None
        self._done()

    def _done(self) -> None:
        self._thread = None
        _IN_FLIGHT.discard(self)

    def _gather_persistent(self, params: list[Any]) -> None:
        """All-gather ``params`` (persistent, their partitions visible: the callers waited) that are
        not gathered yet, as stock's ``_post_step`` does."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        todo = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        for p in params:
            self._persistent_pending.discard(id(p))
        if todo:
            todo[0].all_gather(todo)

    def _raise_error(self) -> None:
        if self._error is not None and not self._running:
            error, self._error = self._error, None
            if self._thread is not None:
                self._thread.join()
            self._done()
            raise error


WORKER_NICE = -5
"""The worker's scheduling priority (Linux nice, per thread; its OpenMP threads inherit it): it is on
the forward's critical path (the forward's fetches wait for the chunks it writes, the backward for
its end), so it runs ahead of the training thread where the process may raise a priority."""


def _raise_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
    except OSError:  # not permitted (no CAP_SYS_NICE): the default priority
        pass


def join_all(*, raise_errors: bool = True) -> None:
    """Complete every step in flight in this process (:meth:`StepOverlap.join`).

    Args:
        raise_errors: raise what a worker raised; ``False`` (cleanup after another error): only
            wait for the workers to stop.
    """
    for overlap in list(_IN_FLIGHT):
        if raise_errors:
            overlap.join()
        else:
            overlap.settle()


def overlap_of(optimizer: Any) -> StepOverlap | None:
    """The :class:`StepOverlap` of a stage-3 optimizer (its chunked step's), or ``None``."""
    plan = getattr(optimizer, "__dict__", {}).get("_memascend_chunked")
    return (plan.overlap or None) if plan else None


def worker_seconds(optimizer: Any) -> float | None:
    """Seconds the worker has spent on optimizer steps so far (a finished step's whole time, an
    unfinished one's none); ``None`` where the optimizer has no step overlap."""
    overlap = overlap_of(optimizer)
    return None if overlap is None else overlap.worker_s


def stats(optimizer: Any) -> dict[str, Any] | None:
    """``report.json``'s ``step_overlap`` for a stage-3 optimizer: ``steps`` run beside the forward,
    ``wait_s`` (seconds the training thread waited for them: parameter fetches and joins) and
    ``worker_s`` (seconds the worker spent on them); ``None`` where no step ran that way."""
    overlap = overlap_of(optimizer)
    if overlap is None or not overlap.steps:
        return None
    return {"steps": overlap.steps, "wait_s": round(overlap.wait_s, 4), "worker_s": round(overlap.worker_s, 4)}


def _wait_for(params: Iterable[Any]) -> None:
    overlaps = list(_IN_FLIGHT)
    if overlaps:
        params = list(params)
        for overlap in overlaps:
            overlap.wait_for(params)


def overlap_eligible(opt: Any, plan: Any) -> bool:
    """Whether stage-3 optimizer ``opt`` can run its steps beside the forward: every sub-group
    stepped in chunks by ``plan`` (:class:`~.chunked_step.ChunkedSubGroups`) with read-ahead, no
    ZeRO++ secondary partitions, no quantized weights, and every DRAM flat partition already the
    storage of its parameters' partitions (the forward reads them while the loop writes)."""
    if plan is None or not plan.read_ahead or plan.sub_groups != set(range(len(opt.fp16_groups))):
        return False
    if getattr(opt, "zero_hpz_partition_size", 1) > 1 or getattr(opt, "zero_quantized_weights", False):
        return False
    for sub_group_id, flat in enumerate(opt.fp16_partitioned_groups_flat):
        if flat is None:
            continue
        offset = 0
        for part in opt.fp16_partitioned_groups[sub_group_id]:
            numel = int(part.ds_numel)
            if numel and part.data_ptr() != flat.narrow(0, offset, numel).data_ptr():
                return False
            offset += numel
    return True


# ---- patches --------------------------------------------------------------------------------------


def make_step(original: Any, settings: MemAscendSettings) -> Any:
    """``DeepSpeedZeroOptimizer_Stage3.step``: the previous step completed first; then stock's step
    with the chunked sub-groups' loops and ``_post_step`` queued (:attr:`StepOverlap.deferring`) and
    run on the worker."""
    from memascend.integrations.deepspeed.chunked_step import _chunked

    @functools.wraps(original)
    def step(self, closure=None):
        plan = _chunked(self, settings)
        if plan is not None and plan.overlap is None:
            plan.overlap = StepOverlap(self) if overlap_eligible(self, plan) else False
        overlap = plan.overlap if plan is not None else None
        if not overlap:
            return original(self, closure)
        overlap.join()
        overlap.deferring = True
        try:
            result = original(self, closure)
        except BaseException:
            overlap._jobs.clear()
            raise
        finally:
            overlap.deferring = False
        overlap.launch()
        return result

    return step


def make_joining(original: Any) -> Any:
    """A stage-3 optimizer method that needs the whole step done (``backward_prologue``,
    ``checkpoint_event_prologue``, ``state_dict``, ``load_state_dict``)."""

    @functools.wraps(original)
    def joining(self, *args, **kwargs):
        overlap = overlap_of(self)
        if overlap is not None:
            overlap.join()
        return original(self, *args, **kwargs)

    return joining


def make_join_all_first(original: Any) -> Any:
    """A method that needs every step in flight done (``GatheredParameters.__enter__``,
    ``DeepSpeedEngine.destroy``)."""

    @functools.wraps(original)
    def join_first(*args, **kwargs):
        join_all()
        return original(*args, **kwargs)

    return join_first


_FETCH = threading.local()
"""``ids``: the parameters of the module the training thread is fetching (its own all-gather is the
fetch; any other is a prefetch)."""


def _visible(params: Iterable[Any]) -> bool:
    return all(overlap.visible(p) for overlap in list(_IN_FLIGHT) for p in params)


def make_fetch_sub_module(original: Any) -> Any:
    """``PartitionedParameterCoordinator.fetch_sub_module``: the module's parameters visible first."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    from deepspeed.utils import z3_leaf_module

    @functools.wraps(original)
    def fetch_sub_module(self, current_submodule, forward):
        if not _IN_FLIGHT:
            return original(self, current_submodule, forward)
        params = list(iter_params(current_submodule, recurse=z3_leaf_module(current_submodule)))
        _wait_for(params)
        _FETCH.ids = {id(p) for p in params}
        try:
            return original(self, current_submodule, forward)
        finally:
            _FETCH.ids = None

    return fetch_sub_module


def make_all_gather_params(original: Any) -> Any:
    """The coordinator's ``__all_gather_params``: a module's fetch gathers its parameters (visible:
    :func:`make_fetch_sub_module` waited); a prefetch while a step is in flight gathers only those
    already visible with one rank, and nothing with several (each rank's worker is at its own
    point, and every rank must make the same collective calls); what it leaves is gathered by its
    module's fetch, as stock does for a parameter no prefetch reached."""
    from deepspeed import comm as dist

    @functools.wraps(original)
    def all_gather_params(self, params, forward):
        if _IN_FLIGHT and not {id(p) for p in params} <= (getattr(_FETCH, "ids", None) or set()):
            if dist.is_initialized() and dist.get_world_size() > 1:
                return None
            params = {p for p in params if _visible([p])}
            if not params:
                return None
        return original(self, params, forward)

    return all_gather_params


def make_prefetch_nvme(original: Any) -> Any:
    """The coordinator's ``__prefetch_nvme_param_partitions`` (this rank's swap-ins, no collective):
    skipped while a step is in flight unless every partition it may read is visible (the first
    ``available_swap_in_buffers()`` NVMe partitions not in DRAM in the trace's queue: a superset of
    those it picks)."""
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    @functools.wraps(original)
    def prefetch_nvme(self):
        if _IN_FLIGHT:
            queue = getattr(self, "_PartitionedParameterCoordinator__param_queue", None) or ()
            on_nvme = [t.param for t in queue if t.param.nvme_swapper is not None
                       and t.param.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE]
            if on_nvme and not _visible(on_nvme[:on_nvme[0].nvme_swapper.available_swap_in_buffers()]):
                return None
        return original(self)

    return prefetch_nvme


def patch(registry: Any, settings: MemAscendSettings) -> None:
    """Patch stage 3's ``step`` and its joins, the coordinator's fetches, ``GatheredParameters`` and
    ``DeepSpeedEngine.destroy`` through ``registry`` (reversible). The chunked sub-group methods and
    ``_post_step`` defer their work themselves (:mod:`.chunked_step`, :mod:`.step_memory`)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from deepspeed.runtime.zero.partitioned_param_coordinator import (
        PartitionedParameterCoordinator as coordinator,
    )
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    registry.patch(stage3, "step", make_step(stage3.step, settings))
    for name in ("backward_prologue", "checkpoint_event_prologue", "state_dict", "load_state_dict"):
        registry.patch(stage3, name, make_joining(getattr(stage3, name)))
    registry.patch(GatheredParameters, "__enter__", make_join_all_first(GatheredParameters.__enter__))
    registry.patch(DeepSpeedEngine, "destroy", make_join_all_first(DeepSpeedEngine.destroy))
    registry.patch(coordinator, "fetch_sub_module", make_fetch_sub_module(coordinator.fetch_sub_module))
    gather = "_PartitionedParameterCoordinator__all_gather_params"
    registry.patch(coordinator, gather, make_all_gather_params(getattr(coordinator, gather)))
    prefetch = "_PartitionedParameterCoordinator__prefetch_nvme_param_partitions"
    registry.patch(coordinator, prefetch, make_prefetch_nvme(getattr(coordinator, prefetch)))
