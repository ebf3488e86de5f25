#!/usr/bin/env python
"""The Triton kernels inductor writes for a GPU, counted and sized on a CPU.

Usage::

    python benchmarks/gpu_kernels.py                                    # one tiny block: about a minute per variant
    python benchmarks/gpu_kernels.py --size llama3-8b --seq 8192 --kinds torchao-tensorwise,ours-tensorwise:uncounted

Where a compiled FP8 step spends its GPU time is mostly in what inductor generates around the GEMMs: the casts, the
amaxes, the statistics, the state-table records. Without a GPU this script makes inductor write that code anyway:
its Triton backend for the CPU device (``torch._inductor.config.cpu_backend = "triton"``, the same scheduler, fusion
rules and Triton code generation as for CUDA), with the CPU's device properties replaced by an H100's (132
multiprocessors, warp 32, compute capability 9.0: they size split reductions), and every generated kernel kept as
source instead of compiled (nothing runs on the CPU but the extern calls, whose CPU kernels are replaced by
``torch.empty`` of the right shape for ``_scaled_mm`` and CPU flash attention: the outputs are garbage, only the code
is looked at). Ours and torchao take the GPU's GEMM path (``compiled_saved.gpu_gemm_path``).

Per variant (``bench_llama.py``'s model and variants; ``ours-<recipe>:uncounted`` is a step that does not count,
``statistics_every_n_steps``): ``torch._dynamo.reset()``, one compiled forward and backward, and from the code
inductor wrote for each graph (forward, backward): the kernel launches by kind (pointwise, reduction, persistent
reduction), inductor's own estimate of the bytes each launched kernel reads and writes (``kernel_num_gb``, from the
buffer sizes: it ignores caches, and a kernel launched twice counts twice), and the extern calls (GEMMs, attention).

What this is not: a timing. Kernel efficiency (a tiled transpose, a persistent reduction's occupancy), launch
overhead and the GEMMs' own speed need a GPU (``benchmarks/profile_kernels.py``). It does show where a recipe moves
more bytes than another and which operations failed to fuse. Inductor's choices can differ on a real GPU where they
depend on what this patch does not reproduce (autotuning, a device's decomposition of ``rms_norm``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_llama  # noqa: E402
import compiled_saved  # noqa: E402
import docs_tables  # noqa: E402
import harness  # noqa: E402

KINDS = ("bf16", "torchao-tensorwise", "torchao-rowwise", "ours-tensorwise", "ours-tensorwise:uncounted",
         "ours-rowwise", "ours-delayed")
DEFAULT_JSON = os.path.join(bench_llama.HERE, "results", "gpu_kernels.json")
#: An H100's properties where inductor sizes kernels by the device (split reductions, persistent reductions).
H100 = {"multi_processor_count": 132, "warp_size": 32, "max_threads_per_multi_processor": 2048,
        "regs_per_multiprocessor": 65536, "major": 9, "cc": 90}
KERNEL_KINDS = {"poi": "pointwise", "red": "reduction", "per": "persistent reduction"}


@contextlib.contextmanager
def triton_code_on_cpu(sources: dict[str, str]) -> Iterator[None]:
    """Inside, inductor writes Triton code for CPU tensors as it would for an H100 and keeps each kernel's source in
    ``sources`` (name -> code) instead of compiling it; the CPU kernels of ``_scaled_mm`` and CPU flash attention
    return uninitialised tensors. Everything is restored on exit."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.runtime import hints

    class Kept:  # what AsyncCompile.triton returns: a kernel whose launches do nothing
        def run(self, *args: Any, **kwargs: Any) -> None:
            pass

    def keep(self: Any, kernel_name: str, source_code: str, device_str: str = "cuda") -> Kept:
        sources[kernel_name] = source_code
        return Kept()

    create = hints.DeviceProperties.__dict__["create"]

    def h100_on_cpu(device: torch.device) -> Any:
        props = create.__func__(hints.DeviceProperties, device)
        return props._replace(**H100) if device.type == "cpu" else props

    def uninitialised(op: Any) -> Any:  # the op's meta kernel gives the shapes and strides
        def run(*args: Any, **kwargs: Any) -> Any:
            meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
            out = op(*meta, **{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
            return tuple(torch.empty_strided(o.shape, o.stride(), dtype=o.dtype) for o in out)
        return run

    def scaled_mm(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any = None, scale_result: Any = None,
                  out_dtype: Any = None, use_fast_accum: bool = False) -> torch.Tensor:
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype or a.dtype)

    def scaled_mm_out(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any = None, scale_result: Any = None,
                      out_dtype: Any = None, use_fast_accum: bool = False, *, out: torch.Tensor) -> torch.Tensor:
        return out

    saved = AsyncCompile.triton, torch_triton.triton_hash_with_backend
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("_scaled_mm", scaled_mm, "CPU")
        library.impl("_scaled_mm.out", scaled_mm_out, "CPU")
        for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"):
            library.impl(name, uninitialised(getattr(torch.ops.aten, name).default), "CPU")
        AsyncCompile.triton = keep
        torch_triton.triton_hash_with_backend = lambda: "kept"  # no Triton backend for the CPU to hash
        hints.DeviceProperties.create = staticmethod(h100_on_cpu)
        with inductor_config.patch(cpu_backend="triton", fx_graph_cache=False, benchmark_kernel=True):
            yield
    finally:
        hints.DeviceProperties.create = create
        AsyncCompile.triton, torch_triton.triton_hash_with_backend = saved
        library._destroy()


def graph_kernels(code: str, sources: dict[str, str]) -> dict[str, Any]:
    """Launches by kind, estimated GB moved and extern calls of one graph's generated wrapper ``code``."""
    body = re.search(r"^    def call\(self, args\):\n(.*?)\n        return ", code, re.S | re.M)  # benchmark_kernel's Runner
    body = body or re.search(r"^def call\(args\):\n(.*?)\n    return ", code, re.S | re.M)
    if body is None:
        raise RuntimeError("no call() in inductor's wrapper code: this torch writes it differently")
    launches = re.findall(r"^\s+(triton_\w+)\.run\(", body.group(1), re.M)
    gb = {}
    for name in set(launches):
        found = re.search(r"'kernel_num_gb': ([0-9.e+-]+)", sources.get(name, ""))
        gb[name] = float(found.group(1)) if found else 0.0
    kinds = collections.Counter(KERNEL_KINDS.get(name.split("_")[1], "other") for name in launches)
    extern = collections.Counter(re.findall(r"(extern_kernels\.\w+|torch\.ops\.aten\.\w+)", body.group(1)))
    return {"launches": len(launches), "kinds": dict(sorted(kinds.items())), "gb": sum(gb[n] for n in launches),
            "extern": dict(sorted(extern.items()))}


def measure(spec: str, base: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Compile variant ``spec`` (a kind, ``:uncounted`` for a step that does not count) and describe its graphs."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    variant = bench_llama.build_variant(spec, base, "cpu", "inductor", scope="model")
    sources: dict[str, str] = {}
    with triton_code_on_cpu(sources):
        _, codes = run_and_get_code(lambda: bench_llama.forward_backward(variant, x))
    if len(codes) != 2:
        raise RuntimeError(f"{spec}: {len(codes)} graphs compiled, expected a forward and a backward")
    return dict(zip(("forward", "backward"), (graph_kernels(code, sources) for code in codes)))


def run(size: bench_llama.Size, specs: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    base = bench_llama.make_stack(size, "cpu")
    x = torch.randn(size.batch, size.seq, size.hidden, generator=torch.Generator().manual_seed(0))
    results = {}
    with compiled_saved.gpu_gemm_path():
        for spec in specs:
            results[spec] = measure(spec, base, x)
            fwd, bwd = results[spec]["forward"], results[spec]["backward"]
            print(f"{spec}: {fwd['launches']} + {bwd['launches']} launches, "
                  f"{(fwd['gb'] + bwd['gb']) * 1e3:,.1f} MB moved (estimated)", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    compiled_saved.add_block_arguments(parser, KINDS, DEFAULT_JSON)
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the size's)")
    args = parser.parse_args(argv)
    specs = compiled_saved.chosen_kinds(parser, args, KINDS)
    base_size = bench_llama.SIZES[args.size]
    size = dataclasses.replace(base_size, blocks=args.blocks, batch=args.batch, seq=args.seq or base_size.seq)
    env = harness.environment("cpu")
    env["code generation"] = "inductor's Triton backend on this CPU with an H100's device properties; kernels not run"
    results = run(size, specs)
    return compiled_saved.write_and_show(args, env, "gpu_kernels.py", argv, size, results, docs_tables.gpu_kernels)


if __name__ == "__main__":
    raise SystemExit(main())
