#!/usr/bin/env python
"""What compiled FP8 graphs keep for backward on a GPU's GEMM path, measured on a CPU.

Usage::

    python benchmarks/compiled_saved.py                        # one tiny Llama-style block, 128 tokens: ~3 min
    python benchmarks/compiled_saved.py --size small --blocks 2 --batch 2

Compiled, what a forward keeps for backward is the choice of AOTAutograd's partitioner (inductor's: its joint-graph
passes, then the min-cut partitioner), and the choice depends on the graph: the FP8 casts, their statistics and the
state-table records add nodes to it, and the partitioner will not recompute a chain of elementwise ops that spans more
than a hundred forward graph nodes (``torch._functorch.config.ban_recompute_long_fusible_chains``). ``bench_llama.py``
measures the compiled bytes on this CPU's emulated GEMM path, whose graphs are not a GPU's (the emulation adds nodes
around each GEMM); this script forces the GPU's path instead: ``torch._scaled_mm`` for ours
(``lightning_fp8.gemm.gemm_path`` answers "native") and torchao's ``emulate=False``, both of which run on a CPU
(slowly: what is measured here is bytes, never time). Each graph is partitioned as inductor partitions it, without
inductor's code generation (:func:`harness.inductor_partitioned_backend`).

The model and variants are ``bench_llama.py``'s (imported, not copied): a stack of Llama-style decoder blocks
(``--size``, ``--blocks``, ``--batch``) and bf16 autocast, torchao tensorwise and rowwise
(``convert_to_float8_training``), ours ``tensorwise``, ``rowwise`` and ``delayed`` (the block recipes' GPU GEMM,
``torch.nn.functional.scaled_mm`` with block scales, does not run on a CPU). Per variant: ``torch._dynamo.reset()``,
one compiled forward and backward (the compile), then one forward whose saved tensors are counted
(``harness.saved_tensors``: each storage once, parameters not counted) and its backward.

``--config NAME=VALUE`` sets a flag of ``torch._functorch.config`` for the run (the partitioner's heuristics, such as
``ban_recompute_used_far_apart``), to see what one of them costs.

Reported: the bytes saved in all, against compiled bf16's and torchao's same recipe (tensorwise for ``delayed``),
and the FP8 tensors kept, by shape. Not measured: peak memory, time (the GEMMs run on the CPU), anything inductor's
code generation or a GPU's device-specific passes would change.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._functorch.config as functorch_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_llama  # noqa: E402
import docs_tables  # noqa: E402
import harness  # noqa: E402

from lightning_fp8 import gemm, quantize, recipe  # noqa: E402

KINDS = ("bf16", "torchao-tensorwise", "torchao-rowwise", "ours-tensorwise", "ours-rowwise", "ours-delayed")
DEFAULT_JSON = os.path.join(bench_llama.HERE, "results", "compiled_saved.json")


@contextlib.contextmanager
def gpu_gemm_path() -> Iterator[None]:
    """Ours and torchao's variants take the GPU's GEMM path (``torch._scaled_mm``) on this CPU, and our compiled casts
    the form they take in Triton (``inductor_cpp_backend`` false, in both modules that ask it: the roundings through
    the bits, a partial block's padding inlined)."""
    saved = gemm.gemm_path, bench_llama.fp8_hardware, recipe.inductor_cpp_backend, quantize.inductor_cpp_backend
    gemm.gemm_path = lambda *args, **kwargs: "native"
    bench_llama.fp8_hardware = lambda device: True  # torchao: emulate=False
    recipe.inductor_cpp_backend = quantize.inductor_cpp_backend = lambda device_type: False
    try:
        yield
    finally:
        gemm.gemm_path, bench_llama.fp8_hardware, recipe.inductor_cpp_backend, quantize.inductor_cpp_backend = saved


def measure(kind: str, base: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Compile ``kind`` on ``base``'s parameters, warm it up, and count what one compiled forward saves."""
    variant = bench_llama.build_variant(kind, base, "cpu", None)
    torch._dynamo.reset()
    compiled = torch.compile(variant.model, backend=harness.inductor_partitioned_backend(), fullgraph=True)
    variant = dataclasses.replace(variant, module=compiled, key=f"{kind}+compile", scope="model")
    bench_llama.forward_backward(variant, x)  # the compile
    saved, out = harness.saved_tensors(lambda: variant.forward(x), base.parameters())
    out.float().pow(2).mean().backward()
    fp8 = Counter(f"{t.dtype} {tuple(t.shape)}" for t in saved if t.dtype.startswith("float8"))
    return {
        "saved_bytes": sum(t.nbytes for t in saved),
        "fp8_bytes": sum(t.nbytes for t in saved if t.dtype.startswith("float8")),
        "fp8_tensors": dict(sorted(fp8.items())),
    }


def run(size: bench_llama.Size, kinds: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    base = bench_llama.make_stack(size, "cpu")
    x = torch.randn(size.batch, size.seq, size.hidden, generator=torch.Generator().manual_seed(0))
    results = {}
    with gpu_gemm_path():
        for kind in kinds:
            results[kind] = measure(kind, base, x)
            print(f"{kind}: {results[kind]['saved_bytes']:,} bytes", flush=True)
    return results


def add_block_arguments(parser: argparse.ArgumentParser, kinds: tuple[str, ...], default_json: str) -> None:
    """The arguments of the scripts that compile ``bench_llama.py``'s blocks on this CPU: size, blocks, batch,
    variants and result file (also ``gpu_kernels.py``'s)."""
    parser.add_argument("--size", default="tiny", choices=sorted(bench_llama.SIZES),
                        help="bench_llama.py's size (its widths and heads; default tiny)")
    parser.add_argument("--blocks", type=int, default=1, help="decoder blocks (default 1)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--kinds", default=",".join(kinds), help=f"comma-separated variants of {', '.join(kinds)}")
    parser.add_argument("--json", default=default_json, help=f"result file (default {os.path.relpath(default_json)})")


def chosen_kinds(parser: argparse.ArgumentParser, args: argparse.Namespace, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The variants ``--kinds`` names, in its order; an unknown one is a usage error."""
    chosen = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in chosen if k not in kinds]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(kinds)}")
    return chosen


def write_and_show(args: argparse.Namespace, env: dict[str, str], script: str, argv: list[str] | None,
                   size: bench_llama.Size, results: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> int:
    """Write the result file (machine, command, size, results) and print its docs table (``render``)."""
    command = " ".join([f"python benchmarks/{script}", *(argv if argv is not None else sys.argv[1:])])
    harness.write_result(args.json, env, command, size={**dataclasses.asdict(size), "tokens": size.tokens},
                         results=results)
    with open(args.json) as f:
        print(render(json.load(f)))
    print(f"written to {os.path.relpath(args.json)}; render the docs tables with python benchmarks/docs_tables.py")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_block_arguments(parser, KINDS, DEFAULT_JSON)
    parser.add_argument("--config", action="append", default=[], metavar="NAME=VALUE",
                        help="set a torch._functorch.config flag for the run, e.g. "
                             "ban_recompute_used_far_apart=False (repeatable)")
    args = parser.parse_args(argv)
    kinds = chosen_kinds(parser, args, KINDS)
    config = {}
    for item in args.config:
        name, _, value = item.partition("=")
        if value not in ("True", "False") or not isinstance(getattr(functorch_config, name, None), bool):
            parser.error(f"--config {item}: want a boolean flag of torch._functorch.config, NAME=True or NAME=False")
        config[name] = value == "True"
    torch.set_num_threads(1)
    size = dataclasses.replace(bench_llama.SIZES[args.size], blocks=args.blocks, batch=args.batch)
    env = harness.environment("cpu")
    env["GEMM path"] = "the GPU's, forced on this CPU: torch._scaled_mm (ours), emulate=False (torchao)"
    with functorch_config.patch(config):
        results = run(size, kinds)
    return write_and_show(args, env, "compiled_saved.py", argv, size, results, docs_tables.compiled_saved)


if __name__ == "__main__":
    raise SystemExit(main())
