"""Distributed glue: keeping FP8 scaling decisions identical on every data-parallel rank.

Under DDP every rank sees a different shard of the batch, so the amaxes its layers record differ.
Before the amax histories roll (once per optimizer step), the pending amaxes of all FP8 layers are
reduced with ``MAX`` across ranks in a single collective, as Transformer Engine does for its
data-parallel group. All ranks then hold the same histories and derive the same ``delayed`` scales,
which also makes the amax histories and scales saved by rank 0 valid for every rank on resume. (The
overflow/underflow counters are per rank; on resume every rank starts from rank 0's counters.)

The collective goes through ``torch.distributed`` (no host synchronisation; on NCCL it is queued on
the stream). Counters (seen/overflow/underflow) stay per rank; the stats callback reduces them when
it logs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8.scaling import STATE_BUFFERS, fp8_modules


@torch.no_grad()
def all_reduce_pending_amax(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """MAX-reduce every FP8 layer's pending amaxes across ``group`` in one collective (no-op when not distributed).

    Non-finite amaxes are sent as ``+inf`` (a NaN would make the reduction order-dependent); the
    history treats both as "ignore this entry".
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    modules = list(fp8_modules(model).values())
    if not modules:
        return
    pending = torch.stack([m.fp8_amax_pending for m in modules])
    pending = torch.where(torch.isnan(pending), torch.full_like(pending, float("inf")), pending)
    dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=group)
    for module, reduced in zip(modules, pending.unbind(0)):
        module.fp8_amax_pending.copy_(reduced)


def keep_fp8_state_local_under_ddp(model: nn.Module) -> list[str]:
    """Stop DDP from broadcasting the FP8 state buffers from rank 0 before every forward.

    DDP's ``broadcast_buffers=True`` (its default) copies every buffer of rank 0 to all ranks, which
    would overwrite each rank's overflow/underflow counters (the stats callback then counts rank 0
    twice) and resend the whole state every step. The amax histories are kept equal by
    :func:`all_reduce_pending_amax` instead. Must run before ``DistributedDataParallel(model)`` (the
    precision plugin's ``convert_module`` does). Returns the buffer names added to DDP's ignore list.
    """
    names = [f"{prefix}.{buf}" if prefix else buf for prefix, m in fp8_modules(model).items() for buf in STATE_BUFFERS]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    model._ddp_params_and_buffers_to_ignore = ignored + [n for n in names if n not in ignored]
    return names
