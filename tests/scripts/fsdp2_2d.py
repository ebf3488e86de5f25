"""Run by tests/test_fsdp2.py: 2-D parallelism, data parallel 2 x tensor parallel 2, through the Trainer's
``ModelParallelStrategy`` on 4 CPU processes (tests/scripts/gloo_checks.py with ``GLOO_WORLD_SIZE=4``).

``main(OUT_DIR, RECIPE)``: the model and data of tests/scripts/fsdp2_train.py (the MLPs column-/row-wise and the LM
head column-wise with lightning_fp8's styles, then FSDP2 over the data-parallel mesh), 2 epochs with validation every 2
steps.
Before every forward of an FP8 layer whose weight FSDP2 gathered in FP8, the float32 shards of all 4 ranks are gathered
by hand into the tensor-parallel rank's weight and into the whole weight, and the gathered FP8 weight is compared bit
for bit with the cast of the former by the scale of the latter (``delayed``: the history's scale once it has one).
Each rank writes its losses, those comparisons, its FP8 state and its layers' weight placements.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import fsdp2_train  # noqa: E402
import lightning_fp8 as lf  # noqa: E402
from lightning_fp8.distributed import FP8GatheredWeight, _local, fp8_all_gather_shard  # noqa: E402
from lightning_fp8.quantize import quantize  # noqa: E402
from lightning_fp8.recipe import WEIGHT, amax_to_scale  # noqa: E402


def single_process(recipe):
    return False


def gathered(shard, group, dim):
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim)


def check_gathered_weights(model, rows):
    """Forward pre-hooks on the model's Linear layers (FP8 layers once converted, in place): one row per forward of a
    layer holding an FP8-gathered weight: (layer, bytes equal, scale equal)."""

    def hook(name):
        def check(layer, args):
            weight = layer.weight
            fp8 = _local(weight)
            if not isinstance(fp8, FP8GatheredWeight):
                rows.append((name, False, False))
                return
            mesh = model.device_mesh
            shard = fp8_all_gather_shard(layer)._tensor.detach()
            tp_local = gathered(shard, mesh["data_parallel"].get_group(), 0)  # FSDP2 shards dim 0 of the local piece
            whole = tp_local
            if isinstance(weight, DTensor):  # column-wise: tensor-parallel dim 0, row-wise: dim 1
                whole = gathered(tp_local, mesh["tensor_parallel"].get_group(), weight.placements[-1].dim)
            table, index = layer.fp8_state.table, layer.fp8_state.index
            spec = table.specs.forward[WEIGHT]
            scale = amax_to_scale(whole.abs().max().float(), spec.fp8_max, spec.margin, spec.power_of_2)
            if spec.scale_source == "history":
                scale = torch.where(table.forward_ready[index, WEIGHT], table.forward_scale[index, WEIGHT], scale)
            expected = quantize(tp_local, spec, scale=scale.clone(), statistics=False)
            same_bytes = torch.equal(expected.data.view(torch.uint8), fp8._data.view(torch.uint8))
            rows.append((name, same_bytes, bool(torch.equal(fp8._scale.float(), expected.scale.float()))))

        return check

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(hook(name))


def main(out_dir, recipe):
    record, rows = fsdp2_train.Record(), []
    model = fsdp2_train.fresh(0)
    check_gathered_weights(model, rows)
    fsdp2_train.trainer(out_dir, recipe, 2, record, 4, tp=2, validate=True).fit(model)
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, lf.FP8Linear)]
    placements = {name: [str(p) for p in module.weight.placements] for name, module in layers}
    result = {"losses": record.losses, "val_losses": record.val_losses, "checks": rows, "placements": placements,
              "fp8": lf.fp8_state_dict(model)}  # fmt: skip
    torch.save(result, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
