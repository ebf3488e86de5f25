"""The FP8 region: where FP8 layers compute in FP8, and what a layer decides once per forward.

:func:`fp8_autocast` is thread-local, like ``torch.autocast``: a region entered on one thread does not
switch FP8 on in another. Regions nest; an inner region overrides ``enabled`` and restores the outer
state on exit.

What a layer decides at forward time is captured once, in a :class:`ForwardDecision`: whether it runs in
FP8, whether the forward's casts record statistics, whether its backward records the gradient's, and, for
history-scaled recipes, the scales the forward used. The backward never consults the region (it may run
outside it, or on an autograd worker thread), and an activation-checkpointing recomputation, which runs
during the backward, replays the decision of the layer's original forward instead of taking a new one.

Amax histories roll once per step, never per cast: under the precision plugin
(``defer_amax_history_roll=True``) once per optimizer step; used on its own, when the outermost region
exits, for the state tables of the layers that ran inside it. Eager layers note their table in the region;
compiled code cannot (a host-side store in a graph is a side effect, which dynamo refuses inside an activation
checkpoint): it writes the table's compiled forward mark in place instead
(:meth:`~lightning_fp8.state.FP8StateTable.mark_compiled_forward`), and the region also rolls every table whose
mark's version moved while it was open (compiled layers of another thread's standalone region count there too).
Gradients recorded after the exit (the
backward usually runs outside the region) roll at the next exit, so the gradient scale of step ``k``
comes from the gradients of the steps before ``k``, as the input and weight scales do.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from lightning_fp8.state import compiled_forward_marks, tables_marked_since


@dataclass
class FP8Region:
    """One entered :func:`fp8_autocast` region."""

    enabled: bool
    defer_amax_history_roll: bool
    #: layers in eval mode compute in FP8 too (the plugin's ``fp8_eval``)
    fp8_eval: bool = True
    #: training casts count (``[nonzero, overflow, underflow]``, slice-amax histograms) besides recording their amax and
    #: scale (the plugins' ``statistics_every_n_steps``: ``False`` on the steps in between); the outermost region's
    count_statistics: bool = True
    #: state tables of the eager layers that ran inside (outermost, non-deferred regions only; rolled on exit with
    #: those that compiled layers marked)
    tables: list[Any] = field(default_factory=list)


class _RegionStack(threading.local):
    def __init__(self) -> None:
        self.stack: list[FP8Region] = []


_REGIONS = _RegionStack()


def current_region() -> FP8Region | None:
    """The innermost region entered on this thread, or ``None``."""
    stack = _REGIONS.stack
    return stack[-1] if stack else None


@contextlib.contextmanager
def fp8_region(
    enabled: bool = True, *, defer_amax_history_roll: bool = False, fp8_eval: bool = True, count_statistics: bool = True
) -> Iterator[None]:
    """:func:`fp8_autocast` with the plugins' extra switches: ``fp8_eval=False`` keeps layers in eval mode in high
    precision; ``count_statistics=False`` (outermost region only) has training casts record their amaxes and scales
    but not count (see ``quantize(counters=False)``)."""
    outer = current_region()
    # An inner region never rolls: the outermost one (or the plugin that deferred) does.
    defer = bool(defer_amax_history_roll) or outer is not None
    region = FP8Region(
        enabled=bool(enabled), defer_amax_history_roll=defer, fp8_eval=bool(fp8_eval), count_statistics=bool(count_statistics)
    )
    # compiled layers do not note their table in the region: they mark it, and the region finds the marks on exit
    marks = compiled_forward_marks() if not defer else None
    _REGIONS.stack.append(region)
    try:
        yield
    finally:
        _REGIONS.stack.pop()
        if marks is not None:
            tables = region.tables
            for table in tables_marked_since(marks):
                if all(t is not table for t in tables):
                    tables.append(table)
            for table in tables:
                # under inference_mode (a compiled graph records there: it follows module.training alone) the roll's
                # new forward scales must not become inference tensors, which a later compiled checkpoint would save
                normal = not table.amax_history.is_inference()
                with torch.inference_mode(False) if normal else contextlib.nullcontext():
                    table.roll()


def fp8_autocast(
    enabled: bool = True, *, defer_amax_history_roll: bool = False, count_statistics: bool = True
) -> contextlib.AbstractContextManager:
    """Region in which FP8 layers compute in FP8. Thread-local and nestable; restores the outer state.

    Args:
        enabled: ``False`` makes FP8 layers behave exactly like their high-precision originals inside.
        defer_amax_history_roll: leave the amaxes recorded inside the region pending until
            :func:`lightning_fp8.roll_amax_history` is called (the precision plugin does this once per
            optimizer step, so all micro-batches of an accumulation window share one scale). By default
            the outermost region rolls the histories of the layers that ran inside it when it exits, once.
        count_statistics: ``False``: the training casts inside (and their backward) record their amaxes and scales
            but do not count nonzero, overflowing and underflowing elements nor build slice-amax histograms
            (what the plugins' ``statistics_every_n_steps`` does on the steps in between). Set on the outermost
            region; an inner region follows it.

    The backward pass may run outside the region: each layer decides at forward time.
    """
    return fp8_region(enabled, defer_amax_history_roll=defer_amax_history_roll, count_statistics=count_statistics)


def is_fp8_autocast_enabled() -> bool:
    """Whether the current code runs inside an enabled :func:`fp8_autocast` region (on this thread)."""
    region = current_region()
    return region is not None and region.enabled


class ForwardDecision(NamedTuple):
    """What an FP8 layer decided for one forward, replayed by an activation-checkpointing recomputation.

    A ``NamedTuple``: one is built per layer and forward, so it must be cheap.

    Attributes:
        enabled: the layer computes in FP8 (else it is its high-precision original).
        record_forward: the forward's casts record statistics (training mode, outside ``inference_mode``,
            not a recomputation).
        record_backward: the backward's casts record statistics.
        count_statistics: the recording casts also count (``[nonzero, overflow, underflow]`` and slice-amax
            histograms); otherwise they record their amax and scale alone (the outermost region's
            ``count_statistics`` and the state table's, which the plugins' ``statistics_every_n_steps`` sets).
        history: for history-scaled operands, ``(roles, scales, ready)``: the scale each role's cast used and a
            tensor of flags, indexed by role, saying whether that history was usable. A recomputation casts with
            exactly that scale where the history was usable, whatever it did since, and otherwise, as the forward
            did, with the current amax of its own input.
        keep_weight_cast: the region leaves the roll to a precision plugin, which rolls once per optimizer step:
            an FP8 weight cast may then be kept until the roll (see ``FP8Linear``). A standalone region cannot tell
            when an optimizer changed a weight without bumping its version counter (fused optimizers do), so its
            layers cast the weight at every use.
    """

    enabled: bool
    record_forward: bool = False
    record_backward: bool = False
    count_statistics: bool = True
    history: tuple[tuple[int, ...], tuple[torch.Tensor, ...], torch.Tensor] | None = None
    keep_weight_cast: bool = False

    def history_of(self, role: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(scale used, history usable)`` captured for ``role``, if any (``quantize`` takes them as the history
        scale and its readiness)."""
        if self.history is None:
            return None
        roles, scales, ready = self.history
        for r, scale in zip(roles, scales):
            if r == role:
                return scale, ready[role]
        return None


def in_recomputation() -> bool:
    """Whether a forward runs while the autograd engine executes a backward graph: an activation-checkpointing
    recomputation. Always ``False`` under ``torch.compile``, which recomputes inside its own backward graph
    without re-running the forward's state updates."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def in_inference_mode() -> bool:
    """``torch.is_inference_mode_enabled()`` outside ``torch.compile`` (Dynamo cannot trace the query; a compiled
    graph follows ``module.training`` alone)."""
    if torch.compiler.is_compiling():
        return False
    return torch.is_inference_mode_enabled()


def decide(module: torch.nn.Module, table: Any) -> ForwardDecision:
    """The decision of a layer's forward (not a recomputation), from the region of this thread.

    In training mode, registers ``table`` with the outermost region so that a standalone region rolls it on exit
    (compiled: marks the table, see :meth:`~lightning_fp8.state.FP8StateTable.mark_compiled_forward`).
    """
    region = current_region()
    if region is None or not region.enabled or not (region.fp8_eval or module.training):
        return ForwardDecision(enabled=False)
    record = module.training and not in_inference_mode()
    outermost = _REGIONS.stack[0]
    if record and not outermost.defer_amax_history_roll:  # evaluation never moves the state, not even a roll
        if torch.compiler.is_compiling():  # no host-side store in a graph: the region finds the mark on exit
            table.mark_compiled_forward()
        elif all(t is not table for t in outermost.tables):  # a long region stays small: one entry per table
            outermost.tables.append(table)
    return ForwardDecision(
        enabled=True,
        record_forward=record,
        record_backward=record,
        # read only where the casts record: an evaluation graph then has no guard on the table's flag (compiled, a
        # validation forward would otherwise compile once per value of it)
        count_statistics=record and outermost.count_statistics and table.count_statistics,
        keep_weight_cast=outermost.defer_amax_history_roll,
    )
