"""Run by tests/test_fsdp2.py: Fabric's ``ModelParallelStrategy`` (FSDP2, 2 CPU processes on gloo) writes a
distributed checkpoint folder with ``fabric.save`` and a fresh Fabric resumes from it with ``fabric.load``, the FP8
plugin and an ``FP8Stats`` reader in the state, as docs/quickstart.md shows. ``delayed`` with float16 (dynamic loss
scaling that grows every step): the amax histories, scales and loss scale decide the numbers, so the resume is exact
only if ``fabric.load`` restored the plugin (Lightning 2.6's folder branch hands back the saved dicts instead:
lightning_fp8.fabric patches it).

Four Fabrics, one after the other in the same processes: 8 steps straight; 4 steps and ``fabric.save``; a fresh
model, plugin and reader, ``fabric.load``, 4 more steps; the same with the state in a ``UserDict``. ``main(OUT_DIR)``
from tests/scripts/gloo_checks.py.
"""

import os
import sys
from collections import UserDict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy  # noqa: E402
from fsdp2_fabric import parallelize  # noqa: E402  (prepare_for_sharding, then FSDP2 on the data-parallel mesh)
from models import TinyDecoder, loader  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402

import lightning_fp8 as lf  # noqa: E402
from lightning_fp8.fabric import FP8Precision  # noqa: E402

STEPS = 8


def single_process():
    return False


def main(out_dir):
    data = loader(n=32 * 32 + 1, batch_size=8).dataset
    windows = torch.stack([data[i][0] for i in range(len(data))]), torch.stack([data[i][1] for i in range(len(data))])

    def run(start, steps, load_from=None, save_to=None, mapping=dict):
        plugin = FP8Precision(recipe="delayed", compute_dtype=torch.float16, init_scale=2.0**10, growth_interval=1)
        strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
        fabric.launch()
        torch.manual_seed(0 if load_from is None else 1)  # a resumed run starts from another init: all from the file
        model = fabric.setup_module(TinyDecoder(dim=128, heads=4, layers=2))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
        stats = lf.FP8Stats(plugin)
        state = mapping({"model": model, "optimizer": optimizer, "fp8": plugin, "stats": stats})
        loaded = {}
        if load_from is not None:
            remainder = fabric.load(load_from, state)
            loaded = {key: type(state[key]).__name__ for key in ("fp8", "stats")} | {"remainder": sorted(remainder)}
        for step in range(start, start + steps):
            index = (torch.arange(step * 8, step * 8 + 8) % len(windows[0]))[fabric.global_rank :: fabric.world_size]
            loss = F.cross_entropy(model(windows[0][index]).float().view(-1, 256), windows[1][index].reshape(-1))
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if step % 3 == 2:
                stats.metrics()  # a reading in the middle: the checkpoint at step 4 carries an unread interval
        if save_to is not None:
            fabric.save(save_to, state)
            return None
        stats.metrics()  # the whole-run totals include the last interval
        return {
            "weights": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
            "fp8": lf.fp8_state_dict(model),
            "loss_scale": float(plugin.loss_scale),
            "totals": {name: [list(row) for row in counts] for name, counts in stats.total_counts.items()},
            "loaded": loaded,
        }

    straight = run(0, STEPS)
    checkpoint = os.path.join(out_dir, "fabric_delayed.ckpt")
    run(0, STEPS // 2, save_to=checkpoint)
    resumed = run(STEPS // 2, STEPS // 2, load_from=checkpoint)
    resumed_from_a_mapping = run(STEPS // 2, STEPS // 2, load_from=checkpoint, mapping=UserDict)  # any mutable mapping
    if dist.get_rank() == 0:
        result = {"straight": straight, "resumed": resumed, "resumed_from_a_mapping": resumed_from_a_mapping}
        torch.save(result, os.path.join(out_dir, "fabric_resume.pt"))
