"""Run by tests/test_fsdp2.py (through tests/scripts/gloo_checks.py, on 2 processes): FSDP2 blocks compiled by inductor
(each block on its own, ``fullgraph=True``: torchtitan's way) against the same sharded blocks eager, for each recipe.
Two Llama-like residual blocks of FP8 layers that feed each other, bf16 parameters (``MixedPrecisionPolicy``), the FP8
all-gather where the recipe gathers in FP8, two micro-batches per optimizer step (gradient sync on the last), three
steps, through the Fabric plugin's forward context and optimizer step.

Rank 0 writes OUT_DIR/fsdp2_compiled.pt: per recipe, whether the outputs, the gradients (gathered) and the FP8 amax
histories are bit-identical to eager's, and whether any graph was compiled after the first step.

Usage: ``main(OUT_DIR, RECIPES)`` (comma-separated) on the 2-process group of tests/scripts/gloo_checks.py.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import lightning_fp8 as lf

STEPS, MICRO = 3, 2


class Block(nn.Module):
    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(self.up(x))


def sharded(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    plugin = lf.fabric.FP8Precision(recipe=recipe)
    lf.prepare_for_sharding(model, plugin)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    plugin.convert_module(model)
    return model, plugin


def train(model, plugin, compiled_after_warmup=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())
    seen = []
    for step in range(STEPS):
        with torch._dynamo.config.patch(error_on_recompile=compiled_after_warmup is not None and step > 0):
            for micro in range(MICRO):
                model.set_requires_gradient_sync(micro == MICRO - 1)
                with plugin.forward_context():
                    out = model(torch.randn(16, 128) * (1 + 4 * micro))
                out.float().square().mean().backward()
                seen.append(out.detach().float())
        seen.extend(p.grad.full_tensor().float() for p in model.parameters())
        plugin.optimizer_step(optimizer)
        optimizer.zero_grad()
    seen.extend(t["amax_history"] for t in lf.fp8_state_dict(model)["tables"])
    return seen


def main(out_dir, recipes):
    results = {}
    for recipe in recipes.split(","):
        eager = train(*sharded(recipe))
        model, plugin = sharded(recipe)
        for index in range(len(model)):
            model[index] = torch.compile(model[index], fullgraph=True)
        try:
            compiled = train(model, plugin, compiled_after_warmup=True)
            recompiled = False
        except torch._dynamo.exc.RecompileError:
            compiled, recompiled = [], True
        results[recipe] = {
            "recompiled": recompiled,
            "equal": len(eager) == len(compiled) and all(torch.equal(a, b) for a, b in zip(eager, compiled)),
            "compared": len(eager),
        }
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "fsdp2_compiled.pt"))
