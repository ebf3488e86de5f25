"""Run by tests/test_fsdp2.py (through tests/scripts/gloo_checks.py, on 2 processes): an FP8 MLP (column-wise then
row-wise Linear, torch's ColwiseParallel / RowwiseParallel) against the same unsharded FP8 MLP, for each recipe; two
training steps, a token of outliers in the input and large features in one rank's share of the hidden layer. Rank 0 writes, per recipe: whether the weight gradients are
bit-identical, the SQNR of the output and of the input gradient against the unsharded model, and whether the weight
scales agree; and whether a compiled tensor-parallel MLP matches its eager twin bit for bit (OUT_DIR/tp_compiled.pt).

Usage: ``python -m torch.distributed.run --nproc-per-node 2 tp_layers.py OUT_DIR RECIPES`` (RECIPES comma-separated),
or ``main(OUT_DIR, RECIPES)`` on the 2-process group of tests/scripts/gloo_checks.py. Rank 0 writes OUT_DIR/tp_layers.pt.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_fp8 as lf
from lightning_fp8.recipe import WEIGHT


def sqnr(a, b):
    return (10 * torch.log10(b.double().pow(2).mean() / (a.double() - b.double()).pow(2).mean())).item()


def main(out_dir, recipes):
    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for recipe in recipes.split(","):
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
        with torch.no_grad():  # large features in rank 0's share only: row amaxes that differ between the pieces
            ref[0].weight[:8] *= 20
            ref[2].weight[:, :8] *= 20
        tp = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
        tp.load_state_dict(ref.state_dict())
        lf.convert_to_fp8(ref, recipe=recipe, log_summary=False)
        lf.convert_to_fp8(tp, recipe=recipe, log_summary=False)
        parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        torch.manual_seed(1)
        x = torch.randn(4, 32, 128)
        x[0, 3] *= 50  # a token of outliers: scales that differ between the pieces if they were not agreed
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        for step in range(2):  # the second step uses the delayed histories
            with torch.autocast("cpu", dtype=torch.bfloat16), lf.fp8_autocast():
                y_ref, y_tp = ref(x_ref), tp(x_tp)
            grad = torch.randn(y_ref.shape)
            y_ref.float().backward(grad)
            y_tp.float().backward(grad)
            lf.roll_amax_history(ref)
            lf.roll_amax_history(tp)
        result = {"output_sqnr": sqnr(y_tp.float(), y_ref.float()), "grad_input_sqnr": sqnr(x_tp.grad, x_ref.grad)}
        for name in ("0", "2"):
            ours, theirs = tp.get_submodule(name), ref.get_submodule(name)
            result[f"grad_weight_equal_{name}"] = torch.equal(ours.weight.grad.full_tensor(), theirs.weight.grad)
            result[f"weight_scale_equal_{name}"] = torch.equal(ours.fp8_scale[WEIGHT], theirs.fp8_scale[WEIGHT])
        results[recipe] = result
    compiled = compiled_matches_eager(mesh)
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "tp_layers.pt"))
        torch.save(compiled, os.path.join(out_dir, "tp_compiled.pt"))


def compiled_matches_eager(mesh):
    """The same tensor-parallel MLP (``tensorwise``) compiled by inductor against eager, two steps, in two setups:
    float32 with biases of the output's size under bf16 autocast, and a bf16 model without biases (Llama-style).
    Whether the outputs, the input gradients and each parameter's gradient are bit-identical (compiled, the row-wise
    layer's bias is rounded on its local tensor; the partial sums reduced across the ranks, the row-wise output and
    the column-wise input gradient, get buffers of their own: an in-place collective on the rounded GEMM output's
    16-bit view failed inductor's lowering)."""
    equal = {}
    for setup, bias, dtype in (("autocast", True, torch.float32), ("bf16", False, torch.bfloat16)):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(128, 256, bias=bias), nn.Linear(256, 128, bias=bias))
        if bias:
            with torch.no_grad():
                for layer in base:
                    layer.bias.mul_(10)
        lf.convert_to_fp8(base, recipe="tensorwise", log_summary=False)
        base = base.to(dtype)
        eager, twin = copy.deepcopy(base), copy.deepcopy(base)
        for model in (eager, twin):
            parallelize_module(model, mesh, {"0": lf.FP8ColwiseParallel(), "1": lf.FP8RowwiseParallel()})
        compiled = torch.compile(twin, fullgraph=True)
        for step in range(2):
            torch.manual_seed(2 + step)
            x = (torch.randn(7, 128) * (1 + 3 * step)).to(dtype)
            runs = []
            for model in (eager, compiled):
                xx = x.clone().requires_grad_()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup == "autocast"), lf.fp8_autocast():
                    y = model(xx)  # the row-wise style's replicated output, as a local tensor
                y.float().square().sum().backward()
                runs.append((y.detach() + 0, xx.grad, [p.grad.full_tensor() for p in model.parameters()]))
            (y1, dx1, g1), (y2, dx2, g2) = runs
            equal[f"{setup}_output_{step}"] = torch.equal(y1, y2)
            equal[f"{setup}_grad_input_{step}"] = torch.equal(dx1, dx2)
            for (name, _), a, b in zip(eager.named_parameters(), g1, g2):
                equal[f"{setup}_grad_{name}_{step}"] = torch.equal(a, b)
            eager.zero_grad()
            twin.zero_grad()
    return equal

if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(*sys.argv[1:])
    dist.destroy_process_group()
