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

import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

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
