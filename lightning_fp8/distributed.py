"""Distributed glue: identical FP8 scaling decisions on every data-parallel rank, and reduced statistics.

Under DDP every rank sees a different shard of the batch, so the amaxes its layers record differ.
Before the amax histories roll (once per optimizer step), the pending amaxes of all FP8 layers are
reduced with ``MAX`` across ranks in a single collective over the flat pending tensors of the state
tables, as Transformer Engine does for its data-parallel group. All ranks then hold the same
histories and derive the same ``delayed`` scales, which also makes the amax histories and scales
saved by one rank valid for every rank on resume.

The element counters stay per rank; :func:`reduce_statistics` reduces a statistics snapshot (one
``all_gather``, then max / min / sum per entry) when the statistics are read. A layer that did not run
on some rank contributes its zeros: no collective depends on which layers ran, so nothing can hang.

The FP8 state is not made of module buffers, so DDP's buffer broadcast never touches it.

Everything goes through ``torch.distributed`` (no host synchronisation; on NCCL the collectives are
queued on the stream).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_fp8.quantize import Quantized, quantize
from lightning_fp8.recipe import GRAD_OUTPUT, INPUT, WEIGHT, CastSpec, FP8Recipe, amax_to_scale
from lightning_fp8.state import FP8StateTable, state_tables

#: How :func:`reduce_statistics` combines each entry across ranks.
REDUCE_MAX, REDUCE_MIN, REDUCE_SUM = 0, 1, 2


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (1 when ``torch.distributed`` is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


@torch.no_grad()
def all_reduce_pending_amax(
    model: nn.Module | Iterable[FP8StateTable], group: dist.ProcessGroup | None = None
) -> None:
    """MAX-reduce every FP8 layer's pending amaxes across ``group`` in one collective (no-op on one rank).

    ``model`` is a model (its state tables are looked up) or the state tables themselves. Non-finite
    amaxes are sent as ``+inf`` (a NaN would make the reduction order-dependent); the history treats both
    as "ignore this entry".
    """
    if world_size(group) == 1:
        return
    tables = state_tables(model) if isinstance(model, nn.Module) else list(model)
    if not tables:
        return
    flat = torch.cat([table.amax_pending.reshape(-1) for table in tables])  # (L, 3) per table, stacked
    flat = torch.where(torch.isnan(flat), torch.full_like(flat, float("inf")), flat)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    for table in tables:
        n = table.num_layers * 3
        reduced = flat[offset : offset + n].view(table.num_layers, 3)
        torch._foreach_copy_([t.data for t in table.role_amax_pending], list(reduced.unbind(1)))
        offset += n


@torch.no_grad()
def reduce_statistics(flat: Tensor, kinds: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Combine a flat statistics tensor across ranks: one ``all_gather``, then per entry ``kinds`` says max,
    min or sum (``REDUCE_MAX``, ``REDUCE_MIN``, ``REDUCE_SUM``). Returns ``flat`` on one rank."""
    size = world_size(group)
    if size == 1:
        return flat
    gathered = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(gathered, flat, group=group)
    gathered = gathered.view(size, -1)
    kinds = kinds.to(flat.device)
    return torch.where(
        kinds == REDUCE_MAX,
        gathered.max(dim=0).values,
        torch.where(kinds == REDUCE_MIN, gathered.min(dim=0).values, gathered.sum(dim=0)),
    )


def keep_fp8_state_local_under_ddp(model: nn.Module) -> list[str]:
    """Deprecated no-op (lightning-fp8 0.1 added the FP8 buffers to DDP's ignore list).

    The FP8 state is no longer made of module buffers, so DDP never broadcasts it. Returns ``[]``.
    """
    warnings.warn(
        "keep_fp8_state_local_under_ddp is no longer needed (the FP8 state is not a module buffer) and does "
        "nothing; remove the call.",
        DeprecationWarning,
        stacklevel=2,
    )
    return []


# ---------------------------------------------------------------------------------------------------------- FSDP2
# FP8 all-gather. FSDP2 (``torch.distributed.fsdp.fully_shard``) lets a parameter's local tensor choose what is
# all-gathered through two methods, ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, as torchao's
# ``WeightWithDynamicFloat8CastTensor`` does for its Float8Linear. torchao's class serves only torchao's layer (it hands
# a ``Float8TrainingTensor`` to ``Float8Linear``), keeps no statistics and knows no ``delayed`` scaling, so the two
# small subclasses below do the same for FP8Linear: each rank casts its shard with one scale shared by all ranks, the
# FP8 bytes are gathered, and the layer receives the gathered FP8 weight through its weight provider seam.

#: aten ops whose results stay FP8ShardedWeight: what FSDP2 does to a parameter when it shards it (pad, narrow, view,
#: copy, move), and clone; every other op sees the plain high-precision tensor (optimizers, clipping, state dicts). Not ``split``
#: (``torch.chunk``): tensor parallelism's ``distribute_tensor`` scatters the chunks through the process group, which
#: needs plain tensors (:class:`FP8ColwiseParallel` / :class:`FP8RowwiseParallel` wrap the local piece again).
_SHARD_OPS = {
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.narrow.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.clone.default,  # copy.deepcopy of a prepared model (weight averaging)
    torch.ops.aten.empty_like.default,  # module.to_empty(): a model built on the meta device, then materialised
}

#: aten ops that keep an FP8GatheredWeight (what FSDP2 does to the gathered tensor to make the unsharded parameter).
_GATHERED_OPS = {
    torch.ops.aten.as_strided.default,
    torch.ops.aten.view.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}


def _wrapper(cls: type, like: Tensor, dtype: torch.dtype, requires_grad: bool) -> Any:
    return Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
        cls,
        like.size(),
        strides=like.stride(),
        storage_offset=like.storage_offset(),
        dtype=dtype,
        layout=like.layout,
        device=like.device,
        requires_grad=requires_grad,
    )


class FP8ShardedWeight(Tensor):
    """A high-precision weight that FSDP2 all-gathers in FP8 (see :func:`prepare_for_sharding`).

    It behaves as the float32 (or the parameter's own dtype) tensor it wraps for everything but FSDP2's all-gather:
    the optimizer, gradient clipping and checkpoints see the high-precision values. Before each all-gather,
    ``fsdp_pre_all_gather`` casts this rank's shard to FP8 with the layer's weight cast spec and a scale shared by all
    ranks: for ``tensorwise`` the scale of the whole weight's amax (``scale = fp8_max / amax``), computed by
    :func:`precompute_fp8_weight_scales` once per optimizer step for every such weight in one all-reduce; for
    ``delayed`` the amax history's scale, identical on every rank (the histories are reduced before they roll), or
    the same whole-weight scale while the history is empty. The shard's statistics (amax, counters) travel with it and
    are recorded by the layer's forward. ``fsdp_post_all_gather`` returns an :class:`FP8GatheredWeight`.
    """

    _tensor: Tensor
    _scale: Tensor
    _spec: CastSpec

    @staticmethod
    def __new__(cls, tensor: Tensor, spec: CastSpec, scale: Tensor | None = None) -> FP8ShardedWeight:  # noqa: D102
        return _wrapper(cls, tensor, tensor.dtype, tensor.requires_grad)

    def __init__(self, tensor: Tensor, spec: CastSpec, scale: Tensor | None = None) -> None:
        self._tensor = tensor
        self._spec = spec  # the layer's forward weight cast (kept here: the layer may be switched to high precision)
        # one float32 scalar shared by every view of this weight (FSDP's padded shard and its narrowed local view)
        self._scale = scale if scale is not None else torch.ones((), dtype=torch.float32, device=tensor.device)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FP8ShardedWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        first: FP8ShardedWeight | None = None

        def unwrap(t: FP8ShardedWeight) -> Tensor:
            nonlocal first
            first = t if first is None else first
            return t._tensor

        args, kwargs = pytree.tree_map_only(FP8ShardedWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _SHARD_OPS:
            return out
        assert first is not None
        scale = first._scale

        def wrap(t: Tensor) -> FP8ShardedWeight:
            nonlocal scale
            if scale.device != t.device:  # moved (or materialised from meta): a scale of its own on the new device,
                scale = torch.ones((), dtype=torch.float32, device=t.device)  # computed before the next gather
            return FP8ShardedWeight(t, first._spec, scale)

        return pytree.tree_map_only(Tensor, wrap, out)

    def __tensor_flatten__(self) -> tuple[list[str], CastSpec]:
        return ["_tensor", "_scale"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], meta: Any, outer_size: Any, outer_stride: Any) -> FP8ShardedWeight:
        return FP8ShardedWeight(inner["_tensor"], meta, inner["_scale"])

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy: Any
    ) -> tuple[tuple[Tensor, ...], Any]:
        """Cast this rank's shard to FP8 (see the class docstring); FP8 bytes travel as ``uint8`` (every backend has
        it), padded to FSDP's shard size. An empty shard (more ranks than rows' chunks) sends the padding only, with
        no statistics. The layer remembers this shard (``_fp8_gather_shard``): while the layer holds the gathered
        weight, the scale precompute reaches the shard through it."""
        if tuple(self.shape[1:]) != tuple(outer_size[1:]):
            raise ValueError(
                f"FP8 all-gather needs weights sharded on dim 0 (FSDP2's default Shard(0)); a "
                f"{tuple(outer_size)} weight arrived sharded as {tuple(self.shape)} (a shard_placement_fn returning "
                "Shard(1)?). Shard FP8 layers' weights on dim 0, or prepare with "
                "prepare_for_sharding(..., fp8_all_gather=False)."
            )
        module.__dict__["_fp8_gather_shard"] = self
        owner = module.__dict__.get("_fp8_gather_plugin")  # the plugin that computes the shared scales
        plugin = owner() if owner is not None else None
        if plugin is not None:  # fresh scales (one all-reduce for all weights when they changed; every rank gathers)
            plugin._gather_scales_for(module)
        # a copy: the gathered weight (held by the layer, saved for its backward) keeps the scale it was cast with
        # when a later precompute writes the shared one
        spec, scale = self._spec, self._scale.clone()
        state = getattr(module, "fp8_state", None)  # None: the layer was switched to high precision
        if spec.scale_source == "history" and state is not None:
            table, index = state.table, state.index
            scale = torch.where(table.forward_ready[index, WEIGHT], table.forward_scale[index, WEIGHT], scale)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads every shard to the first one's rows
        if self._tensor.numel() == 0:
            data = torch.zeros((rows, *outer_size[1:]), dtype=spec.dtype, device=self.device)
            return (data.view(torch.uint8),), (spec.dtype, scale, None)
        with torch.no_grad():
            q = quantize(self._tensor, spec, scale=scale)
        data = q.data
        if data.size(0) != rows:
            padded = data.new_zeros((rows, *data.shape[1:]))
            padded[: data.size(0)].copy_(data)
            data = padded
        return (data.view(torch.uint8),), (spec.dtype, q.scale, q.stats)

    def fsdp_post_all_gather(
        self, outputs: tuple[Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: Tensor | None = None
    ) -> Any:
        """Wrap the gathered FP8 bytes as the unsharded weight (an :class:`FP8GatheredWeight` of ``param_dtype``)."""
        (data,) = outputs
        dtype, scale, stats = metadata
        if out is not None:  # FSDP2 re-gathered into the same storage
            gathered = out._local_tensor if isinstance(out, DTensor) else out
            gathered._scale, gathered._stats = scale, stats
            return None
        return FP8GatheredWeight(data.view(dtype), scale, stats, param_dtype), (data,)


class FP8GatheredWeight(Tensor):
    """The unsharded weight FSDP2 hands to an FP8 layer after an FP8 all-gather: FP8 data and the shared scale,
    presented as a tensor of the parameter's dtype (so that its gradient has that dtype).

    FP8Linear takes ``_data`` and ``_scale`` as its FP8 weight (the weight provider seam). Any other use computes with
    the dequantized weight, ``data / scale`` in the parameter's dtype (the high-precision weight is never gathered):
    an FP8 layer outside an FP8 region, or one switched to high precision.
    """

    _data: Tensor
    _scale: Tensor
    _stats: Any

    @staticmethod
    def __new__(cls, data: Tensor, scale: Tensor, stats: Any, dtype: torch.dtype) -> FP8GatheredWeight:  # noqa: D102
        return _wrapper(cls, data, dtype, False)

    def __init__(self, data: Tensor, scale: Tensor, stats: Any, dtype: torch.dtype) -> None:
        self._data, self._scale, self._stats = data, scale, stats

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, fp8={self._data.dtype}, scale={self._scale!r})"

    def dequantize(self) -> Tensor:
        """``data / scale`` in the tensor's dtype."""
        return (self._data.to(torch.float32) / self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _GATHERED_OPS:
            w = args[0]
            return FP8GatheredWeight(func(w._data, *args[1:], **(kwargs or {})), w._scale, w._stats, w.dtype)
        args, kwargs = pytree.tree_map_only(FP8GatheredWeight, FP8GatheredWeight.dequantize, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[torch.dtype]]:
        return ["_data", "_scale"], (self.dtype,)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], meta: Any, outer_size: Any, outer_stride: Any) -> FP8GatheredWeight:
        return FP8GatheredWeight(inner["_data"], inner["_scale"], None, meta[0])


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def gathered_weight(layer: nn.Module, spec: CastSpec, history: tuple[Tensor, Tensor] | None) -> Quantized | None:
    """The weight provider of layers prepared for FP8 all-gather: the gathered FP8 weight when the layer's weight is
    one and ``spec`` is the cast it was gathered with; ``None`` otherwise (the layer quantizes its weight itself).

    The shard's statistics come with it; the layer records them once per optimizer step (a later micro-batch's gather
    repeats them)."""
    weight = _local(layer.weight)
    if not isinstance(weight, FP8GatheredWeight) or spec.granularity != "tensor" or spec.dtype != weight._data.dtype:
        return None
    return Quantized(weight._data, weight._scale, weight._stats)


def gathers_fp8(recipe: FP8Recipe) -> bool:
    """Whether FSDP2 gathers the weights of ``recipe`` in FP8: per-tensor weight scales (``tensorwise``,
    ``delayed``) whose forward cast is also the backward's. ``rowwise`` and ``mxfp8`` cast the weight twice, along
    each GEMM's own reduction dimension, and the grad_input cast scales along the columns, which no row shard holds
    whole (gathering both casts would move as many bytes as bf16); ``blockwise``'s 128×128 blocks serve both GEMMs
    but need shards of whole 128-row blocks (not done yet). FSDP2 gathers those in the parameter dtype and each layer
    casts the gathered weight."""
    specs = recipe.cast_specs()
    return specs.forward[WEIGHT].granularity == "tensor" and specs.weight_reused


def _unwrap_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post hook: the weight is saved as the plain high-precision tensor (a DTensor of it when sharded),
    so checkpoints never hold the subclass and load into any model."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and isinstance(value._local_tensor, FP8ShardedWeight):
        state_dict[key] = DTensor.from_local(
            value._local_tensor._tensor, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    elif isinstance(value, FP8ShardedWeight):
        state_dict[key] = value._tensor


def tied_parameters(module: nn.Module) -> set[int]:
    """The ``id`` of every parameter of ``module`` that more than one submodule holds (tied weights)."""
    seen: set[int] = set()
    tied: set[int] = set()
    for _, param in module.named_parameters(remove_duplicate=False):
        (tied if id(param) in seen else seen).add(id(param))
    return tied


def enable_fp8_all_gather(module: nn.Module) -> list[str]:
    """Give every FP8 layer of ``module`` whose recipe :func:`gathers_fp8` an :class:`FP8ShardedWeight` weight (the
    same values, a new Parameter) and the :func:`gathered_weight` provider. Call before ``fully_shard`` (FSDP2 looks
    at the weights when it shards them) and before creating the optimizer. Returns the names of those layers
    (the ones already prepared included). A weight tied to another module (``lm_head.weight is embedding.weight``) is
    left as it is, gathered in the parameter dtype: wrapping it would untie it."""
    from lightning_fp8.state import fp8_layers

    # a weight tied to another module (an LM head sharing the embedding's weight) stays a plain parameter: wrapping it
    # would untie it, and the other module would then compute with the FP8-gathered weight
    tied = tied_parameters(module)
    names = []
    for name, layer in fp8_layers(module):
        if not isinstance(layer, nn.Linear) or not gathers_fp8(layer.fp8_recipe):  # type: ignore[attr-defined]
            continue
        if id(layer.weight) in tied:
            continue
        names.append(name)
        if isinstance(_local(layer.weight), FP8ShardedWeight):
            continue
        if isinstance(layer.weight, DTensor):
            raise ValueError(
                f"layer {name!r} is sharded already: prepare the model for FP8 all-gather before fully_shard / "
                "parallelize_module (lightning_fp8.prepare_for_sharding at the top of configure_model)"
            )
        weight = layer.weight
        spec = layer.fp8_state.table.specs.forward[WEIGHT]  # type: ignore[union-attr]
        layer.weight = nn.Parameter(FP8ShardedWeight(weight.data, spec), requires_grad=weight.requires_grad)
        layer.weight_provider = gathered_weight  # type: ignore[attr-defined]
        layer.register_state_dict_post_hook(_unwrap_state_dict)
    return names


def fp8_all_gather_shard(layer: nn.Module) -> FP8ShardedWeight | None:
    """The local :class:`FP8ShardedWeight` shard of ``layer``'s weight: the weight itself while sharded, the shard
    FSDP2 last gathered from while the layer holds the gathered weight (FSDP2 keeps the root's parameters unsharded
    after forward, and ``FSDPModule.unshard()`` gathers ahead); ``None`` when the weight does not gather in FP8."""
    weight = _local(getattr(layer, "weight", None))
    if isinstance(weight, FP8ShardedWeight):
        return weight
    if isinstance(weight, FP8GatheredWeight):
        return layer.__dict__.get("_fp8_gather_shard")
    return None


def reshard_fsdp_modules(module: nn.Module) -> None:
    """Reshard every FSDP2 module of ``module`` that holds its gathered parameters (FSDP2 keeps the root's gathered
    after a forward with no backward), so that the next forward gathers them again (a no-op for the others)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def fp8_all_gather_weights(module: nn.Module) -> list[FP8ShardedWeight]:
    """The local :class:`FP8ShardedWeight` shards of ``module``'s layers (``[]`` when none gathers in FP8), those of
    layers switched back to high precision included (their weights still gather in FP8); each once (a layer's
    ``torch.compile`` wrapper forwards ``weight`` to the layer)."""
    shards = {id(w): w for m in module.modules() if (w := fp8_all_gather_shard(m)) is not None}
    return list(shards.values())


#: Moves at every optimizer step that updates FP8 all-gather weights (:func:`_after_optimizer_step`), the plugin's or
#: not: the plugins compare it with the value at their last scale precompute.
_gather_weights_epoch = 0


def _gathered_weights_epoch() -> int:
    """A counter of the optimizer steps (any ``torch.optim`` optimizer, also one a plugin does not see) that updated
    weights FSDP2 gathers in FP8. The plugins recompute the shared gather scales when it moved: a fused optimizer
    moves no version counter, and the plugin may not see the step (a Fabric loop calling ``optimizer.step()``).

    Only steps of optimizers that hold such weights count: every rank of a sharded model steps its optimizer, so the
    decision (which starts a collective) stays the same on every rank; an optimizer of another model that one rank
    steps alone changes nothing."""
    return _gather_weights_epoch


def _updates_gathered_weights(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds a weight that FSDP2 gathers in FP8: an :class:`FP8ShardedWeight` inside a
    ``DTensor`` (FSDP2's sharded parameter). A plain one (a copy of a prepared model that was never sharded, which
    one rank may train alone) is never gathered. Remembered on the optimizer while its parameters are the same
    tensors."""
    key = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
    known = optimizer.__dict__.get("_fp8_gathered_weights")
    if known is not None and known[0] == key:
        return known[1]
    params = (p for group in optimizer.param_groups for p in group["params"])
    holds = any(isinstance(p, DTensor) and isinstance(p._local_tensor, FP8ShardedWeight) for p in params)
    optimizer.__dict__["_fp8_gathered_weights"] = (key, holds)
    return holds


def gathered_weights_changed() -> None:
    """Make the shared FP8 all-gather scales stale: the next gather of every FSDP2 model recomputes them (a
    collective: every rank must call this; see ``lightning_fp8.weights_may_have_changed(all_ranks=True)``)."""
    global _gather_weights_epoch
    _gather_weights_epoch += 1


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _updates_gathered_weights(optimizer):
        gathered_weights_changed()


register_optimizer_step_post_hook(_after_optimizer_step)


@torch.no_grad()
def precompute_fp8_weight_scales(weights: list[FP8ShardedWeight], group: dist.ProcessGroup | None = None) -> None:
    """The whole-weight scales of FP8 all-gather weights (``weights``: their local :class:`FP8ShardedWeight` shards),
    in one all-reduce for all of them: ``amax`` = MAX over ranks of each shard's ``max |w|``, ``scale =
    amax_to_scale(amax)`` with each weight's cast spec (the ``tensorwise`` formula). The plugin calls it before the
    first forward after each optimizer step; every rank must call it (it is a collective)."""
    if not weights:
        return
    specs = [w._spec for w in weights]
    # an empty shard (FSDP2 gives the last ranks none of a small weight's rows) has amax 0; it keeps its entry, so
    # that every rank all-reduces the same number of amaxes
    shards = [w._tensor if w._tensor.numel() else w._tensor.new_zeros(1) for w in weights]
    amax = torch.stack(torch._foreach_norm(shards, math.inf)).to(torch.float32)
    if world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    fp8_max = torch.tensor([s.fp8_max for s in specs], dtype=torch.float64, device=amax.device)
    margin = {s.margin for s in specs}
    power_of_2 = {s.power_of_2 for s in specs}
    if len(margin) == 1 and len(power_of_2) == 1:
        scales = amax_to_scale(amax, fp8_max, margin.pop(), power_of_2.pop())
    else:  # recipes with different settings in one model: one formula call each
        scales = torch.stack([amax_to_scale(a, s.fp8_max, s.margin, s.power_of_2) for a, s in zip(amax, specs)])
    torch._foreach_copy_([w._scale for w in weights], list(scales.unbind()))


# ------------------------------------------------------------------------------------------------ tensor parallel
# torchao's Float8ColwiseParallel / Float8RowwiseParallel accept only torchao's Float8Linear (they raise for any other
# module), so FP8Linear handles tensor parallelism itself: torch's own ColwiseParallel / RowwiseParallel (and
# SequenceParallel around them) shard an FP8Linear's parameters as DTensors and hand it DTensor inputs; the layer then
# computes its three GEMMs on the local pieces, with every scale agreed across the tensor-parallel group.


def _all_reduce_max(amax: Tensor, group: dist.ProcessGroup) -> Tensor:
    """MAX of ``amax`` over ``group`` (a functional collective: traceable by ``torch.compile``; no host sync)."""
    return funcol.wait_tensor(funcol.all_reduce(amax, "max", group))


class TensorParallelLayout:
    """How an FP8Linear is split across a 1-D tensor-parallel mesh, from its weight's placement: ``"colwise"``
    (weight ``Shard(0)``: each rank holds some output features; input replicated, output sharded on its last dim) or
    ``"rowwise"`` (weight ``Shard(1)``: some input features; input sharded on its last dim, output a partial sum).

    Which dimension of each 2-D local operand is sharded (``x`` (M, K), ``weight`` (N, K), ``grad_output`` (M, N))::

        colwise: x none, weight 0 (N), grad_output 1 (N)
        rowwise: x 1 (K), weight 1 (K), grad_output none

    A cast needs the whole tensor's amaxes where its scale spans the sharded dimension: a per-tensor scale of a
    sharded operand, a row scale computed along the sharded dimension; those amaxes are MAX-reduced over the group
    (:meth:`amax_reduce`), so that every rank casts its piece exactly as the unsharded layer casts that piece. A block
    scale never spans ranks when the local size along the sharded dimension is a multiple of the block (else an error
    names the sizes).
    """

    _SHARDED = {"colwise": {INPUT: None, WEIGHT: 0, GRAD_OUTPUT: 1}, "rowwise": {INPUT: 1, WEIGHT: 1, GRAD_OUTPUT: None}}

    def __init__(self, style: str, mesh: Any) -> None:
        self.style = style
        self.mesh = mesh
        self.group = mesh.get_group()

    def amax_reduce(self, spec: CastSpec, x: Tensor) -> Callable[[Tensor], Tensor] | None:
        """The amax reduction the cast ``spec`` of the local 2-D piece ``x`` needs (``None``: the local amaxes are the
        whole tensor's)."""
        dim = self._SHARDED[self.style][spec.role]
        if dim is None:
            return None
        if spec.granularity == "row" and (spec.axis or 0) % 2 != dim:
            return None
        if spec.granularity == "block":
            assert spec.block is not None
            if spec.block[dim] > 1 and x.shape[dim] % spec.block[dim]:
                raise ValueError(
                    f"tensor parallel ({self.style}): each rank's {x.shape[dim]} {'rows' if dim == 0 else 'columns'} "
                    f"are not a multiple of the recipe's {spec.block[dim]}-element blocks, so blocks would span ranks; "
                    "choose features whose per-rank share is a multiple of the block size."
                )
            return None
        return functools.partial(_all_reduce_max, group=self.group)


def tensor_parallel_layout(weight: Tensor) -> TensorParallelLayout | None:
    """The :class:`TensorParallelLayout` of a DTensor weight (``None`` for a plain tensor).

    Raises:
        ValueError: for a placement torch's column-wise / row-wise styles do not produce (a weight replicated, or a
            mesh of more than one dimension: FSDP2 shards on its own mesh dimension and gathers before the forward).
    """
    if not isinstance(weight, DTensor):
        return None
    placements = weight.placements
    if weight.device_mesh.ndim == 1 and isinstance(placements[0], Shard) and placements[0].dim in (0, 1):
        return TensorParallelLayout("colwise" if placements[0].dim == 0 else "rowwise", weight.device_mesh)
    raise ValueError(
        f"FP8Linear supports tensor-parallel weights sharded column-wise (Shard(0)) or row-wise (Shard(1)) on a 1-D "
        f"mesh (torch's ColwiseParallel / RowwiseParallel); got placements {placements} on a {weight.device_mesh.ndim}-D "
        "mesh."
    )


class _KeepFP8AllGather:
    """Mixin of the FP8 styles: shard the weight as the torch style does, then wrap the local piece as an
    :class:`FP8ShardedWeight` again (FSDP2 then gathers it in FP8 on the data-parallel mesh)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        weight = module.weight
        wrapped = isinstance(weight, FP8ShardedWeight)
        if wrapped:
            module.weight = nn.Parameter(weight._tensor, requires_grad=weight.requires_grad)
        super()._partition_linear_fn(name, module, device_mesh)  # type: ignore[misc]
        if wrapped:
            sharded = module.weight
            local = FP8ShardedWeight(sharded._local_tensor, weight._spec)
            module.weight = nn.Parameter(
                DTensor.from_local(local, sharded.device_mesh, sharded.placements, run_check=False, shape=sharded.shape, stride=sharded.stride()),
                requires_grad=sharded.requires_grad,
            )


class FP8ColwiseParallel(_KeepFP8AllGather, ColwiseParallel):
    """torch's ``ColwiseParallel`` for FP8 layers prepared by :func:`~lightning_fp8.prepare_for_sharding`: the same
    sharding and layouts (all its arguments), and the weight keeps its FP8 all-gather under FSDP2. torch's own style
    works on FP8Linear too, but its weights then gather in high precision (the plugin warns). The layer computes on its
    local pieces with scales agreed across the group (:class:`TensorParallelLayout`); an input sharded on the sequence
    (``input_layouts=Shard(1)``, sequence parallelism) is all-gathered in high precision before the FP8 cast.
    (torchao's ``Float8ColwiseParallel`` accepts only torchao's ``Float8Linear``.)"""


class FP8RowwiseParallel(_KeepFP8AllGather, RowwiseParallel):
    """torch's ``RowwiseParallel`` for FP8 layers prepared by :func:`~lightning_fp8.prepare_for_sharding` (see
    :class:`FP8ColwiseParallel`): the output is a partial sum, reduced (or reduce-scattered to ``output_layouts``) by the
    style in high precision."""
