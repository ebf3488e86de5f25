"""Calibration for the ``delayed`` recipe: fill the amax histories with measured amaxes before training.

``delayed`` casts each tensor with a scale derived from the amaxes of earlier steps. A fresh model has empty
histories: its first step casts every tensor with its own current amax (the fallback of
:mod:`lightning_fp8.recipe`), and the following ``amax_history_len`` steps take their scales from a history of
one, two, ... entries, all from the very first steps. :func:`calibrate` runs a few representative batches
through the model in FP8 first, so that the first training step already casts with history scales derived
from measured amaxes, of several batches.

Per batch, :func:`calibrate` runs

1. the forward in FP8, in training mode, inside the plugin's ``forward_context`` (``torch.autocast`` plus the
   FP8 region) or, without a plugin, inside an FP8 region alone; every input and weight cast records its amax;
2. with a ``loss_fn``: a backward of ``loss × loss scale`` through ``torch.autograd.grad``; every grad_output
   cast records its amax. The loss is multiplied by the plugin's current loss scale (1 with ``"skip_nonfinite"``
   or ``"off"`` or without a plugin) because the grad_output histories hold amaxes in the loss-scaled domain,
   as training records them (:mod:`lightning_fp8.loss_scaling`);
3. one roll of the histories, as one optimizer step would roll them (under ``torch.distributed``, after the
   same MAX all-reduce of the pending amaxes as in training, :mod:`lightning_fp8.distributed`).

**One history entry per batch.** Each batch pushes one entry, exactly what a training step on that batch
would have pushed, with the weights unchanged. With ``amax_compute_algo="max"`` (the default) the first step
then casts with the largest amax of the calibration batches; the entries age out of the ring buffer like any
other after ``amax_history_len`` steps. More batches than ``amax_history_len`` keep only the last ones.

**What calibration leaves as it was.** Parameters and their ``.grad``, the module's buffers (BatchNorm's running
statistics and ``num_batches_tracked``: the forwards run in training mode), (``torch.autograd.grad`` hands the
gradients back instead of accumulating them, and they are dropped; nothing calls an optimizer, parameter
post-accumulate-grad hooks do not run), optimizer and loss-scaler state, the element counters (``seen``,
``nonzero``, ``overflow``, ``underflow``: calibration casts are not training, so the statistics do not count
them) and ``counts_epoch``, amaxes pending from before the call, the ``training`` flag of every submodule, and
the random number generators (calibration runs in a ``torch.random.fork_rng`` block, so dropout and a shuffled
loader iterated inside draw nothing that training would see). State tables of other recipes in the same model
are restored entirely.

A model wrapped by Fabric (``fabric.setup``) or in ``DistributedDataParallel`` is unwrapped first: calibration
runs the original module, so DDP's gradient reducer never sees the calibration backward.

Why a function of its own: neither Transformer Engine nor torchao offers a calibration of delayed-scaling
histories for training (Transformer Engine's ``calibrating=True`` records amaxes for FP8 *inference* of a model
trained in high precision).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_fp8.distributed import all_reduce_pending_amax, reshard_fsdp_modules, world_size
from lightning_fp8.region import fp8_region, in_inference_mode
from lightning_fp8.state import STATE_FIELDS, FP8StateTable, state_tables

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_fp8.fabric import FP8PrecisionBase

__all__ = ["calibrate"]

#: ``step(module, batch, index) -> loss or None``: one calibration forward (the loss is only used with a backward).
StepFn = Callable[[nn.Module, Any, int], Any]

_END = object()


def calibrate(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    num_batches: int | None = None,
    precision: FP8PrecisionBase | None = None,
) -> int:
    """Fill the ``delayed`` amax histories of ``model``'s FP8 layers with amaxes measured on ``batches``.

    See :mod:`lightning_fp8.calibration` for what runs and what is left unchanged. Call it after the model is
    converted (``convert_to_fp8``, or set up with ``FP8Precision``) and before the first training step::

        model, optimizer = fabric.setup(model, optimizer)
        lightning_fp8.calibrate(model, batches, loss_fn)   # then the training loop

    With the Trainer, ``FP8Precision(recipe="delayed", calibration_batches=N)`` does it for you on the first
    ``N`` batches of the training dataloader.

    Args:
        model: a model with FP8 layers of recipe ``delayed`` (a Fabric-wrapped or DDP-wrapped model is unwrapped).
        batches: an iterable of batches (a list, a ``DataLoader``...), already on the model's device.
        loss_fn: ``loss_fn(output, batch) -> scalar loss``. With it, a backward also fills the grad_output
            histories; without it, only the forward runs (under ``torch.no_grad()``), the input and weight
            histories are filled, and the first step casts the gradients with their current amax.
        forward: ``forward(module, batch) -> output`` (default ``module(batch)``, with Fabric's cast of the
            forward arguments when the model is set up with Fabric's ``FP8Precision``). ``module`` is the unwrapped
            model. Use it when the model takes part of the batch, e.g. ``lambda m, b: m(b[0])``.
        num_batches: use at most this many batches of ``batches`` (default: all of them).
        precision: the ``FP8Precision`` plugin (Trainer or Fabric) the model is set up with, for its autocast
            region and loss scale. Default: the plugin that set up this model, if any; without one, the batches run
            inside an FP8 region only (wrap the call in ``torch.autocast`` yourself if training uses it) with a loss
            scale of 1.

    Returns:
        The number of batches used.

    Raises:
        ValueError: if the model has no FP8 layers, none of recipe ``delayed`` (``tensorwise`` and ``rowwise`` scale
            every cast from the tensor being cast: there is no history to calibrate), if ``num_batches`` is not an
            int >= 1, or if there was no batch.
        RuntimeError: under ``torch.inference_mode()``, where FP8 layers record nothing.
    """
    module = unwrap(model)
    if precision is None:
        from lightning_fp8.fabric import plugin_of

        precision = plugin_of(module)
    run_forward = forward
    if run_forward is None:
        if precision is not None:

            def run_forward(m: nn.Module, batch: Any) -> Any:
                return precision.convert_output(m(precision.convert_input(batch)))

        else:

            def run_forward(m: nn.Module, batch: Any) -> Any:
                return m(batch)

    if loss_fn is None:

        def step(m: nn.Module, batch: Any, index: int) -> Any:
            run_forward(m, batch)
            return None

    else:

        def step(m: nn.Module, batch: Any, index: int) -> Any:
            return loss_fn(run_forward(m, batch), batch)

    return calibrate_with(module, batches, step, backward=loss_fn is not None, num_batches=num_batches, precision=precision)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under Fabric's ``_FabricModule`` and ``DistributedDataParallel`` wrappers."""
    from lightning.fabric.wrappers import _FabricModule
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, (_FabricModule, DistributedDataParallel)):
        model = model.module
    return model


def calibrate_with(
    module: nn.Module,
    batches: Iterable[Any],
    step: StepFn,
    *,
    backward: bool,
    num_batches: int | None = None,
    precision: FP8PrecisionBase | None = None,
) -> int:
    """The calibration loop of :func:`calibrate` with a ``step(module, batch, index) -> loss or None`` of the
    caller's (the Trainer plugin passes one that runs ``training_step``). With ``backward``, a returned loss is
    backpropagated (a ``None`` loss skips the backward of that batch). Returns the number of batches used."""
    if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1):
        raise ValueError(f"num_batches must be None or an int >= 1, got {num_batches!r}")
    tables = state_tables(module)
    if not tables:
        raise ValueError(
            f"calibrate: {type(module).__name__} has no FP8 layers; convert it first (lightning_fp8.convert_to_fp8, or "
            "set it up with FP8Precision)"
        )
    delayed = [t for t in tables if t.recipe.name == "delayed"]
    if not delayed:
        names = sorted({t.recipe.name for t in tables})
        raise ValueError(
            f"calibration only applies to recipe='delayed' (its scales come from the amax history); this model's FP8 "
            f"layers use {names}, which scale every cast from the tensor being cast: there is nothing to calibrate"
        )
    if in_inference_mode():
        raise RuntimeError("calibrate cannot run under torch.inference_mode(): FP8 layers record no amaxes there")
    others = [t for t in tables if t.recipe.name != "delayed"]
    device = delayed[0].device
    loss_scale = precision.loss_scale if precision is not None else None
    params = [p for p in module.parameters() if p.requires_grad]
    modes = [(m, m.training) for m in module.modules()]
    saved_buffers = [(b, b.detach().clone()) for b in module.buffers()]  # e.g. BatchNorm's running statistics
    saved_others = [(t, t.tensors()) for t in others]
    saved_counts = [[c.clone() for c in t.role_counts] for t in delayed]
    saved_pending = [[p.clone() for p in t.role_amax_pending] for t in delayed]
    rng_devices = [device] if device.type == "cuda" else []
    count = 0
    try:
        with torch.random.fork_rng(devices=rng_devices):
            for t in delayed:
                torch._foreach_zero_([p.data for p in t.role_amax_pending])
            module.train()
            iterator: Iterator[Any] = iter(batches)
            while num_batches is None or count < num_batches:
                batch = next(iterator, _END)
                if not _all_ranks_have_batch(batch is not _END, device):
                    break
                with torch.enable_grad() if backward else torch.no_grad():
                    with contextlib.ExitStack() as context:
                        if precision is not None:
                            context.enter_context(precision.forward_context())  # autocast + the plugin's region
                        context.enter_context(fp8_region(True, defer_amax_history_roll=True))
                        loss = step(module, batch, count)
                    if backward and loss is not None:
                        _backward(loss, loss_scale, params)
                all_reduce_pending_amax(delayed)
                for table in delayed:
                    table.roll()
                count += 1
    finally:
        reshard_fsdp_modules(module)  # FSDP2 holds the root's parameters gathered after a forward without backward
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for buffer, value in saved_buffers:
                buffer.copy_(value)
        for table, counts, pending in zip(delayed, saved_counts, saved_pending):
            torch._foreach_copy_([c.data for c in table.role_counts], counts)
            torch._foreach_copy_([p.data for p in table.role_amax_pending], pending)
        for table, values in saved_others:
            _restore(table, values)
    if count == 0:
        raise ValueError("calibrate got no batches")
    return count


def _loss_tensor(loss: Any) -> Tensor:
    if isinstance(loss, Mapping):  # a training_step may return {"loss": ..., ...}
        loss = loss.get("loss")
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(f"calibration needs a scalar loss tensor to run the backward, got {type(loss).__name__}")
    return loss


def _backward(loss: Any, loss_scale: Tensor | None, params: list[Tensor]) -> None:
    """Backpropagate ``loss × loss_scale`` into nothing: the gradients of ``params`` are returned and dropped.

    A sharded model (FSDP2: DTensor parameters) computes with the gathered parameters, which are not ``params``, so
    ``torch.autograd.grad`` on ``params`` would run no backward at all: there the backward runs as in training (FSDP2
    reduce-scatters the gradients into ``params``) and the parameters' gradients are put back as they were."""
    loss = _loss_tensor(loss)
    if not loss.requires_grad or not params:
        return
    if loss_scale is not None:
        loss = loss * loss_scale.to(loss.device)
    if any(isinstance(p, DTensor) for p in params):
        saved = [p.grad for p in params]
        loss.reshape(()).backward()
        for p, grad in zip(params, saved):
            p.grad = grad
        return
    torch.autograd.grad(loss.reshape(()), params, allow_unused=True)


def _all_ranks_have_batch(have: bool, device: torch.device) -> bool:
    """Under ``torch.distributed``, whether every rank has a next batch (one tiny collective and one host read per
    calibration batch, outside training): the ranks stop together, so the amax all-reduce cannot hang."""
    if world_size() == 1:
        return have
    flag = torch.tensor([1 if have else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _restore(table: FP8StateTable, values: dict[str, Tensor]) -> None:
    index = torch.arange(table.num_layers, device=table.device)
    for name in STATE_FIELDS:
        table.set_rows(name, index, values[name])


@contextlib.contextmanager
def preserved_loader_generators(loaders: Any) -> Iterator[None]:
    """Restore the state of the ``torch.Generator`` objects of ``loaders`` (a ``DataLoader``, or a list or dict of
    them) on exit: a ``DataLoader(shuffle=True, generator=g)`` draws its order (and its workers' base seed) from
    ``g``, not from the global random state that ``torch.random.fork_rng`` restores, so an extra pass over the
    loader before training would otherwise change the training's data order."""
    pending = list(loaders.values()) if isinstance(loaders, Mapping) else list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]
    generators: dict[int, torch.Generator] = {}
    for loader in pending:
        for holder in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                       getattr(getattr(loader, "batch_sampler", None), "sampler", None)):  # fmt: skip
            generator = getattr(holder, "generator", None)
            if isinstance(generator, torch.Generator):
                generators[id(generator)] = generator
    states = [(g, g.get_state()) for g in generators.values()]
    try:
        yield
    finally:
        for generator, state in states:
            generator.set_state(state)


@contextlib.contextmanager
def first_training_batches(trainer: pl.Trainer, num_batches: int) -> Iterator[Iterator[Any]]:
    """The first ``num_batches`` batches of a pass over the Trainer's training dataloader, each moved to the device as
    training moves it (``strategy.batch_to_device``: the LightningModule's transfer hooks), as an iterator that reads
    the loader lazily inside the ``with`` block. Several loaders (a list or dict) are combined as Lightning combines
    them for training (``CombinedLoader(..., "max_size_cycle")``).

    In a fixed order (no shuffling, or the ``DistributedSampler`` Lightning adds under DDP, which shuffles by seed and
    epoch) these are the batches training starts with. A shuffling sampler draws another order for this pass: Lightning
    creates the training's iterator, and so draws its order, before ``on_train_start``.

    On exit the random state is as it was, so that this extra pass does not change the training's data order or
    dropout masks: the global generators (``torch.random.fork_rng``, with the CUDA generator of the root device) and
    the loaders' own ``torch.Generator`` objects (:func:`preserved_loader_generators`). Used by the Trainer plugin's
    calibration and by :class:`~lightning_fp8.FP8SensitivityCallback`.

    Raises:
        ValueError: if the Trainer has no training dataloader.
    """
    from lightning.pytorch.utilities import CombinedLoader

    loaders = trainer.train_dataloader
    if loaders is None:
        raise ValueError("the Trainer has no training dataloader")
    strategy = trainer.strategy
    root = strategy.root_device
    with torch.random.fork_rng(devices=[root] if root.type == "cuda" else []), preserved_loader_generators(loaders):
        batches = (
            strategy.batch_to_device(batch, dataloader_idx=dataloader_idx)
            for batch, _, dataloader_idx in CombinedLoader(loaders, "max_size_cycle")
        )
        yield itertools.islice(batches, num_batches)


@contextlib.contextmanager
def muted_logging(module: nn.Module) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing inside (a LightningModule's ``training_step`` run for
    calibration must not add its calibration losses to the logged metrics)."""
    names = [name for name in ("log", "log_dict") if hasattr(module, name)]
    for name in names:
        object.__setattr__(module, name, _no_log)
    try:
        yield
    finally:
        for name in names:
            module.__dict__.pop(name, None)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None
