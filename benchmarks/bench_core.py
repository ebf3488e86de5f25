#!/usr/bin/env python
"""The cost of the FP8 core per step: bookkeeping operations against depth, and per-layer overhead.

Uses only the public API that lightning-fp8 0.1 and the core v2 share, so the same script measures both
trees: run it once per tree (``PYTHONPATH`` picks the tree), then compare::

    PYTHONPATH=/path/to/old/tree python benchmarks/bench_core.py --json /tmp/before.json
    python benchmarks/bench_core.py --json /tmp/after.json
    python benchmarks/bench_core.py --compare /tmp/before.json /tmp/after.json --out benchmarks/RESULTS_core.md

Experiments:

1. **Bookkeeping operations per optimizer step** (the plugin's ``after_optimizer_step``: reduction and
   amax-history roll) for models of 8 and 96 FP8 layers, counted under a ``TorchDispatchMode``: on a GPU
   each is a kernel launch.
2. **Time per step of a stack of FP8 layers against the same stack of ``nn.Linear``** (float32, no
   autocast, so the GEMMs run the same float32 products in both trees and the difference is the FP8 work:
   casts, statistics, state updates, bookkeeping), forward only and forward + backward + bookkeeping,
   interleaved. The per-layer overhead is ``(FP8 step - plain step) / layers``, in process CPU time. On
   CPU the emulated FP8 GEMM itself (float32 copies of the FP8 operands, the scaling) is part of it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import lightning_fp8 as lf  # noqa: E402
from lightning_fp8.fabric import FP8Precision  # noqa: E402

RECIPES = ("tensorwise", "delayed", "rowwise")


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def stack(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def plugin_for(model: nn.Module, recipe: str) -> FP8Precision:
    plugin = FP8Precision(recipe=recipe)
    plugin.convert_module(model)
    return plugin


def bookkeeping_ops(layers: int, recipe: str) -> int:
    """Dispatched tensor operations of one optimizer step's FP8 bookkeeping."""
    torch.manual_seed(0)
    model = stack(layers, 32)
    plugin = plugin_for(model, recipe)
    with plugin.forward_context():
        y = model(torch.randn(4, 32))
    y.float().square().mean().backward()
    with OpCounter() as counter:
        plugin.after_optimizer_step()
    return sum(counter.ops.values())


def step_times(layers: int, width: int, tokens: int, rounds: int) -> dict[str, dict]:
    """Forward and training-step time of FP8 stacks against the plain stack, interleaved."""
    torch.manual_seed(0)
    base = stack(layers, width)
    x = torch.randn(tokens, width)
    models = {"plain": base, **{recipe: copy.deepcopy(base) for recipe in RECIPES}}
    for recipe in RECIPES:
        lf.convert_to_fp8(models[recipe], recipe=recipe)
    # the plugin's region without its bf16 autocast: both trees then run float32 products (0.1 emulated bf16
    # autocast GEMMs with bf16 products, ~150x slower than float32 on CPUs without bf16 matrix units)
    region = {"plain": lambda: torch.autocast("cpu", enabled=False)}
    region.update({recipe: lambda: lf.fp8_autocast(defer_amax_history_roll=True) for recipe in RECIPES})

    def forward(name):
        def run():
            with torch.no_grad(), region[name]():
                return models[name](x)
        return run

    def train_step(name):
        model = models[name]

        def run():
            model.zero_grad(set_to_none=True)
            with region[name]():
                y = model(x)
            y.square().mean().backward()
            if name != "plain":
                lf.roll_amax_history(model)  # the plugin's per-step bookkeeping on one process
        return run

    # forward under no_grad but in training mode: the casts still record statistics, as in training
    fwd = harness.interleaved({name: forward(name) for name in models}, rounds=rounds)
    step = harness.interleaved({name: train_step(name) for name in models}, rounds=rounds)
    return {"forward": fwd, "step": step}


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    ops = {recipe: {str(n): bookkeeping_ops(n, recipe) for n in (8, 96)} for recipe in RECIPES}
    times = step_times(args.layers, args.width, args.tokens, args.rounds)
    return {
        "environment": harness.environment(),
        "config": {"layers": args.layers, "width": args.width, "tokens": args.tokens, "threads": args.threads},
        "bookkeeping_ops": ops,
        "times": {kind: {name: t.__dict__ for name, t in timings.items()} for kind, timings in times.items()},
    }


def sections(results: dict[str, dict]) -> list[str]:
    """Markdown sections for one or more labelled results (e.g. before and after)."""
    labels = list(results)
    rows = []
    for recipe in RECIPES:
        row = [recipe]
        for label in labels:
            ops = results[label]["bookkeeping_ops"][recipe]
            row.append(f"{ops['8']} / {ops['96']}")
        rows.append(row)
    out = [
        "## Bookkeeping operations per optimizer step (8 layers / 96 layers)\n\n"
        + harness.markdown_table(["recipe", *labels], rows)
    ]
    config = results[labels[0]]["config"]
    for kind, title in (("forward", "Forward (training mode)"), ("step", "Forward + backward + bookkeeping")):
        rows = []
        for recipe in RECIPES:
            row = [recipe]
            for label in labels:
                times = results[label]["times"][kind]
                plain, fp8 = times["plain"], times[recipe]
                per_layer_us = (fp8["cpu"] - plain["cpu"]) / config["layers"] * 1e6
                row.append(f"{harness.ratio(fp8['median'], plain['median'])} wall, "
                           f"{harness.ratio(fp8['cpu'], plain['cpu'])} CPU, +{per_layer_us:.0f} µs/layer")
            rows.append(row)
        out.append(
            f"## {title}: FP8 against nn.Linear, {config['layers']} layers of {config['width']}x{config['width']}, "
            f"{config['tokens']} tokens, float32\n\n" + harness.markdown_table(["recipe", *labels], rows)
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the raw numbers here")
    parser.add_argument("--out", help="write the Markdown report here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="render two --json results side by side")
    args = parser.parse_args(argv)
    if args.compare:
        results = {}
        for label, path in zip(("before", "after"), args.compare):
            with open(path) as f:
                results[label] = json.load(f)
        env = {f"{label}: {key}": value for label, r in results.items() for key, value in r["environment"].items()
               if key in ("lightning_fp8", "date", "load average at start")}
        env.update({k: v for k, v in results["after"]["environment"].items() if k not in ("lightning_fp8", "date", "load average at start")})
        harness.write_report("FP8 core: before and after", env, sections(results), results, args.out, None)
        return
    result = run(args)
    harness.write_report("FP8 core cost per step", result["environment"], sections({"this tree": result}),
                         result, args.out, args.json)


if __name__ == "__main__":
    main()
