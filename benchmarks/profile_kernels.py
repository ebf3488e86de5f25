#!/usr/bin/env python
"""Where a compiled training step's device time goes, kernel by kernel: ours against torchao on one Llama block.

Usage::

    python benchmarks/profile_kernels.py                       # Llama3-8B-shaped block on a GPU (or the CPU)
    python benchmarks/profile_kernels.py --size tiny --kinds bf16,ours-tensorwise

``bench_llama.py`` says how fast each variant's step is; this says why. One decoder block of ``--size``
(``bench_llama.SIZES``, one block instead of the size's stack, same tokens per step), each of ``--kinds`` built and
compiled as ``bench_llama`` builds them (one copy of the weights, the same batch), warmed up, then ``--steps`` steps
under ``torch.profiler``. Each kernel's device time per step is summed by name and by class:

* ``gemm``: matrix products (cuBLAS / CUTLASS / nvjet kernels and cuBLAS's split-K reductions, ``scaled_mm``, ``mm``);
* ``attention``: the fused attention kernels (flash / cudnn / efficient attention);
* ``fused``: inductor's generated Triton kernels (casts, scales, amax reductions, norms, activations) and our own
  eager Triton casts;
* ``optimizer``: the fused AdamW kernel;
* ``other``: everything else (copies, fills, separate reductions).

An ablation, to price the statistics: ``<kind>:nostats`` (e.g. ``ours-tensorwise:nostats``), compiled only, runs
our variant with the nonzero / overflow / underflow counters (``quantize.cast_statistics`` and the two ways a compiled
cast counts without it: from the stored FP8 data, from the float32 values of a block cast) and ``quantize.amax_bins``
(the histograms of slice and block amaxes) replaced by zeros, so that inductor drops them from the cast kernels.
What stays: the amaxes the scales need and the table records. Not a product setting: the stats callback would read
zeros. (Eager on CUDA the casts run our Triton kernel, which computes the counters inside; the ablation cannot
remove them there, so ``--eager`` on CUDA refuses it.)

``<kind>:uncounted`` (ours) is the product's own way to skip the counting: a training step inside
``fp8_autocast(count_statistics=False)``, what the plugins' ``statistics_every_n_steps`` runs on the steps between two
counting steps. The casts record their amaxes and scales but no counts, numel or histograms (no records of them
either, where the ablation records zeros). With ``statistics_every_n_steps=n`` a step costs on average
``(counted + (n - 1) * uncounted) / n``.

On a CPU the times are self CPU times: of the aten ops and, compiled, of inductor's C++ kernels
(``graph_<n>_cpp_fused_...``, class ``fused``), which the profiler sees because this script compiles them with
inductor's ``cpp.enable_kernel_profile`` (a record function per kernel call; without it a compiled CPU profile
missed the fused kernels, about half of a ``tiny`` block's step).

Output: a markdown table per variant (the classes, then the ``--top`` kernels by time) on stdout, and JSON
(``--json``: every kernel's time too). Its numbers are device time summed over kernels, not wall time: overlaps and
launch gaps are not in it (``bench_llama.py`` measures the wall time).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
from collections import defaultdict
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_llama as bl  # noqa: E402
import harness  # noqa: E402

#: (class, pattern on the kernel name), tried in order: inductor names a Triton kernel after every op fused into it,
#: so ``triton_..._scaled_mm_...`` is a cast feeding a GEMM (``fused``), not a GEMM
CLASSES = (
    # inductor's Triton kernels, its C++ kernels on a CPU (``graph_<n>_cpp_fused_...``), our eager Triton casts
    ("fused", re.compile(r"^triton_|^(graph_\d+_)?cpp_fused|_cast_with_statistics_kernel|_block_cast_kernel", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|cudnn.*sdpa|sdpa", re.I)),
    ("optimizer", re.compile(r"adam", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|splitKreduce|scaled_mm|sm90_xmma|ampere_|\bmm\b|matmul|addmm|bmm", re.I)),
)


#: what counts as a kernel on a CPU: aten ops and inductor's C++ kernels (seen with ``cpp.enable_kernel_profile``)
CPU_KERNEL = re.compile(r"aten::|(graph_\d+_)?cpp_fused")


@contextlib.contextmanager
def statistics_off() -> Any:
    """The ``:nostats`` ablation: casts report zero counts and empty amax histograms, computed from nothing. Every
    path a compiled cast counts on: ``cast_statistics``, and the two it takes without it (the stored FP8 data of a
    cast scaled by its own amaxes or a history, the float32 values of a block cast)."""
    from unittest import mock

    import lightning_fp8.quantize as quantize

    def no_counts(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(3, dtype=torch.int64, device=x.device)

    def no_bins(amax: torch.Tensor) -> torch.Tensor:
        return torch.zeros(quantize.N_AMAX_BINS, dtype=torch.int64, device=amax.device)

    counters = ("cast_statistics", "_cast_statistics_from_stored", "_cast_statistics_from_values")
    with contextlib.ExitStack() as stack:
        for name in counters:
            stack.enter_context(mock.patch.object(quantize, name, no_counts))
        stack.enter_context(mock.patch.object(quantize, "amax_bins", no_bins))
        yield


def kernel_class(name: str) -> str:
    """The class of a kernel by its name (first matching pattern of ``CLASSES``, else ``other``)."""
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "other"


def profile_kernels(step: Any, device: str, steps: int) -> dict[str, float]:
    """Device (or, on a CPU, self CPU) microseconds per step of each kernel name over ``steps`` profiled steps."""
    cuda = torch.device(device).type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    times: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if cuda and event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation:
            times[event.name] += event.device_time_total / steps
        elif not cuda and event.device_type == torch.autograd.DeviceType.CPU and CPU_KERNEL.match(event.name):
            times[event.name] += event.self_cpu_time_total / steps
    return dict(times)


def summarize(times: dict[str, float], top: int) -> dict[str, Any]:
    """Per-class totals and the ``top`` kernels of one variant's profile."""
    label = {name: kernel_class(name) for name in times}
    classes: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for name, us in times.items():
        classes[label[name]] += us
        counts[label[name]] += 1
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return {"total_us": sum(times.values()), "classes_us": dict(classes), "kernel_names": dict(counts),
            "top": [{"name": n, "class": label[n], "us": us} for n, us in ranked], "kernels_us": dict(times)}


def render(results: dict[str, dict[str, Any]], baseline: str | None) -> str:
    """Markdown: one table of classes across variants, then each variant's top kernels."""
    labels = [c for c, _ in CLASSES] + ["other"]
    rows = []
    base = results.get(baseline, {}).get("total_us") if baseline else None
    for kind, r in results.items():
        rows.append([kind, f"{r['total_us'] / 1e3:.2f}", harness.ratio(r["total_us"], base) if base else ""]
                    + [f"{r['classes_us'].get(c, 0.0) / 1e3:.2f}" for c in labels])
    text = [harness.markdown_table(["variant", "device ms / step", f"× {baseline}" if baseline else "", *labels], rows)]
    for kind, r in results.items():
        text.append(f"\n**{kind}**, top kernels (ms per step):\n")
        text.append(harness.markdown_table(["kernel", "class", "ms"], [
            [t["name"][:110].replace("|", "\\|"), t["class"], f"{t['us'] / 1e3:.3f}"] for t in r["top"]]))
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", default="llama3-8b", choices=list(bl.SIZES), help="block shape (default llama3-8b)")
    parser.add_argument("--kinds", default="bf16,torchao-tensorwise,ours-tensorwise,torchao-rowwise,ours-rowwise",
                        help="comma-separated variants of bench_llama.KINDS")
    parser.add_argument("--eager", action="store_true", help="profile the eager variants instead of compiled ones")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps, compilation included (default 3)")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per variant (default 12)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default="", help="result file (default: none)")
    args = parser.parse_args(argv)

    kinds = args.kinds.split(",")
    for kind in kinds:
        name, _, ablation = kind.partition(":")
        if name not in bl.KINDS:
            parser.error(f"{kind}: unknown variant; choose from {list(bl.KINDS)}")
        if ablation not in ("", "nostats", "uncounted") or (ablation and not name.startswith("ours-")):
            parser.error(f"{kind}: the only variations are ours-<recipe>:nostats and ours-<recipe>:uncounted")
        if ablation == "nostats" and args.eager and torch.device(args.device).type == "cuda":
            parser.error(f"{kind}: eager on CUDA our Triton cast computes the counters itself; profile it compiled")
    size = dataclasses.replace(bl.SIZES[args.size], blocks=1)
    base = bl.make_stack(size, args.device)
    optimizer = torch.optim.AdamW(list(base.parameters()), lr=1e-5, weight_decay=0.0, fused=True)
    x = torch.randn(size.batch, size.seq, size.hidden, device=args.device)
    backend = None if args.eager else "inductor"
    # Compiled on a CPU, each C++ kernel opens a profiler record function (one call per kernel launch: a few
    # microseconds a step); without it the CPU profile sees only the aten ops that inductor's code calls, not the
    # fused kernels. Only while this profiles (an option of inductor's code, which its caches key on).
    kernel_profile = backend is not None and torch.device(args.device).type == "cpu"
    env = harness.environment(args.device)
    mode = "eager" if args.eager else "compiled (inductor)"
    command = " ".join(["python benchmarks/profile_kernels.py", *(argv if argv is not None else sys.argv[1:])])
    results: dict[str, dict[str, Any]] = {}
    stopped = ""
    with harness.stop_on_signals(), (  # under `timeout`: the variants profiled so far are still written and printed
        torch._inductor.config.patch({"cpp.enable_kernel_profile": True}) if kernel_profile else contextlib.nullcontext()
    ):
        try:
            for kind in kinds:
                name, _, ablation = kind.partition(":")
                torch._dynamo.reset()
                with statistics_off() if ablation == "nostats" else contextlib.nullcontext():
                    variant = bl.build_variant(kind if ablation == "uncounted" else name, base, args.device, backend)
                    step = bl.make_step(variant, x, optimizer)
                    for _ in range(args.warmup):
                        step()
                    results[kind] = summarize(profile_kernels(step, args.device, args.steps), args.top)
                print(f"{kind}: {results[kind]['total_us'] / 1e3:.2f} ms of kernels per step", file=sys.stderr,
                      flush=True)
                if args.json:  # after every variant: a run cut short keeps what it measured
                    harness.write_result(args.json, env, command, size=dataclasses.asdict(size), mode=mode,
                                         results=results)
        except harness.Stopped as stop:
            stopped = f"stopped by {stop} while profiling {kind}; not profiled: {', '.join(kinds[kinds.index(kind):])}"
            print(stopped, file=sys.stderr, flush=True)
        print(f"*{env['device'] if 'device' in env else args.device}; torch {env['torch']}; one {args.size} block, "
              f"{size.tokens} tokens, {mode}.*\n" + (f"\n**Incomplete: {stopped}.**\n" if stopped else ""))
        print(render(results, "bf16" if "bf16" in results else None))
    return 1 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
