#!/usr/bin/env python
"""The workload of the instruction-count comparison in ``RESULTS_core.md`` (run under valgrind, not timed).

A stack of 24 small FP8 layers (64 x 64, 16 tokens: the per-layer work of the FP8 core dominates the GEMMs)
runs ``ITERS`` steps after 3 warm-up steps::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null "$(python -c 'import sys; print(sys.executable)')" \\
        benchmarks/layer_overhead_workload.py delayed fwd 10        # and again with 0, then subtract

``(instructions with ITERS=10 - instructions with ITERS=0) / (10 * 24)`` is the cost of one layer-forward in
instructions: repeatable on a shared machine, where wall times of such small steps are not. ``PYTHONPATH`` picks
the tree to measure (the same script measures lightning-fp8 0.1 and the current core).

Arguments: ``RECIPE`` (tensorwise, delayed, rowwise, or plain for ``nn.Linear``), ``MODE`` (``fwd``: forward in
training mode under no_grad; ``step``: forward, backward and the amax-history roll), ``ITERS``.
"""

import sys

import torch
from torch import nn

import lightning_fp8 as lf

torch.set_num_threads(1)
recipe, mode, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(24)))
if recipe != "plain":
    lf.convert_to_fp8(model, recipe=recipe)
x = torch.randn(16, 64, requires_grad=True)


def run() -> None:
    region = lf.fp8_autocast(defer_amax_history_roll=True) if recipe != "plain" else torch.autocast("cpu", enabled=False)
    if mode == "fwd":
        with torch.no_grad(), region:
            model(x)
        return
    with region:
        y = model(x)
    y.square().mean().backward()
    if recipe != "plain":
        lf.roll_amax_history(model)


for _ in range(3 + iters):
    run()
