"""FP8Linear: a drop-in ``nn.Linear`` whose three GEMMs run in FP8 inside :func:`~lightning_fp8.fp8_autocast`.

::

    output      = x · Wᵀ          forward
    grad_input  = grad_out · W     grad_input
    grad_weight = grad_outᵀ · x    grad_weight

One autograd function serves every recipe. It quantizes each operand as the recipe's
:class:`~lightning_fp8.recipe.LinearCastSpecs` say, and reuses an FP8 copy wherever two GEMMs cast a
tensor the same way (``tensorwise``, ``delayed``: ``x`` and ``W`` once each, ``grad_out`` once). For the
backward it saves only what the needed gradients use, in FP8 (about half the bytes that ``nn.Linear``
under bf16 autocast keeps; torchao keeps the high-precision input): the input's FP8 copy when the
grad_weight GEMM casts it as the forward did, else the input cast as that GEMM casts it, done in the
forward (``rowwise`` and the block recipes scale each GEMM along its own reduction dimension: the same
bits the backward would compute); the weight's FP8 copy when the grad_input GEMM casts it as the forward
did, else the weight parameter itself (no extra memory: it is alive anyway). Compiled, a history-scaled input
(``delayed``) is saved in high precision with its scale and cast again in the backward, the same bits: sibling layers
cast their shared input with their own scales, and the partitioner keeps the one input instead of each copy.

Each cast records its statistics into the layer's row of the FP8 state table (see
:mod:`lightning_fp8.state`): the forward's casts in training mode outside ``inference_mode``, the
backward's first ``grad_out`` cast likewise. An activation-checkpointing recomputation replays the
original forward's decisions (see :mod:`lightning_fp8.region`) and records nothing again.

Outside an enabled :func:`~lightning_fp8.fp8_autocast` region (and for an empty batch) the layer is
exactly ``nn.Linear``.

The weight provider seam: ``layer.weight_provider`` (default ``None``) may be set to a callable
``(layer, spec, history) -> Quantized | None`` that hands over an already-quantized weight for a cast spec
(a sharded FP8 weight gathered in FP8 does this). For a history-scaled spec, ``history`` is ``(scale,
usable)``: the provider must cast with ``scale`` where ``usable`` is true, else with the weight's current
amax, as :func:`~lightning_fp8.quantize.quantize` does (an activation-checkpointing recomputation passes the
forward's values). ``None`` from it, or no provider, quantizes ``layer.weight`` here. A provided weight's
statistics are recorded as if the layer had cast it, once per optimizer step (a weight's statistics do not change
within a step; a provider that hands them over at every micro-batch is not counted again).
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_fp8 import gemm
from lightning_fp8.distributed import TensorParallelLayout, gathered_weights_changed, tensor_parallel_layout
from lightning_fp8.module import FP8Module
from lightning_fp8.quantize import Quantized, quantize, saturated_cast
from lightning_fp8.recipe import (
    E4M3, E5M2, GRAD_OUTPUT, INPUT, SIXTEEN_BIT, WEIGHT, CastSpec, FP8Recipe, LinearCastSpecs, rounded_to,
)
from lightning_fp8.region import ForwardDecision, decide, in_recomputation
from lightning_fp8.state import FP8StateTable

#: Cast each weight once per optimizer step (see :class:`FP8Linear`); ``False`` casts it at every use (the tests
#: compare the two bit for bit).
CACHE_WEIGHT_CASTS = True

#: Moves whenever weights may have changed without their version counters showing it (see
#: :func:`weights_may_have_changed`); a kept FP8 weight cast is valid within one value of it.
_weights_epoch = 0
#: Counts ``torch.optim`` optimizer steps (the post-step hook below): a weight's statistics are recorded once per value
#: of it and of its state table's generation, whatever else made its kept casts stale (an evaluation in between).
_optimizer_steps = 0


def weights_may_have_changed(*, all_ranks: bool = False) -> None:
    """Make every FP8 weight cast kept for reuse within an optimizer step (see :class:`FP8Linear`) stale: the next
    forward casts again.

    Called after every ``torch.optim`` optimizer step, by a post-step hook this module registers for all optimizers
    (``torch.optim.optimizer.register_optimizer_step_post_hook``): a step that does not go through the precision
    plugin (an optimizer not passed to Fabric's ``setup``, the Trainer's ``self.optimizers(use_pl_optimizer=False)``)
    changes the weights too, and fused optimizers do not bump their version counters. Call it after changing
    weights in place in a way that bypasses the version counter (writes through ``.data``) between two forwards
    of one optimizer step.

    Args:
        all_ranks: also make stale the scales shared by the ranks of an FSDP2 model that gathers its weights in FP8
            (``prepare_for_sharding``): the next gather recomputes them, a collective, so every rank of that model
            must make this call, as after ``.data`` writes to its sharded weights. Without it (the default, safe on
            one rank alone) those scales follow optimizer steps, restores and the layers' modes only.
    """
    global _weights_epoch
    _weights_epoch += 1
    if all_ranks:
        gathered_weights_changed()


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1
    weights_may_have_changed()  # this rank's kept casts only: the gather scales have a hook of their own (distributed)


register_optimizer_step_post_hook(_after_optimizer_step)

#: Layers that read the same input tensor (attention's q/k/v, the MLP's gate/up) share its FP8 casts: one cast, and
#: one FP8 copy saved for backward instead of one per layer (``delayed``: between rows of one state table whose input
#: state is equal; see :class:`FP8Linear`). ``False`` casts in every layer (the tests compare the two bit for bit).
SHARE_INPUT_CASTS = True

#: ``(layer, spec, history) -> Quantized | None``: see the module docstring.
WeightProvider = Callable[[nn.Module, CastSpec, "tuple[Tensor, Tensor] | None"], "Quantized | None"]


def _column_major(x: Tensor) -> Tensor:
    """Same shape and values, column-major storage."""
    return x.t().contiguous().t()


@dataclass
class _LinearCall:
    """Everything one FP8Linear forward hands to the autograd function (and its backward)."""

    layer: FP8Linear
    table: FP8StateTable
    index: int | Tensor  #: the row: an int, or under torch.compile a one-element tensor (see FP8StateRef.row)
    specs: LinearCastSpecs
    decision: ForwardDecision
    out_dtype: torch.dtype
    tp: TensorParallelLayout | None = None  #: tensor parallelism: the layer computes on local pieces
    #: the layer's input tensor, whose FP8 casts other layers may share (``None``: no sharing); the forward clears it
    input_source: Tensor | None = None
    #: the input's history-scaled cast came from another layer's (``delayed``): an activation-checkpointing
    #: recomputation must replay exactly its scale
    input_scale_final: bool = False
    #: the forward may keep and reuse weight casts (see ``quantize_weight``): it recorded autograd; its backward too
    keeps_weight_casts: bool = True
    #: a weak reference to the weight tensor the forward read: a kept cast belongs to it (the backward's saved weight
    #: may be another tensor object over the same storage, as activation checkpointing's saved-tensor hooks return);
    #: weak, so that a weight computed in the forward (``functional_call``, a parametrization) is not kept alive
    weight_ref: Callable[[], Tensor | None] | None = None

    def history(self, role: int) -> tuple[Tensor, Tensor]:
        """``(history scale, history usable)`` of ``role`` in the table (views where the row is an int).

        The input and weight roles read the copy published at the last roll (``forward_scale``, ``forward_ready``: a
        new tensor at each roll), so that a compiled activation checkpoint's recomputation, which reads them again in
        the backward, sees what its forward saw even if the table rolled in between (eager replays the captured
        scale). The grad_output role reads the table's own tensors (written in place by the roll), from its own
        column: compiled with a tensor row, a read that is the same operation as a forward read would be merged
        with it by AOTAutograd, and the backward would use the flag as it was at the forward, stale where a roll
        comes between the two (manual optimization with two optimizers, a retained graph). As its own operation the
        read stays in the backward: the partitioner saves the table (a graph input) rather than the read."""
        table = self.table
        if role == GRAD_OUTPUT:  # read when the backward runs: a roll since the forward counts
            scale, ready = table.history_scale, table.initialized
        else:  # the copy the forward saw (see FP8StateTable.publish_forward_history)
            scale, ready = table.forward_scale, table.forward_ready
        return table.at_row(scale.select(1, role), self.index), table.at_row(ready.select(1, role), self.index)

    def quantize(self, x: Tensor, spec: CastSpec, record: bool, history: tuple[Tensor, Tensor] | None = None) -> Quantized:
        if spec.scale_source == "history" and history is None:
            history = self.history(spec.role)
        scale, ready = history if history is not None else (None, None)
        reduce = self.tp.amax_reduce(spec, x) if self.tp is not None else None
        q = quantize(
            x,
            spec,
            statistics=record,
            counters=self.decision.count_statistics,
            history_scale=scale,
            history_ready=ready,
            amax_reduce=reduce,
        )
        self.record(spec.role, q)
        return q

    def quantize_input(self, x: Tensor, spec: CastSpec, record: bool, history: tuple[Tensor, Tensor] | None = None) -> Quantized:
        """Quantize the input ``x`` (the layer's input, flattened), sharing the cast with the other layers that read the
        same input tensor (see ``SHARE_INPUT_CASTS``): the casts live on that tensor, keyed by cast spec and the dtype
        cast, valid while its version counter is unchanged. Each layer records the statistics in its own row.

        A history-scaled cast (``delayed``) is shared only between rows of the same state table whose input state
        (history, pending amax, scale, readiness) is equal, which the table's host tokens say without reading the
        device (:meth:`~lightning_fp8.state.FP8StateTable.lineage`): the follower's token must be the caster's from
        before the cast, and recording the shared cast gives it the caster's new one; the cast is valid until the
        table rolls. A recomputation (``history`` given: the original forward's scale) replays its own cast."""
        source = self.input_source
        history_scaled = spec.scale_source == "history"
        if torch.compiler.is_compiling():
            # the graph records, not this code: its record bumps the pending amax's version counter, which ends the
            # tokens' trust at the next eager read (FP8StateTable.lineage); no host-side store here
            return self.quantize(x, spec, record, history)
        lineage = self.table.lineage() if history_scaled and history is None else None
        if source is None or history is not None or (history_scaled and lineage is None):
            q = self.quantize(x, spec, record, history)
            if record and history_scaled:
                self.own_input_record(lineage)
            return q
        casts = source.__dict__.get("_fp8_input_casts")
        if casts is None:
            casts = source.__dict__["_fp8_input_casts"] = {}
        key = (spec, x.dtype, x.shape)
        entry = casts.get(key)
        if entry is not None and entry[0] == source._version and (not record or entry[1].stats is not None):
            stamp = entry[2]
            if stamp is None:  # the scale comes from the input alone
                if record:
                    self.record(spec.role, entry[1])
                return entry[1]
            # a history scale: shared only by rows of the same table whose input state equals the caster's (same
            # token before its record), while that table has not rolled
            table, generation, before, after = stamp
            same_state = lineage is not None and lineage[self.index] == before
            if table is self.table and generation == table.generation and same_state:
                if record:
                    self.record(spec.role, entry[1])
                    lineage[self.index] = after  # the same record as the caster's: still equal
                    self.table.mark_lineage()
                self.input_scale_final = True
                return entry[1]
        q = self.quantize(x, spec, record, history)
        stamp = None
        if history_scaled:
            before = lineage[self.index] if lineage is not None else None
            after = self.own_input_record(lineage) if record else before
            stamp = (self.table, self.table.generation, before, after)
        casts[key] = (source._version, q, stamp)
        return q

    def own_input_record(self, lineage: list[int] | None) -> int | None:
        """A history-scaled input cast of this layer's own was recorded: its row's input state is its own now (a new
        token; nothing while the tokens are not trusted)."""
        if lineage is None:
            return None
        lineage[self.index] = token = self.table.new_lineage()
        self.table.mark_lineage()
        return token

    def quantize_weight(
        self, weight: Tensor, spec: CastSpec, record: bool, history: tuple[Tensor, Tensor] | None = None
    ) -> Quantized:
        """The FP8 ``weight`` for ``spec``: handed over by the layer's weight provider, kept from an earlier use in
        this optimizer step (:meth:`cached_weight_cast`), or cast now."""
        provider = self.layer.weight_provider
        replayed = history is not None  # a recomputation's scale, captured by the forward
        if spec.scale_source == "history" and history is None:
            history = self.history(spec.role)
        provided = provider(self.layer, spec, history) if provider is not None else None
        if provided is None:
            # kept only under a precision plugin (which rolls once per optimizer step), never under compile (the graph
            # fuses the cast) nor inference_mode (an inference tensor must not reach a later autograd forward), and
            # only by forwards that record autograd, and their backwards: a forward under no_grad casts every time
            # (evaluation, a teacher's forward), since weights swapped in through .data for it (weight averaging around
            # validation, a teacher's weights) move no version counter, and a layer kept in eval() while it is
            # trained sees no mode switch either: its casts must neither reuse nor be reused by training's. (A
            # reentrant activation checkpoint's first forward runs under no_grad too: it casts every time.)
            keep = CACHE_WEIGHT_CASTS and self.decision.keep_weight_cast and not self.layer._fp8_sharded and self.tp is None
            if not keep or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
                return self.quantize(weight, spec, record, history)
            if not self.keeps_weight_casts:
                # cast afresh, but record the weight's statistics once per optimizer step all the same (a reentrant
                # checkpoint's first forward runs under no_grad at every micro-batch)
                return self.quantize(weight, spec, record and self.first_weight_record(weight, spec), history)
            return self.cached_weight_cast(weight, spec, record, history, replayed)
        if record and provided.stats is not None:
            # a gathered weight's statistics: once per optimizer step (each micro-batch's gather repeats them), and
            # only by a forward that records (an evaluation forward leaves them to the next training forward)
            # (the weights epoch too: an optimizer step the plugin does not see changes the weights, not the generation)
            if torch.compiler.is_compiling():
                # compiled, at every micro-batch, as a cast of the layer's own (the step stamp is Python state the
                # graph would guard on: a recompilation every step); the amax is the same, the counts add up
                self.record(spec.role, provided)
                return provided
            stamp = self.step_key()
            if self.layer.__dict__.get("_fp8_provided_generation") != stamp:
                self.layer.__dict__["_fp8_provided_generation"] = stamp
                self.record(spec.role, provided)
        return provided

    def cached_weight_cast(
        self, weight: Tensor, spec: CastSpec, record: bool, history: tuple[Tensor, Tensor] | None, replayed: bool
    ) -> Quantized:
        """The FP8 weight for ``spec``, cast once per optimizer step (see :class:`FP8Linear`): reused while the weight
        (the same tensor object, its version counter and storage), the state table's generation and the weights
        epoch (:func:`weights_may_have_changed`: any optimizer step) are those it was cast under. A recomputation
        (``replayed``: the forward's scale) reuses only the forward's own cast, and keeps nothing."""
        key = self.weight_key(weight)
        cache = self.layer.__dict__.setdefault("_fp8_weight_casts", {})
        entry = cache.get(spec)
        # the tensor object itself, not only its address: the allocator gives a freed weight's memory to a new tensor
        # (functional_call over candidate weights), whose version counter starts at the same value
        owner = self.weight_ref() if self.weight_ref is not None else weight  # None once a computed weight is freed
        valid = owner is not None and entry is not None and entry[0] == key and entry[3]() is owner
        if replayed:
            if valid and history is not None and entry[1].scale is history[0]:
                return entry[1]
            return self.quantize(weight, spec, record, history)
        if valid:
            q, recorded = entry[1], entry[2]
            if not record or recorded:
                return q
            if q.stats is not None:  # cast with statistics, not recorded yet in this window
                if self.first_weight_record(weight, spec):
                    self.record(spec.role, q)
                cache[spec] = (key, q, True, entry[3])
                return q
        # cast again in this step when an evaluation made the kept cast stale (the weights may have been swapped
        # through .data around it): the weight's statistics were recorded by the step's first cast already
        q = self.quantize(weight, spec, record and self.first_weight_record(weight, spec), history)
        if owner is not None:
            cache[spec] = (key, q, record, weakref.ref(owner))
        return q

    def step_key(self) -> tuple[int, int, int]:
        """The optimizer step a weight's cast or statistics record belongs to: the state table, its generation (the
        plugins roll it at their steps) and the weights epoch (:func:`weights_may_have_changed`: any optimizer step)."""
        return id(self.table), self.table.generation, _weights_epoch

    def weight_key(self, weight: Tensor) -> tuple[Any, ...]:
        """What a kept weight cast (and a weight's statistics record) is valid for, besides the tensor object itself:
        the optimizer step (:meth:`step_key`), the weight's version counter, storage, dtype and device."""
        return (*self.step_key(), *_tensor_key(weight))

    def first_weight_record(self, weight: Tensor, spec: CastSpec) -> bool:
        """Whether a cast of ``weight`` is the first in this optimizer step to record its statistics, for a forward
        that keeps no cast (``no_grad``) and for :meth:`cached_weight_cast`'s casts: the weight's statistics are
        recorded once per step. The same tensor, version, storage, table generation and count of optimizer steps:
        unlike the kept casts, not the weights epoch, which an evaluation between two micro-batches also moves (the
        plugins' phase switch; the weights it may have swapped through ``.data`` are back by then)."""
        key = (id(self.table), self.table.generation, _optimizer_steps, *_tensor_key(weight))
        records = self.layer.__dict__.setdefault("_fp8_weight_records", {})
        seen = records.get(spec)
        if seen is not None and seen[0] == key and seen[1]() is weight:
            return False
        records[spec] = (key, weakref.ref(weight))
        return True

    def record(self, role: int, q: Quantized) -> None:
        if q.stats is not None:
            s = q.stats
            # a cast made elsewhere (an FSDP2 gather's) may have counted on a step that does not: its amax and scale only
            counts, bins = (s.counts, s.amax_bins) if self.decision.count_statistics else (None, None)
            self.table.record(self.index, role, s.amax, s.scale, s.numel, counts, bins)


def _tensor_key(weight: Tensor) -> tuple[Any, ...]:
    """What identifies a weight's values besides the tensor object: its version counter, storage, dtype and device."""
    return (weight._version, weight.data_ptr(), weight.dtype, weight.device)


def _gemm_dtype(dtype: torch.dtype, spec: CastSpec) -> torch.dtype:
    return gemm.scaled_mm_out_dtype(dtype, rowwise=spec.granularity != "tensor")


def _torch_version(version: str | None = None) -> tuple[int, int] | None:
    """torch's release (or ``version``'s) as ``(major, minor)``: pre-release and vendor builds count as their release
    (``2.11.0a0+...nv26.01``, as NVIDIA's containers ship, is ``(2, 11)``); None for a string that does not start
    with one (a local build's own)."""
    release = re.match(r"(\d+)\.(\d+)", str(torch.__version__) if version is None else version)
    return None if release is None else (int(release[1]), int(release[2]))


#: torch 2.11's dynamo returns the intermediates of a traced ``autograd.Function`` forward as extra outputs of its
#: subgraph; an output that is the same tensor object as one of them (a no-op ``.to``) gets no gradient: zeros, no
#: error. Measured here: 2.11 does, 2.8, 2.10, 2.12 and 2.13 do not (``tests/test_function_output.py``).
_TRACED_FUNCTION_ALIASES_OUTPUTS = _torch_version() == (2, 11)


def _own_output(out: Tensor, dtype: torch.dtype) -> Tensor:
    """The forward GEMM's result in ``dtype``, never a view (``fp8_mm(own_output=True)`` copies a padded GEMM's
    unpadded part where no conversion to ``dtype`` does: an ``autograd.Function`` output that is a view cannot be
    modified in place, where an ``nn.Linear``'s can), and under ``torch.compile`` on torch 2.11 not the same object
    as any intermediate of the forward.

    On torch 2.11 a compiled forward whose output was the same object as an intermediate (``out.to(dtype)`` when
    ``out`` already has that dtype) trained with zero input and weight gradients (see
    ``_TRACED_FUNCTION_ALIASES_OUTPUTS``); there the output is always a fresh tensor (one copy of it per layer under
    compile, where a dtype change does not make one).
    """
    if out.dtype != dtype:
        # rounded as eager rounds it also when compiled: a bfloat16 GEMM output under float16 autocast rounds again
        # where float16 has subnormals, and inductor would hand the bias add the bfloat16 value (see rounded_to)
        return rounded_to(out, dtype)
    if torch.compiler.is_compiling() and _TRACED_FUNCTION_ALIASES_OUTPUTS:
        return out.clone()
    return out


def _recast_in_backward(x_spec: CastSpec) -> bool:
    """Whether a compiled layer saves its high-precision input (and the scale) for the grad_weight GEMM and casts it
    again in the backward, instead of saving the forward's FP8 copy: under ``torch.compile``, for an input scaled from
    its history (``delayed``).

    Layers that read one input (q/k/v, gate/up) each cast it with their own history scale, so their casts are not one
    graph node as the current-scaled recipes' are. AOTAutograd's partitioner does not recompute in the backward a cast
    of a tensor whose earlier use went through a GEMM (``ban_recompute_used_far_apart``), so it kept every later
    sibling's FP8 copy, one per layer beside the shared input (a Llama block's ``delayed`` saved about a tenth more
    than ``tensorwise``, all of it in those copies). With the cast in the backward, the partitioner chooses: the
    shared input, or the FP8 copy where that is smaller (the cast moves back into the forward).
    ``tests/test_compiled_saved_casts.py`` measures it; eager mode saves the FP8 copy (siblings share it there)."""
    return x_spec.scale_source == "history" and x_spec.granularity == "tensor" and torch.compiler.is_compiling()


def _recast(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """The forward's FP8 cast of ``x`` with its per-tensor ``scale`` again, bit for bit (:func:`saturated_cast` of
    ``x * scale``), written ``scale * x``: an identical expression would be merged with the forward's cast by
    AOTAutograd's common-subexpression elimination, and the backward would read the forward's FP8 copy after all
    (see :func:`_recast_in_backward`). A float32 product is the same either way round."""
    return saturated_cast(scale * x.to(torch.float32), fp8_dtype)


class _FP8LinearFn(torch.autograd.Function):
    """The three FP8 GEMMs of a linear layer, for every recipe (the cast specs say how to quantize).

    The forward operands arrive quantized (the layer casts and records them before ``apply``, so that under
    ``torch.compile`` no state is mutated inside the function's forward); the backward quantizes the gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x2d: Tensor,
        weight: Tensor,
        x_data: Tensor,
        x_scale: Tensor,
        w_data: Tensor,
        w_scale: Tensor,
        call: _LinearCall,
    ) -> Tensor:
        specs = call.specs
        x_spec, w_spec = specs.forward
        gemm_dtype = _gemm_dtype(call.out_dtype, x_spec)
        out = gemm.fp8_mm(
            x_data,
            w_data.t(),
            x_scale,
            w_scale.t().contiguous(),
            gemm_dtype,
            use_fast_accum=True,
            block_a=x_spec.block,
            block_b=w_spec.transposed_block(),
            # not a view of a padded result, so that the layer's output can be modified in place (a conversion to
            # another dtype copies anyway)
            own_output=gemm_dtype == call.out_dtype,
        )
        # Save only what the needed gradients use, in FP8: for grad_weight the input as that GEMM casts it (the
        # forward's copy when the casts agree; else the backward's own cast of x, done now: the same bits it would
        # give in the backward, at a quarter of float32's bytes), for grad_input the weight's FP8 copy when the casts
        # agree, else the weight itself (a parameter: saving it costs nothing).
        need_input_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w_reused = specs.weight_reused
        saved_x = saved_x_scale = None
        ctx.recast_input = None
        if need_weight_grad:
            if specs.input_reused and _recast_in_backward(x_spec):
                # compiled, a history-scaled input: its high-precision self and its scale, cast again in the backward
                # (see _recast_in_backward); the partitioner keeps whichever of the input and the FP8 copy is smaller
                saved_x, saved_x_scale = x2d, x_scale
                ctx.recast_input = x_data.dtype
            elif specs.input_reused:
                saved_x, saved_x_scale = x_data, x_scale
            else:
                q_x = call.quantize_input(x2d, specs.grad_weight[1], False)
                saved_x, saved_x_scale = q_x.data, q_x.scale
        saved_w = (w_data if w_reused else weight) if need_input_grad else None
        ctx.save_for_backward(saved_x, saved_x_scale, saved_w, w_scale if w_reused else None)
        ctx.w_reused = w_reused
        ctx.call = call
        ctx.x_dtype, ctx.w_dtype = x2d.dtype, weight.dtype
        return _own_output(out, call.out_dtype)

    @staticmethod
    @once_differentiable  # the FP8 GEMMs have no derivative of their own: double backward raises, never drops terms
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        saved_x, x_scale, saved_w, w_scale = ctx.saved_tensors
        call: _LinearCall = ctx.call
        specs = call.specs
        grad_out = grad_out.contiguous()
        record = call.decision.record_backward
        grad_input = grad_weight = None
        q_go = None
        if ctx.needs_input_grad[0]:
            go_spec, w_spec = specs.grad_input
            q_go = call.quantize(grad_out, go_spec, record)
            record = False  # grad_output's statistics are recorded once per backward
            qw = Quantized(saved_w, w_scale, None) if ctx.w_reused else call.quantize_weight(saved_w, w_spec, False)
            grad_input = gemm.fp8_mm(
                q_go.data,
                _column_major(qw.data),
                q_go.scale,
                qw.scale,
                _gemm_dtype(grad_out.dtype, go_spec),
                block_a=go_spec.block,
                block_b=w_spec.block,
            )
            if grad_input.dtype != ctx.x_dtype:
                # rounded also when compiled (bfloat16 to float16): the rounded input's backward takes it as rounded
                # (rounded_to's rounded_gradient); the GEMM's own output is rounded already
                grad_input = rounded_to(grad_input, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            go_spec, x_spec = specs.grad_weight
            if q_go is None or not specs.grad_output_reused:
                q_go = call.quantize(grad_out, go_spec, record)
            if ctx.recast_input is not None:
                qx = Quantized(_recast(saved_x, x_scale, ctx.recast_input), x_scale, None)
            else:
                qx = Quantized(saved_x, x_scale, None)  # cast in the forward (see there)
            grad_weight = gemm.fp8_mm(
                q_go.data.t().contiguous(),
                _column_major(qx.data),
                q_go.scale.t().contiguous(),
                qx.scale,
                _gemm_dtype(grad_out.dtype, go_spec),
                block_a=go_spec.transposed_block(),
                block_b=x_spec.block,
            ).to(ctx.w_dtype)
        return grad_input, grad_weight, None, None, None, None, None


def _check_input(x: Tensor) -> None:
    if x.dtype in (E4M3, E5M2):
        raise TypeError(
            f"FP8Linear expects a high-precision floating-point input, got {x.dtype}: "
            "the layer quantizes its input itself; pass the unquantized tensor."
        )
    if not x.is_floating_point():
        raise TypeError(f"FP8Linear expects a floating-point input, got {x.dtype}")


def _own_buffer(t: Tensor) -> Tensor:
    """``t`` in a buffer of its own when compiled, for a collective to reduce in place: inductor cannot lower an
    in-place collective on the 16-bit view through which an emulated GEMM's output is rounded (see
    :func:`~lightning_fp8.recipe.rounded_to`; ``make_reindexer NYI on DtypeView``), and removes a plain copy. Two
    exact negations, fused into the GEMM output's kernel, for a 16-bit ``t`` (the only kind rounded through a view).
    Eager: ``t``."""
    return torch.neg(torch.neg(t)) if torch.compiler.is_compiling() and t.dtype in SIXTEEN_BIT else t


class _GradientInOwnBuffer(torch.autograd.Function):
    """Identity whose gradient goes through :func:`_own_buffer` (a column-wise layer's input gradient, which the
    tensor-parallel style reduces across the ranks)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return _own_buffer(grad)


class FP8Linear(FP8Module, nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs run in FP8 inside :func:`~lightning_fp8.fp8_autocast`.

    A subclass of ``nn.Linear`` with exactly its parameters and ``state_dict`` keys. The FP8 scaling
    state (scales, amax ring buffers, overflow/underflow counters) is one row of an FP8 state table on
    the layer's device (see :mod:`lightning_fp8.state`); ``fp8_scale``, ``fp8_amax_history``,
    ``fp8_amax_pending``, ``fp8_counts`` and ``fp8_initialized`` are views of that row, and
    :func:`lightning_fp8.fp8_state_dict` exports it.

    Usually created by :func:`lightning_fp8.convert_to_fp8`, which turns existing ``nn.Linear``
    layers into FP8Linear in place (same object, same Parameters).

    Args:
        in_features: size of each input sample, as for ``nn.Linear``.
        out_features: size of each output sample, as for ``nn.Linear``.
        bias: learn an additive bias, as for ``nn.Linear``.
        device: device of the parameters (and of the FP8 state), as for ``nn.Linear``.
        dtype: dtype of the parameters, as for ``nn.Linear`` (the FP8 state keeps its own dtypes).
        recipe: an :class:`~lightning_fp8.FP8Recipe` or a recipe name (default ``"tensorwise"``).

    Statistics are recorded only in training mode (``module.training``, also under ``torch.no_grad()``) and,
    in eager mode, never under ``torch.inference_mode()`` (a compiled module follows ``module.training``
    alone); evaluation casts use the current scales and leave the state untouched, so validation never
    shifts a ``delayed`` scale. An activation-checkpointing recomputation takes the decisions and scales of
    the original forward and does not record statistics a second time. The backward is not differentiable
    again (double backward raises).

    Each weight is cast to FP8 once per optimizer step, not once per micro-batch: the FP8 weight (and, for the
    recipes whose backward casts the weight differently, that cast too) is kept on the layer and reused while the
    weight is unchanged (the same tensor object, version counter and storage), the state table has not rolled (the
    precision plugin rolls once per optimizer step; a standalone ``fp8_autocast()`` when its outermost region exits)
    and no ``torch.optim`` optimizer has stepped since (:func:`weights_may_have_changed`: a step the plugin does not
    see, or a fused one, which moves no version counter). With ``accumulate_grad_batches=k`` the other k-1
    micro-batches, forward and backward, and an activation-checkpointing recomputation reuse it; the results are
    bit-identical to casting at every use, and the weight's statistics are recorded once per step. The kept copy
    costs one byte per weight element. Only forwards that record autograd and their backwards keep and reuse it: a
    forward under ``no_grad`` (evaluation, a teacher's forward; also a reentrant activation checkpoint's first
    forward, which therefore casts at every micro-batch, recording the weight's statistics once per step all the
    same) casts every time, so weights swapped in through ``.data``
    for it (weight averaging around evaluation: no version bump, and a layer kept in ``eval()`` while it is trained
    sees no mode switch) are cast as they are, and never reach training; the Trainer plugin also makes the kept
    casts stale when its steps change between training and evaluation (an evaluation step that enables
    gradients). It is also dropped when the layer switches between ``train()`` and ``eval()``
    and when it moves or changes dtype. Any other in-place change of a weight that bypasses its version counter
    between two training forwards of one optimizer step (``weight.data.copy_(...)``) is not seen: call
    :func:`weights_may_have_changed` after it. Only under a precision plugin: a standalone ``fp8_autocast()`` casts
    at every use; so does ``torch.compile`` (the compiler fuses the cast into the graph).

    Layers that read the same input tensor (attention's q, k and v projections, the gate and up projections of a
    SwiGLU MLP) share its FP8 casts: the input is cast once, and the layers save one FP8 copy of it for backward
    instead of one each; the results are bit-identical, and each layer records the statistics in its own row. Under
    ``delayed``, whose input scales come from each layer's history, layers share only while their input histories
    are equal (same state table, and every amax one recorded the other recorded too, which the table tracks on the
    host: siblings that always read the same tensor stay equal); a layer whose history differs (it joined later, it
    sometimes reads another tensor, it is in eval mode while its sibling trains) casts with its own scale. The
    shared casts are kept on the input tensor (they live as long as it does) and are used while its version counter
    is unchanged (an in-place change is seen). Eager mode only (a compiled graph shares identical casts by itself;
    once a compiled forward recorded a ``delayed`` input cast, the eager forwards of that table cast in every layer
    until its rows are loaded again); not under tensor parallelism or ``torch.inference_mode``, and only for inputs
    the forward computed with autograd recording (a leaf, such as a Parameter, a buffer or a batch read directly, or
    anything computed under ``torch.no_grad()``, like a reentrant activation checkpoint's first forward, may change
    in place without a version bump: fused optimizers, writes through ``.data``). Under data parallelism the tokens
    are per rank: layers whose inputs differ between ranks' forwards (data-dependent control flow) should be run with
    ``SHARE_INPUT_CASTS = False`` under ``delayed``.
    """

    #: See the module docstring: hands over an already-quantized weight (``None``: quantize ``weight`` here).
    weight_provider: WeightProvider | None = None
    #: Set by the precision plugin when FSDP2 / DTensor shards the layer's parameters: its weight is cast at every use,
    #: never kept (a kept FP8 copy of the whole weight would undo the sharding).
    _fp8_sharded: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: FP8Recipe | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.init_fp8_state(recipe, self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe | str | None = None) -> FP8Linear:
        """Turn ``linear`` into an FP8Linear *in place* (its class changes; Parameters, hooks and
        references stay) and return it."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"from_linear expects a plain torch.nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        linear.init_fp8_state(recipe, linear.weight.device)  # type: ignore[attr-defined]
        return linear  # type: ignore[return-value]

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(self.weight, DTensor):  # tensor parallel (torch's ColwiseParallel / RowwiseParallel)
            return self._forward_tensor_parallel(input)
        return self._forward(input, self.weight, self.bias, None)

    def _forward_tensor_parallel(self, input: Tensor) -> Tensor:
        """Tensor parallelism: the three GEMMs on the local pieces, every scale agreed across the group (see
        :class:`~lightning_fp8.distributed.TensorParallelLayout`). Column-wise: the replicated input times this rank's
        output features gives the output sharded on its last dimension (the input's gradient is a partial sum);
        row-wise: the input sharded on its last dimension times this rank's input features gives a partial sum, the
        bias is added once to the reduced output."""
        layout = tensor_parallel_layout(self.weight)
        assert layout is not None
        mesh = layout.mesh
        last = input.dim() - 1
        if not isinstance(input, DTensor):
            # torch's tensor-parallel styles hand the layer a DTensor input; a plain one means the weight is sharded
            # for another reason (FSDP2 between its all-gathers): computing on the shard would be silently wrong
            raise ValueError(
                f"FP8Linear got a sharded weight (placements {self.weight.placements}) and a plain input: outside a "
                "tensor-parallel style the weight must be gathered first (call the module FSDP2 wrapped, whose hooks "
                "gather it), or shard the layer with FP8ColwiseParallel / FP8RowwiseParallel."
            )
        weight = self.weight.to_local()
        if layout.style == "colwise":
            x = input.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            if torch.compiler.is_compiling():
                x = _GradientInOwnBuffer.apply(x)  # the input gradient, a partial sum, is reduced across the ranks
            bias = self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias
            out = self._forward(x, weight, bias, layout)
            return DTensor.from_local(out, mesh, [Shard(last)], run_check=False)
        x = input.redistribute(mesh, [Shard(last)]).to_local()
        out = DTensor.from_local(_own_buffer(self._forward(x, weight, None, layout)), mesh, [Partial()], run_check=False)
        if self.bias is not None:
            bias = self.bias if isinstance(self.bias, DTensor) else DTensor.from_local(self.bias, mesh, [Replicate()], run_check=False)
            if torch.compiler.is_compiling():
                # the bias rounded as the unsharded layer rounds it (see rounded_to), on the local tensor: rounded_to
                # converts a DTensor with a plain .to, whose rounding inductor skips. (The biased output is reduced
                # across the ranks before anything reads it; rounding it here, before the reduction, failed inductor's
                # lowering of the in-place collective on 2 ranks.)
                bias = DTensor.from_local(rounded_to(bias.to_local(), out.dtype), mesh, bias.placements, run_check=False)
            out = out + bias.to(out.dtype)
        return out

    def _forward(self, input: Tensor, weight: Tensor, bias: Tensor | None, tp: TensorParallelLayout | None) -> Tensor:
        state = self.fp8_state
        table = state.table
        recomputing = in_recomputation()
        # What a recomputation replays is captured in eager forwards (a compiled graph recomputes by itself) that
        # can be recomputed: with gradients, or in training mode (a reentrant checkpoint's forward runs without).
        # An evaluation pass between a forward and its backward must not replace the decision.
        capture = (
            not recomputing and not torch.compiler.is_compiling() and (self.training or torch.is_grad_enabled())
        )
        if recomputing:
            # An activation-checkpointing recomputation (usually outside the region, maybe on an autograd
            # thread) replays the original forward's decision: same path, same scales, no statistics again.
            original = self._fp8_decision or ForwardDecision(enabled=False)
            decision = original._replace(record_forward=False)
        else:
            decision = decide(self, table)
        if not decision.enabled or input.numel() == 0:  # nothing to quantize in an empty batch
            if capture:
                self._fp8_decision = decision
            if decision.enabled:
                _check_input(input)
            return F.linear(input, weight, bias)
        _check_input(input)
        self._check_state_device(weight.device)
        device_type = input.device.type
        # autocast casts every floating input of a linear but float64 ones (as for nn.Linear)
        autocast = torch.is_autocast_enabled(device_type) and input.dtype != torch.float64
        out_dtype = torch.get_autocast_dtype(device_type) if autocast else input.dtype
        specs = table.specs
        x2d = input.reshape(-1, weight.shape[1])
        if autocast and not specs.input_reused:
            # Recipes that cast the input twice (once per GEMM) cast what nn.Linear under autocast computes with, the
            # autocast dtype, as torchao does; the per-tensor recipes cast the original input, one rounding fewer.
            # Compiled for a CPU, the rounded input is stored once: its two amaxes and two casts read it (see
            # rounded_to; for a GPU each of them recomputes the rounding, a view of the bits). Its gradient comes from
            # _FP8LinearFn's backward alone, which rounds it to out_dtype: row-wise scaling takes it as rounded
            # (rounded_gradient: measured, a shorter compile at the same step time); the block recipes round it again
            # (without that second rounding their compiled step was slower: see rounded_to)
            x2d = rounded_to(x2d, out_dtype, store=True, rounded_gradient=specs.forward[0].granularity == "row")
        x2d = x2d.contiguous()
        # casts shared with sibling layers: in eager mode (a compiled graph shares identical casts by itself), outside
        # tensor parallelism (the amaxes of a piece are reduced with the other pieces') and inference mode (an
        # inference tensor has no version counter, and one cached on a normal tensor could not be saved for backward)
        # nor for a leaf (a Parameter or buffer read directly, a batch, anything under no_grad): a leaf may be changed
        # in place without a version bump (fused optimizers, writes through .data such as weight averaging's swaps);
        # the activations that siblings share are produced by the forward and have a grad_fn
        share = (
            SHARE_INPUT_CASTS
            and tp is None
            and not torch.compiler.is_compiling()
            and not torch.is_inference_mode_enabled()
            and not input.is_inference()
            and not input.is_leaf
        )
        # Compiled, the row is a tensor, not a constant of the graph (torch 2.8 guards on the int as soon as it is
        # read), so that identical blocks compiled one by one share one graph (see FP8StateRef.row). Only where the
        # roll waits for the optimizer step (the plugins, defer_amax_history_roll=True), where a roll rarely comes
        # between a forward and its backward (two optimizers, a retained graph): the backward's indexed reads are
        # then operations of their own, which stay in the backward (see _LinearCall.history). A standalone region
        # rolls between every forward and backward, and keeps the int row: its reads are views, which the compiled
        # backward always takes when it runs (an indexed read the forward also does is merged into the forward's).
        compiled_row = torch.compiler.is_compiling() and decision.keep_weight_cast
        index = state.row() if compiled_row else state.index
        call = _LinearCall(self, table, index, specs, decision, out_dtype, tp, input if share else None)
        if not torch.compiler.is_compiling():  # a compiled graph keeps no casts (see quantize_weight)
            call.keeps_weight_casts = torch.is_grad_enabled()
            call.weight_ref = weakref.ref(weight)
        x_spec, w_spec = specs.forward
        if capture and specs.history_scaled:
            # What a recomputation must replay, taken before any roll can move it: whether each history was usable
            # (one copy of the input and weight flags) and the scale each cast used (a new tensor already).
            ready = table.at_row(table.forward_ready, index).clone()
        qx = call.quantize_input(x2d, x_spec, decision.record_forward, decision.history_of(INPUT))
        qw = call.quantize_weight(weight, w_spec, decision.record_forward, decision.history_of(WEIGHT))
        out = _FP8LinearFn.apply(x2d, weight, qx.data, qx.scale, qw.data, qw.scale, call)
        call.input_source = None  # the backward keeps the call: it must not keep the high-precision input alive
        if capture:
            if specs.history_scaled:
                if call.input_scale_final:  # another layer's cast: replay its scale as it is
                    ready[INPUT].fill_(True)  # not `ready[INPUT] = True`: a copy from host memory, a sync on a GPU
                decision = decision._replace(history=((INPUT, WEIGHT), (qx.scale, qw.scale), ready))
            self._fp8_decision = decision
        out = out.reshape(*input.shape[:-1], weight.shape[0])
        if bias is not None:
            out = rounded_to(out + rounded_to(bias, out.dtype), out.dtype)
        return out

    def extra_repr(self) -> str:
        recipe = self.fp8_recipe
        return f"{super().extra_repr()}, recipe={recipe.name}, fp8_format={recipe.fp8_format}"
