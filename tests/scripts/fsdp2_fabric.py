"""Run by tests/test_fsdp2.py: FP8 training with FSDP2 through Fabric's ModelParallelStrategy, 2 CPU processes on gloo
(or one process without a strategy: the reference).

Usage: fsdp2_fabric.py OUT_DIR RECIPE MODE, MODE ``single``, ``fsdp2``, ``tp`` or ``hsdp``. Eight AdamW steps on
global batches of 8 (``fsdp2``: 4 per rank), straight; then 4 steps, ``fabric.save`` (a distributed checkpoint folder),
a fresh model and optimizer, ``fabric.load``, 4 more steps (each run a new Fabric with a plugin of its own, as a new
process): the weights must be those of the straight run, bit for bit. ``tp``: tensor parallel 2 x data parallel 1 (the
MLPs and the LM head with lightning_fp8's styles, then FSDP2 on the data-parallel mesh), both ranks on the same batches.
``hsdp``: 4 processes (``GLOO_WORLD_SIZE=4``), FSDP2 on a (replicate 2, shard 2) mesh, 2 windows per rank.

Or ``main(OUT_DIR, RECIPE, MODE)`` from tests/scripts/gloo_checks.py (``single`` there runs before the launch, in the
first process only: ``single_process``).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy  # noqa: E402
from models import TinyDecoder, loader  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

import lightning_fp8 as lf  # noqa: E402
from lightning_fp8.fabric import FP8Precision  # noqa: E402

DIM, STEPS = 128, 8


def parallelize(model, device_mesh):
    lf.prepare_for_sharding(model)  # Fabric converted the model already: this makes the FP8 weights gather in FP8
    tp = device_mesh["tensor_parallel"]
    if tp.size() > 1:
        for block in model.blocks:
            parallelize_module(block, tp, {"fc": lf.FP8ColwiseParallel(), "out": lf.FP8RowwiseParallel()})
        parallelize_module(model.lm_head, tp, lf.FP8ColwiseParallel(output_layouts=Replicate()))
    mesh = device_mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parallelize_hsdp(model, device_mesh):
    """HSDP: FSDP2 on a (replicate 2, shard 2) mesh of the 4 processes, which Fabric's data-parallel mesh spans."""
    lf.prepare_for_sharding(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def single_process(recipe, mode):
    return mode == "single"


def main(out_dir, recipe, mode):
    def new_fabric():
        """A Fabric with a plugin of its own: each run below is a new training run, as a resume in a new process."""
        plugin = FP8Precision(recipe=recipe)
        if mode == "single":
            fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        elif mode == "hsdp":
            strategy = ModelParallelStrategy(parallelize_hsdp, data_parallel_size=4, tensor_parallel_size=1)
            fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy, plugins=[plugin])
        else:
            tp = 2 if mode == "tp" else 1
            strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2 // tp, tensor_parallel_size=tp)
            fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
        fabric.launch()
        return fabric, plugin

    fabric, _ = new_fabric()
    data = loader(n=32 * 32 + 1, batch_size=8).dataset
    windows = torch.stack([data[i][0] for i in range(len(data))]), torch.stack([data[i][1] for i in range(len(data))])
    rank, world = fabric.global_rank, fabric.world_size
    if mode == "tp":  # the tensor-parallel ranks see the same batches: one data-parallel rank
        rank, world = 0, 1


    def batch(step):
        """Global batch ``step`` (8 windows), this rank's share: windows r, r + world, ..."""
        index = torch.arange(step * 8, step * 8 + 8) % len(data)
        index = index[rank::world]
        return windows[0][index], windows[1][index]


    def run(steps, start=0, state=None):
        fabric, plugin = new_fabric()
        torch.manual_seed(0 if state is None else 1)  # a resumed run starts from another init: all must come from the file
        model = fabric.setup_module(TinyDecoder(dim=DIM, heads=4, layers=2))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
        if state is not None:
            fabric.load(state, {"model": model, "optimizer": optimizer, "fp8": plugin})
        losses = []
        for step in range(start, start + steps):
            idx, target = batch(step)
            logits = model(idx)  # through Fabric's wrapper: the plugin's autocast and FP8 region
            loss = F.cross_entropy(logits.float().view(-1, 256), target.reshape(-1))
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            loss = loss.detach().clone()
            if world > 1:
                dist.all_reduce(loss)
                loss /= world
            losses.append(loss.item())
        return fabric, model, optimizer, plugin, losses


    def full_state(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if fabric.world_size == 1:
            return {k: v.detach().clone() for k, v in model.state_dict().items()}
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


    _, model, _, _, losses = run(STEPS)
    straight = full_state(model)
    weight_types = {
        n: (type(getattr(m.weight, "_local_tensor", m.weight)).__name__, [str(p) for p in getattr(m.weight, "placements", ())])
        for n, m in model.named_modules()
        if isinstance(m, lf.FP8Linear)
    }
    fp8_straight = lf.fp8_state_dict(model)
    result = {"losses": losses, "state": straight, "weight_types": weight_types, "fp8": fp8_straight}
    if mode != "single":
        torch.save(fp8_straight, os.path.join(out_dir, f"fabric_{mode}_fp8_rank{fabric.global_rank}.pt"))
        saving, model, optimizer, plugin, _ = run(STEPS // 2)
        ckpt = os.path.join(out_dir, "fabric.ckpt")
        saving.save(ckpt, {"model": model, "optimizer": optimizer, "fp8": plugin})
        _, resumed, _, _, _ = run(STEPS // 2, start=STEPS // 2, state=ckpt)
        result["resumed"] = full_state(resumed)
        result["fp8_resumed"] = lf.fp8_state_dict(resumed)
    if fabric.global_rank == 0:
        torch.save(result, os.path.join(out_dir, f"fabric_{mode}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
