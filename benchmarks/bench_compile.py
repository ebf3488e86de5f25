#!/usr/bin/env python
"""What compiling costs as the model gets deeper: Llama-style blocks compiled whole or block by block, cold.

Usage::

    python benchmarks/bench_compile.py --threads 1                   # depths 1 and 9, inductor: 20-25 min on 2 cores
    python benchmarks/bench_compile.py --threads 1 --backend aot_eager   # dynamo and AOTAutograd only: the Python side
    python benchmarks/bench_compile.py --threads 1 --depths 2,8,12   # three depths: about 45 min on 2 cores
    python benchmarks/bench_compile.py --depths 2,4 --kinds bf16,ours-tensorwise --scopes blocks

The model is ``bench_llama.py``'s stack of Llama-style decoder blocks (imported, not copied) at one width
(``--size``, default ``test``: compile time hardly depends on the widths) and several depths (``--depths``, default 1
and 9 blocks: 9 is past torch's recompile limit of 8 graphs per code object). On a 2-core CPU a cold inductor compile
of the whole stack costs about half a minute per block for our recipes: three depths such as 2, 8 and 12 take about
45 minutes, the default about 20 to 25. The variants are ``bench_llama.py``'s too, built by its
``build_variant`` and stepped by its ``make_step``: ``bf16`` (bf16 autocast), ``torchao-tensorwise``
(``convert_to_float8_training``, emulated without FP8 tensor cores), ``ours-tensorwise`` and ``ours-delayed``
(``convert_to_fp8``; the forward inside ``fp8_autocast(defer_amax_history_roll=True)``, the amax histories rolled once
after each optimizer step: what the precision plugins do). All under bf16 autocast.

Two compile scopes:

* ``model``: ``torch.compile`` of the whole stack: one frame, every block inlined into one graph;
* ``blocks``: each block compiled on its own and put back in its place in the stack
  (``for i, b in enumerate(stack): stack[i] = torch.compile(b)``, torchtitan's way). The blocks share one code
  object (``DecoderBlock.forward``): identical blocks can share one graph, unless a value that differs per block
  is a constant of the graph (a layer's row in the FP8 state table was one). Then every block compiles a graph of
  its own, and past ``torch._dynamo.config.recompile_limit`` (8) the remaining blocks run eager, with only a warning.

The input batch needs a gradient, as an embedding's output does, so that every block sees the same kind of input
(with one that needs none, the first block would compile a graph of its own: a guard on ``requires_grad``).

Before the first measurement one block is compiled and run once and thrown away: what the first compile of a process
pays once (imports, the compiler's set-up) then counts against none. At depth 1 both scopes compile the same
graph: their ratio shows the noise of a first step.

For each depth the eager variants are timed first, interleaved (``harness.interleaved``): the reference. Then, for
each variant and scope, with ``torch._dynamo.reset()`` before it and a fresh empty inductor cache
(``torch._inductor.utils.fresh_cache``: a new cache directory and torch's in-memory compile caches cleared, so no
measurement compiles from an earlier one's code, not even the same block graph at another depth):

* the first training step's seconds: the compile (and one step); ``torch._dynamo.utils.compile_times()``'s phases
  (``harness.compile_phase_seconds``);
* from torch's records of the first step and the warm-up steps: frames compiled, graphs (``unique_graphs``),
  recompilations (the compiles ``get_compilation_metrics()`` gives a ``recompile_reason``, with the reasons), graph
  breaks, and whether the recompile limit was hit: torch 2.13 then records a failed compile whose ``fail_reason``
  starts with ``Dynamo recompile limit exceeded`` (also a ``counters["unimplemented"]`` entry, and
  ``counters["frames"]["total"]`` one above ``["ok"]``) and, from then on, runs the code object's cached graphs
  only, a call that matches none eagerly;
* the compiled regions one training step runs (``Torch-Compiled Region`` events of ``torch.profiler``): with
  ``blocks`` each block that runs compiled is one, so the blocks that ran eager are the depth minus those (when
  there is no graph break);
* the gradients of one step against the eager variant's (``bench_llama.gradient_check``: a compiled step that
  trains wrongly is not timed);
* the steady-state step: ``--reps`` steps after ``--warmup`` warm-up steps, the median (also the fastest and the
  median process CPU time), and any graph compiled during them.

The raw numbers go to ``benchmarks/results/compile.json`` (with the machine, versions and command); the script
prints the table that ``python benchmarks/docs_tables.py`` renders to ``benchmarks/results/tables/compile_depth.md``.
Speed is reported as ratios within this run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Self

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_llama
import harness
from bench_llama import SIZES, Size, Variant, build_variant, compile_in_scope, make_stack, make_step

logging.getLogger("torchao").setLevel(logging.ERROR)  # torchao warns about its CUDA-only extensions on import

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(HERE, "results", "compile.json")
KINDS = ("bf16", "torchao-tensorwise", "ours-tensorwise", "ours-delayed")
SCOPES = ("model", "blocks")
DEFAULT_DEPTHS = (1, 9)
DEFAULT_SIZE = "test"
#: How torch 2.13 names the failed compile of a frame past the recompile limit.
LIMIT_EXCEEDED = "Dynamo recompile limit exceeded"
#: The ``torch.profiler`` event of one call of a compiled region (``Torch-Compiled Region: <frame>/<compile>``).
COMPILED_REGION = "Torch-Compiled Region"


# ------------------------------------------------------------------------------------------------- the experiment


def stack_size(width: str, depth: int) -> Size:
    """``bench_llama``'s size ``width`` with ``depth`` blocks."""
    return dataclasses.replace(SIZES[width], blocks=depth)


def compile_scope(variant: Variant, scope: str, backend: str) -> Variant:
    """``variant`` compiled as ``scope`` says: the whole stack (``model``), or each block in its place (``blocks``)."""
    variant.module = compile_in_scope(variant.model, scope, backend)
    variant.scope = scope
    variant.key = f"{variant.kind}+{scope}"
    return variant


def training_step(variant: Variant, x: torch.Tensor, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """``bench_llama``'s training step of ``variant`` (a synchronize after it on CUDA); the input's gradient dropped."""
    step = make_step(variant, x, optimizer)
    cuda = torch.device(variant.device).type == "cuda"

    def run() -> None:
        x.grad = None
        step()
        if cuda:
            torch.cuda.synchronize(variant.device)

    return run


def compiled_regions(step: Callable[[], None]) -> int:
    """The compiled regions one call of ``step`` runs (``torch.profiler``'s ``Torch-Compiled Region`` events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name.startswith(COMPILED_REGION))


class DynamoRecord:
    """What torch records about compiling while a block of code runs: ``harness.dynamo_counts``, the compile
    phases, and the per-compile metrics (recompilations and their reasons, compiles that failed at the limit)."""

    def __enter__(self) -> Self:
        from torch._dynamo.utils import clear_compilation_metrics

        clear_compilation_metrics()
        self.counts0, self.phases0 = harness.dynamo_counts(), harness.compile_phase_seconds()
        self.frames0 = self._frames()
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._dynamo.utils import get_compilation_metrics

        counts, phases, frames = harness.dynamo_counts(), harness.compile_phase_seconds(), self._frames()
        self.metrics = list(get_compilation_metrics())
        self.counts = {k: counts[k] - self.counts0[k] for k in counts}
        self.phases = {k: phases[k] - self.phases0[k] for k in phases}
        self.frames_total = frames - self.frames0

    @staticmethod
    def _frames() -> int:
        from torch._dynamo.utils import counters

        return counters["frames"].get("total", 0)

    def summary(self) -> dict[str, Any]:
        recompiles = [m for m in self.metrics if m.recompile_reason and not m.fail_type]
        limit = [m for m in self.metrics if (m.fail_reason or "").startswith(LIMIT_EXCEEDED)]
        return {"frames": self.counts["frames"], "frames_attempted": self.frames_total, "graphs": self.counts["graphs"],
                "graph_breaks": self.counts["graph_breaks"], "recompiles": len(recompiles),
                "recompile_reasons": sorted({first_line(m.recompile_reason) for m in recompiles}),
                "recompile_limit_hit": bool(limit), "limit_failures": len(limit),
                "compile_phases_s": self.phases}


def first_line(text: str, limit: int = 160) -> str:
    """The first line of a reason, the guard it failed, without torch's padding."""
    line = " ".join(text.splitlines()[0].split())
    return line[:limit]


def measure_compiled(variant: Variant, scope: str, eager: Variant, x: torch.Tensor, params: list[torch.nn.Parameter],
                     optimizer: torch.optim.Optimizer, warmup: int, reps: int) -> dict[str, Any]:
    """One compiled variant, cold: the first step, what dynamo compiled, the compiled regions per step, the gradient
    check against ``eager`` and the steady-state step time."""
    depth = len(variant.model)
    step = training_step(variant, x, optimizer)
    with DynamoRecord() as compiling:
        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        for _ in range(warmup):
            step()
    out: dict[str, Any] = {"status": "measured", "first_step_s": first, **compiling.summary()}
    with DynamoRecord() as after:
        out["gradient_check"] = check = bench_llama.gradient_check(variant, eager, x, params, optimizer)
        regions = compiled_regions(step)
        if check["zero_gradients"] or not check["relative_difference"] <= bench_llama.GRADIENT_TOLERANCE:
            out["status"] = (f"invalid: gradients {check['relative_difference']:.2g} off eager's, "
                             f"{check['zero_gradients']} of {check['parameters']} zero: not timed")
        else:
            timing = harness.interleaved({variant.key: step}, rounds=reps, calls=1, warmup=0)[variant.key]
            out.update(median_s=timing.median, fastest_s=timing.fastest, cpu_s=timing.cpu, times=timing.walls)
    out["compiled_regions_per_step"] = regions
    out["recompiles_after_warmup"] = after.counts["graphs"]
    if out["graph_breaks"]:
        out["blocks_run_eager"] = None  # a region per block no longer holds
    elif scope == "blocks":
        out["blocks_run_eager"] = max(0, depth - regions)
    else:
        out["blocks_run_eager"] = depth if regions == 0 else 0
    return out


def measure_depth(width: str, depth: int, kinds: tuple[str, ...], scopes: tuple[str, ...], backend: str, device: str,
                  warmup: int, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every variant at one depth: eager (interleaved), then each compiled scope, cold."""
    from torch._inductor.utils import fresh_cache

    size = stack_size(width, depth)
    base = make_stack(size, device)
    params = list(base.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
    x = torch.randn(size.batch, size.seq, size.hidden, device=device, requires_grad=True)
    variants: dict[str, dict[str, Any]] = {kind: {"name": bench_llama.variant_name(kind)} for kind in kinds}
    eager = {kind: build_variant(kind, base, device, None) for kind in kinds}
    log(f"depth {depth}: eager, {reps} interleaved rounds")
    timing = harness.interleaved({kind: training_step(v, x, optimizer) for kind, v in eager.items()}, rounds=reps,
                                 calls=1, warmup=warmup)
    for kind, t in timing.items():
        variants[kind]["eager"] = {"status": "measured", "median_s": t.median, "fastest_s": t.fastest, "cpu_s": t.cpu,
                                   "times": t.walls}
    for kind in kinds:
        for scope in scopes:
            log(f"depth {depth}: {kind}, compiled: {scope}")
            torch._dynamo.reset()
            try:
                with fresh_cache():
                    variant = compile_scope(build_variant(kind, base, device, None), scope, backend)
                    result = measure_compiled(variant, scope, eager[kind], x, params, optimizer, warmup, reps)
            except Exception as err:  # noqa: BLE001 - report it, do not abort the run
                result = {"status": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            variants[kind][scope] = result
            log(f"depth {depth}: {kind}, {scope}: " + (
                f"first step {result['first_step_s']:.1f} s, {result['graphs']} graphs, {result['recompiles']} "
                f"recompilations, limit hit: {result['recompile_limit_hit']}, {result['compiled_regions_per_step']} "
                f"compiled regions per step" if "first_step_s" in result else result["status"]))
    torch._dynamo.reset()
    return {"size": {**dataclasses.asdict(size), "tokens": size.tokens, "linear_params": size.linear_params},
            "variants": variants}


def warm_up_compiler(width: str, backend: str, device: str) -> float:
    """Compile and run one block once (bf16), in a throwaway cache: what the first compile of a process pays once
    (imports, the compiler's set-up) then counts against no measurement. Returns its seconds."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    t0 = time.perf_counter()
    with fresh_cache():
        variant = compile_scope(build_variant("bf16", make_stack(stack_size(width, 1), device), device, None),
                                "model", backend)
        x = torch.randn(1, SIZES[width].seq, SIZES[width].hidden, device=device, requires_grad=True)
        bench_llama.forward_backward(variant, x)
    torch._dynamo.reset()
    return time.perf_counter() - t0


def run(depths: tuple[int, ...] = DEFAULT_DEPTHS, kinds: tuple[str, ...] = KINDS, scopes: tuple[str, ...] = SCOPES,
        backend: str = "inductor", width: str = DEFAULT_SIZE, device: str = "cpu", warmup: int = 2, reps: int = 5,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every depth; the result file's numbers (without environment and command)."""
    missing = bench_llama.torchao_available()
    if missing:
        kinds = tuple(k for k in kinds if not k.startswith("torchao-"))
    config = torch._dynamo.config
    out: dict[str, Any] = {
        "device": device,
        "fp8_hardware": bench_llama.fp8_hardware(device),
        "config": {"size": width, "depths": list(depths), "kinds": list(kinds), "scopes": list(scopes),
                   "backend": backend, "warmup": warmup, "reps": reps, "threads": torch.get_num_threads(),
                   "recompile_limit": config.recompile_limit,
                   "accumulated_recompile_limit": config.accumulated_recompile_limit,
                   "cache": "cold: torch._inductor.utils.fresh_cache() around each compiled measurement",
                   "optimizer": "AdamW(lr=1e-5, weight_decay=0, fused=True), one over the shared parameters",
                   "autocast": "bfloat16"},
        "torchao": missing or "measured",
    }
    log(f"warming the compiler up ({backend})")
    out["compiler_warmup_s"] = warm_up_compiler(width, backend, device)
    out["depths"] = {str(d): measure_depth(width, d, kinds, scopes, backend, device, warmup, reps, log)
                     for d in depths}
    out["load_average_end"] = harness.load_average()
    return out


# ------------------------------------------------------------------------------------------------- main


def command_line(args: argparse.Namespace) -> str:
    """The command, for the result file: the flags that were given."""
    parts = ["python benchmarks/bench_compile.py"]
    for flag, value, default in (("--size", args.size, DEFAULT_SIZE),
                                 ("--depths", args.depths, ",".join(map(str, DEFAULT_DEPTHS))),
                                 ("--kinds", args.kinds, ",".join(KINDS)), ("--scopes", args.scopes, ",".join(SCOPES)),
                                 ("--backend", args.backend, "inductor"), ("--warmup", args.warmup, 2),
                                 ("--reps", args.reps, 5), ("--threads", args.threads, 0)):
        if value != default:
            parts += [flag, str(value)]
    return " ".join(parts)


def _names(text: str, choices: tuple[str, ...], parser: argparse.ArgumentParser, flag: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    bad = [n for n in names if n not in choices]
    if bad:
        parser.error(f"{flag}: unknown {bad}; choose from {list(choices)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--depths", default=",".join(map(str, DEFAULT_DEPTHS)),
                        help="comma-separated numbers of blocks (default %(default)s; torch's recompile limit is 8)")
    parser.add_argument("--size", default=DEFAULT_SIZE, choices=list(SIZES),
                        help="bench_llama.py's size for the widths and the batch (its blocks are replaced by each "
                             "depth; default %(default)s)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated variants (default %(default)s)")
    parser.add_argument("--scopes", default=",".join(SCOPES), help="comma-separated compile scopes (default %(default)s)")
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile backend (default inductor; aot_eager: dynamo and AOTAutograd only)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps after the first (default 2)")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per variant and scope (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device (default: cuda if available, else cpu)")
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"result file (default {os.path.relpath(DEFAULT_JSON)})")
    args = parser.parse_args(argv)

    try:
        depths = tuple(int(d) for d in args.depths.split(","))
    except ValueError:
        parser.error(f"--depths: not a list of integers: {args.depths!r}")
    if any(d < 1 for d in depths):
        parser.error("--depths: at least one block")
    kinds = _names(args.kinds, bench_llama.KINDS, parser, "--kinds")
    scopes = _names(args.scopes, SCOPES, parser, "--scopes")
    if args.threads:
        torch.set_num_threads(args.threads)
    env = harness.environment(args.device)
    t_start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f} s] {message}", file=sys.stderr, flush=True)

    data = run(depths, kinds, scopes, args.backend, args.size, args.device, args.warmup, args.reps, log)
    data["total_s"] = time.perf_counter() - t_start
    harness.write_result(args.json, env, command_line(args), **data)
    with open(args.json) as f:
        data = json.load(f)
    import docs_tables

    print(docs_tables.compile_depth(data))
    print(f"\nwritten to {args.json} in {data['total_s']:.0f} s; render the docs tables with "
          "python benchmarks/docs_tables.py", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
