#!/usr/bin/env python
"""Benchmark FP8Linear against nn.Linear (fp32, bf16 autocast) and torchao's FP8 training layers, in one run.

Usage::

    python benchmarks/bench_linear.py [--quick | --small] [--out benchmarks/RESULTS.md] [--json benchmarks/results/linear.json]
                                      [--no-compile]

Our variants are every recipe of ``lightning_fp8.recipe.RECIPES``. torchao's are its counterparts where they
run on the machine: ``Float8Linear`` (``convert_to_float8_training``, ``emulate=True`` on a CPU) for
``tensorwise`` and ``rowwise``, the prototype ``MXFP8Linear`` (``torchao.prototype.moe_training``, emulated kernels,
RCEIL scales) for ``mxfp8``, and the prototype ``Float8BlockwiseLinear`` (``torchao.prototype.blockwise_fp8_training``)
for ``blockwise``. A torchao variant that cannot run here (``Float8BlockwiseLinear``: Triton kernels, CUDA SM90 only) is
tried once on a small layer; the reason it failed goes to the JSON (``torchao``) and the tables show it as not measured.

Sections (all numbers come from this one process, so the ratios compare like with like):

1. bytes saved for backward by one layer (``torch.autograd.graph.saved_tensors_hooks``; tensors that
   share storage with a parameter are not counted, each storage is counted once);
2. forward+backward time per step of a transformer-block-like stack of Linear layers, eager (and
   ``torch.compile`` (inductor) for bf16 and each of our recipes, within a compile-time budget);
3. device-to-host synchronisations (``aten._local_scalar_dense``) and aten op count per fwd+bwd;
4. the cost of our statistics: train mode (casts with per-cast counts + state updates) vs eval mode
   (casts without any statistics, state untouched), through the public API, plus a micro-benchmark of
   the internal cast functions;
5. quantization error: SQNR of the output, grad_input and grad_weight of one layer against a float64
   reference, for each recipe and format, and torchao's counterparts on the same data.

The raw numbers go to ``benchmarks/results/linear.json`` (``--json``), from which
``benchmarks/docs_tables.py`` renders the tables the documentation includes.

Speed is only meaningful as a ratio measured in the same run on the same machine; the result file
records the machine and the versions. On a CPU the FP8 GEMMs are *emulated* (bf16 GEMMs plus the
cost of the casts), so FP8 cannot be faster than bf16 here: the speed goal needs FP8 tensor cores.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_fp8 as lf
from lightning_fp8.recipe import BLOCK_RECIPES, FORMATS, RECIPES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

logging.getLogger("torchao").setLevel(logging.ERROR)  # torchao warns about its CUDA-only extensions on import

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "RESULTS.md")
DEFAULT_JSON = os.path.join(HERE, "results", "linear.json")
#: Our recipes: all of them, from the library (a new recipe gets measured without editing this script).
OURS_RECIPES: tuple[str, ...] = RECIPES
#: Compile time (first two steps, summed over the compiled variants) after which the rest are skipped.
COMPILE_BUDGET_S = 600.0


# --------------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class Config:
    quick: bool
    small: bool = False
    # section 1: one layer
    mem_m: int = 8192
    mem_k: int = 1024
    mem_n: int = 1024
    # section 2/3: the block stack
    tokens: int = 2048
    hidden: int = 1024
    mlp_ratio: int = 4
    blocks: int = 1
    warmup: int = 1
    reps: int = 7
    # section 3: op and sync counts do not depend on the shapes; a small stack keeps it quick
    sync_tokens: int = 256
    sync_hidden: int = 256
    # section 4: one layer timing
    layer_m: int = 4096
    layer_k: int = 1024
    layer_n: int = 1024
    layer_reps: int = 7
    micro_reps: int = 20


def make_config(quick: bool, small: bool = False) -> Config:
    """``quick``: fewer repetitions, no compile. ``small``: shapes whose bf16 GEMMs stay affordable on a CPU
    without bf16 matrix units (there a bf16 matmul runs at a fraction of a GFLOP/s, about 70x slower than
    float32), keeping the full repetitions and ``torch.compile``."""
    if quick:
        return Config(quick=True, tokens=1024, hidden=512, warmup=1, reps=3, layer_m=2048, layer_reps=3)
    if small:
        return Config(quick=False, small=True, tokens=256, hidden=256, reps=11, layer_m=1024, layer_k=512, layer_n=512)
    return Config(quick=False)


# --------------------------------------------------------------------------------------------------
# environment


# Machine facts and versions come from the shared harness (benchmarks/harness.py).
environment = harness.environment


# --------------------------------------------------------------------------------------------------
# variants


#: torchao's layer for each of our recipes that it implements, in table order (``delayed`` has none: torchao
#: removed delayed scaling).
TORCHAO_LAYERS: dict[str, str] = {
    "tensorwise": "Float8Linear",
    "rowwise": "Float8Linear",
    "blockwise": "Float8BlockwiseLinear",
    "mxfp8": "MXFP8Linear",
}
TORCHAO_NAMES: dict[str, str] = {
    "tensorwise": "torchao tensorwise (emulate)",
    "rowwise": "torchao rowwise (emulate)",
    "blockwise": "torchao blockwise (Float8BlockwiseLinear)",
    "mxfp8": "torchao mxfp8 (MXFP8Linear, emulated)",
}
#: What the error of a torchao variant that cannot run on a CPU means (the error itself is recorded too).
TORCHAO_CPU_NOTES: dict[str, str] = {
    "blockwise": "torchao.prototype.blockwise_fp8_training casts and multiplies with Triton kernels for CUDA "
                 "(Float8BlockwiseLinear asserts an SM90 GPU and bias-free layers); it has no CPU or emulated path",
}


def load_torchao() -> tuple[Callable[..., nn.Module], Any] | None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:
        return None
    return convert_to_float8_training, Float8LinearConfig


def torchao_config(recipe: str) -> Any:
    _, Float8LinearConfig = load_torchao()  # type: ignore[misc]
    # emulate=True: torchao's only way to run on CPU (dequantize to float32, torch.mm).
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


def _swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    for name, child in model.named_children():
        if type(child) is nn.Linear:
            setattr(model, name, make(child))
        else:
            _swap_linears(child, make)
    return model


def convert_torchao(recipe: str, model: nn.Module) -> nn.Module:
    """``model`` with its ``nn.Linear`` layers replaced by torchao's layer for ``recipe`` (:data:`TORCHAO_LAYERS`)."""
    if recipe in ("tensorwise", "rowwise"):
        convert, _ = load_torchao()  # type: ignore[misc]
        return convert(model, config=torchao_config(recipe))
    if recipe == "mxfp8":
        # torchao 0.18's MX training layer (it has no MXLinear / MXLinearConfig any more), with its hardware-agnostic kernels (PyTorch casts,
        # dequantize, torch.mm) and NVIDIA's RCEIL scale rounding (lightning_fp8's rule). Not
        # quantize_(model, MXFP8TrainingOpConfig): its weight wrapper drops the bias of F.linear in torchao 0.18.
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        def make(lin: nn.Linear) -> nn.Module:
            new = MXFP8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              kernel_preference=KernelPreference.EMULATED,
                              scale_calculation_mode=ScaleCalculationMode.RCEIL)
            new.load_state_dict(lin.state_dict())
            return new

        return _swap_linears(model, make)
    if recipe == "blockwise":
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinearConfig
        from torchao.quantization import quantize_

        quantize_(model, Float8BlockwiseLinearConfig())
        return model
    raise ValueError(f"torchao has no counterpart of recipe {recipe!r}")


@functools.cache
def torchao_status() -> dict[str, dict[str, Any]]:
    """Whether each torchao variant runs here: one forward and backward of a small layer under CPU autocast.

    Keyed by kind (``torchao-<recipe>``): the variant's name, torchao's layer, ``measured`` and, if not, the reason.
    """
    status: dict[str, dict[str, Any]] = {}
    for recipe, layer in TORCHAO_LAYERS.items():
        info: dict[str, Any] = {"recipe": recipe, "name": TORCHAO_NAMES[recipe], "layer": layer, "measured": True,
                                "reason": None}
        if load_torchao() is None:
            info.update(measured=False, reason="torchao is not importable")
        else:
            try:
                # bias-free, 128-aligned: the strictest layer (Float8BlockwiseLinear) accepts this shape
                model = convert_torchao(recipe, nn.Sequential(nn.Linear(256, 256, bias=False)))
                x = torch.randn(128, 256, requires_grad=True)
                with torch.autocast("cpu", torch.bfloat16):
                    out = model(x)
                out.float().sum().backward()
            except Exception as err:
                error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
                note = TORCHAO_CPU_NOTES.get(recipe)
                info.update(measured=False, reason=f"{note} (here: {error})" if note else f"failed here: {error}")
        status[f"torchao-{recipe}"] = info
    return status


@dataclasses.dataclass
class Variant:
    name: str
    model: nn.Module
    autocast: bool  # torch.autocast('cpu', bfloat16)
    fp8: bool  # lightning_fp8.fp8_autocast()

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.autocast:
                stack.enter_context(torch.autocast("cpu", torch.bfloat16))
            if self.fp8:
                stack.enter_context(lf.fp8_autocast())
            yield


def build_variant(kind: str, base: nn.Module) -> Variant:
    """``base`` must be a container (torchao cannot convert a root nn.Linear in place)."""
    model = copy.deepcopy(base)
    if kind == "fp32":
        return Variant("nn.Linear fp32", model, autocast=False, fp8=False)
    if kind == "bf16":
        return Variant("nn.Linear bf16 autocast", model, autocast=True, fp8=False)
    if kind.startswith("torchao-"):
        recipe = kind.split("-", 1)[1]
        return Variant(TORCHAO_NAMES[recipe], convert_torchao(recipe, model), autocast=True, fp8=False)
    if kind.startswith("ours-"):
        recipe = kind.split("-", 1)[1]
        report = lf.convert_to_fp8(model, recipe=recipe)
        assert report.converted, report.summary()
        return Variant(f"ours {recipe}", model, autocast=True, fp8=True)
    raise ValueError(kind)


def available_kinds(with_fp32: bool, torchao_recipes: tuple[str, ...] = tuple(TORCHAO_LAYERS)) -> list[str]:
    """The variants to measure: fp32 (if asked), bf16, the torchao variants that run here, all our recipes."""
    kinds = (["fp32"] if with_fp32 else []) + ["bf16"]
    status = torchao_status()
    kinds += [f"torchao-{r}" for r in torchao_recipes if status[f"torchao-{r}"]["measured"]]
    return kinds + [f"ours-{r}" for r in OURS_RECIPES]


# --------------------------------------------------------------------------------------------------
# 1. bytes saved for backward


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if hasattr(t, "__tensor_flatten__"):  # tensor subclass (e.g. torchao's Float8TrainingTensor)
        names, _ = t.__tensor_flatten__()
        return [s for n in names for s in _storages(getattr(t, n))]
    return [t.untyped_storage()]


def saved_bytes(variant: Variant, x: torch.Tensor) -> tuple[int, list[str]]:
    """Bytes of the distinct storages saved for backward by one forward, parameters excluded."""
    params = {s.data_ptr() for p in variant.model.parameters() for s in _storages(p)}
    seen: dict[int, int] = {}
    described: list[str] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        for s in _storages(t):
            ptr = s.data_ptr()
            if ptr in params or ptr in seen:
                continue
            seen[ptr] = s.nbytes()
            described.append(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), variant.context():
        out = variant.model(x)
    del out
    return sum(seen.values()), described


def bench_saved_bytes(cfg: Config) -> dict[str, Any]:
    torch.manual_seed(0)
    m, k, n = cfg.mem_m, cfg.mem_k, cfg.mem_n
    base = nn.Sequential(nn.Linear(k, n))
    scenarios = {
        "A": ("inner layer: fp32 input requires grad, weight trainable", torch.float32, True, True),
        "B": ("first layer: input does not require grad", torch.float32, False, True),
        "C": ("frozen weight: input requires grad, weight.requires_grad=False", torch.float32, True, False),
        "D": ("bf16 input (what torchao receives under CUDA autocast), requires grad", torch.bfloat16, True, True),
    }
    rows: dict[str, dict[str, Any]] = {}
    for kind in available_kinds(with_fp32=False):
        rows[kind] = {}
        for key, (_, dtype, x_grad, w_grad) in scenarios.items():
            variant = build_variant(kind, base)
            variant.model.requires_grad_(w_grad)
            x = torch.randn(m, k, dtype=dtype).requires_grad_(x_grad)
            try:
                nbytes, described = saved_bytes(variant, x)
            except Exception as err:  # e.g. a layer that takes no input of another dtype than its weight
                error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
                rows[kind][key] = {"bytes": None, "tensors": [], "name": variant.name, "error": error}
                continue
            rows[kind][key] = {"bytes": nbytes, "tensors": described, "name": variant.name}
    return {"shape": (m, k, n), "scenarios": {k: v[0] for k, v in scenarios.items()}, "rows": rows}


# --------------------------------------------------------------------------------------------------
# 2. fwd+bwd time of a block stack


class Block(nn.Module):
    """Pre-norm transformer block in which attention is replaced by an elementwise gate, so that all
    GEMMs are nn.Linear: qkv (h->3h), proj (h->h), fc1 (h->r*h), fc2 (r*h->h)."""

    def __init__(self, hidden: int, mlp_ratio: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(q * torch.sigmoid(k) + v)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def make_stack(cfg: Config) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(cfg.hidden, cfg.mlp_ratio) for _ in range(cfg.blocks)))


def make_step(variant: Variant, x: torch.Tensor, model: nn.Module | None = None) -> Callable[[], None]:
    model = model if model is not None else variant.model

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        with variant.context():
            out = model(x)
        out.float().pow(2).mean().backward()  # backward outside autocast, as Lightning does

    return step


def stack_flops(cfg: Config) -> float:
    h, r = cfg.hidden, cfg.mlp_ratio
    per_token = 2 * h * h * (3 + 1 + r + r)  # forward multiply-adds of the four Linear layers, x2
    return 3 * per_token * cfg.tokens * cfg.blocks  # forward + two backward GEMMs


def timed_round_robin(
    steps: dict[str, Callable[[], None]], warmup: int, reps: int, cpu_times: dict[str, list[float]] | None = None
) -> dict[str, list[float]]:
    """Warm up every step, then time them interleaved (rep-major) so that load drift hits all alike.

    Returns wall-clock seconds per step; process CPU seconds (all threads) go to ``cpu_times`` if given.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(reps):
        for key, step in steps.items():
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            times[key].append(time.perf_counter() - t0)
            if cpu_times is not None:
                cpu_times.setdefault(key, []).append(time.process_time() - c0)
    return times


def bench_step_time(cfg: Config, compile_kinds: tuple[str, ...] = (), budget_s: float = COMPILE_BUDGET_S) -> dict[str, Any]:
    """Eager variants, plus ``torch.compile`` (inductor) of ``compile_kinds`` while the summed compile
    time (first two steps) stays under ``budget_s``. All timed steps are interleaved.

    The compiled variants share the stack's code objects (one dynamo cache entry per variant), so the cache is
    reset once, the recompile limit is raised to hold them all, and each variant's graphs and graph breaks are
    the growth of dynamo's counters while it compiles (a reset per variant would make the earlier ones recompile
    in the timed loop)."""
    base = make_stack(cfg)
    x = torch.randn(cfg.tokens, cfg.hidden)
    kinds = available_kinds(with_fp32=True)
    variants = {kind: build_variant(kind, base) for kind in kinds}
    names = {k: v.name for k, v in variants.items()}
    steps = {kind: make_step(v, x) for kind, v in variants.items()}
    compile_info: dict[str, dict[str, Any]] = {}
    spent = 0.0
    if compile_kinds:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(compile_kinds))
    for kind in compile_kinds:
        key = f"{kind}+compile"
        if spent > budget_s:
            why = f"skipped: compile budget of {budget_s:.0f} s used up ({spent:.0f} s)"
            compile_info[key] = {"error": why}
            continue
        counters = torch._dynamo.utils.counters
        graphs0, breaks0 = counters["stats"].get("unique_graphs", 0), sum(counters["graph_break"].values())
        variant = build_variant(kind, base)
        step = make_step(variant, x, torch.compile(variant.model, backend="inductor"))
        t0 = time.perf_counter()
        try:
            step()
            step()  # a recompilation, if any, happens on the second step (grads no longer None, etc.)
        except Exception as err:  # report, do not abort the whole run
            compile_info[key] = {"error": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            continue
        elapsed = time.perf_counter() - t0
        spent += elapsed
        info: dict[str, Any] = {
            "compile_s": elapsed,
            "graphs": counters["stats"].get("unique_graphs", 0) - graphs0,
            "graph_breaks": sum(counters["graph_break"].values()) - breaks0,
        }
        if kind.startswith("ours-"):

            def seen() -> int:  # elements recorded by all casts so far (host read, outside the timed steps)
                return sum(int(m.fp8_counts[:, 0].sum()) for m in variant.model.modules() if hasattr(m, "fp8_counts"))

            before = seen()
            step()
            info["state_updated"] = seen() > before
        compile_info[key] = info
        names[key] = f"{names[kind]} + torch.compile"
        steps[key] = step
    cpu: dict[str, list[float]] = {}
    times = timed_round_robin(steps, cfg.warmup, cfg.reps, cpu)
    return {"names": names, "times": times, "cpu": cpu, "flops": stack_flops(cfg), "compile": compile_info,
            "compile_budget_s": budget_s}


# --------------------------------------------------------------------------------------------------
# 3. synchronisations


class OpCounter(TorchDispatchMode):
    """Counts aten ops, host syncs, and ops with an output of at least ``large`` elements (a proxy for
    full passes over an activation or weight)."""

    def __init__(self, large: int) -> None:
        super().__init__()
        self.large = large
        self.syncs = 0
        self.ops = 0
        self.large_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(o, torch.Tensor) and o.numel() >= self.large for o in outs):
            self.large_ops += 1
        return out


def bench_syncs(cfg: Config) -> dict[str, Any]:
    small = dataclasses.replace(cfg, tokens=cfg.sync_tokens, hidden=cfg.sync_hidden)
    base = make_stack(small)
    x = torch.randn(small.tokens, small.hidden)
    rows = {}
    for kind in available_kinds(with_fp32=False):
        variant = build_variant(kind, base)
        step = make_step(variant, x)
        step()  # first step: delayed-scaling initialisation, lazy setup
        counter = OpCounter(large=small.hidden * small.hidden)
        with counter:
            step()
        rows[kind] = {"name": variant.name, "syncs": counter.syncs, "ops": counter.ops, "large_ops": counter.large_ops}
    linears = sum(isinstance(m, nn.Linear) for m in base.modules())
    return {"rows": rows, "linears": linears, "shape": (small.tokens, small.hidden)}


# --------------------------------------------------------------------------------------------------
# 4. cost of the statistics


def _min_time(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    """Fastest of ``reps`` calls: for a micro-benchmark the least disturbed by other processes."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def bench_stats_overhead(cfg: Config) -> dict[str, Any]:
    torch.manual_seed(0)
    m, k, n = cfg.layer_m, cfg.layer_k, cfg.layer_n
    base = nn.Sequential(nn.Linear(k, n))
    x = torch.randn(m, k, requires_grad=True)
    bf16 = build_variant("bf16", base)
    steps: dict[str, Callable[[], None]] = {}

    def fwd_bwd(v: Variant) -> Callable[[], None]:
        def run() -> None:
            x.grad = None
            for p in v.model.parameters():
                p.grad = None
            with v.context():
                out = v.model(x)
            out.float().sum().backward()

        return run

    def fwd_only(v: Variant) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), v.context():
                v.model(x)

        return run

    steps["bf16|fwd+bwd"] = fwd_bwd(bf16)
    steps["bf16|fwd"] = fwd_only(bf16)
    ours = {r: build_variant(f"ours-{r}", base) for r in OURS_RECIPES}
    # Same module object in both modes: train() records statistics, eval() leaves the state alone.
    for recipe, v in ours.items():
        for mode in ("train", "eval"):
            for what, make in (("fwd+bwd", fwd_bwd), ("fwd", fwd_only)):
                inner = make(v)

                def run(v: Variant = v, mode: str = mode, inner: Callable[[], None] = inner) -> None:
                    v.model.train(mode == "train")
                    inner()

                steps[f"{recipe}|{mode}|{what}"] = run
    public = timed_round_robin(steps, 2, cfg.layer_reps)

    # Internal functions (not public API): what one cast costs with and without the counts.
    from lightning_fp8 import quantize as lf_cast

    xt = torch.randn(m, k)
    scale = torch.tensor(448.0 / float(xt.abs().max()))
    e4m3 = torch.float8_e4m3fn
    internal = {
        "amax (x.abs().amax())": lambda: xt.abs().amax(),
        "saturated_cast(x * scale) [no counts]": lambda: lf_cast.saturated_cast(xt * scale, e4m3),
        "cast_with_statistics(x, scale) [cast + counts]": lambda: lf_cast.cast_with_statistics(xt, scale, e4m3),
        "plain (x * scale).clamp().to(fp8) [reference]": lambda: (xt * scale).clamp(-448.0, 448.0).to(e4m3),
    }
    if load_torchao() is not None:
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import LinearMMConfig

        mm_cfg = LinearMMConfig()
        internal["torchao hp_tensor_to_float8_dynamic (amax + cast)"] = lambda: hp_tensor_to_float8_dynamic(
            xt, e4m3, mm_cfg
        )
    internal_t = {name: _min_time(fn, 2, cfg.micro_reps) for name, fn in internal.items()}
    return {"shape": (m, k, n), "public": public, "internal": internal_t}


# --------------------------------------------------------------------------------------------------
# 5. quantization error


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against ``ref``, in dB: 10 log10(sum ref^2 / sum (ref-x)^2)."""
    ref, x = ref.double(), x.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum()))


def bench_sqnr() -> dict[str, Any]:
    """One ``Linear(512, 1024)`` (uniform init), standard-normal input (4, 256, 512) and output gradient,
    float32 (no autocast); output, grad_input and grad_weight against the same layer in float64. ``delayed``
    runs on history scales: one warm-up step on another batch of the same distribution first."""
    gen = torch.Generator().manual_seed(1234)
    base = nn.Linear(512, 1024)
    with torch.no_grad():
        base.weight.copy_(torch.empty(1024, 512).uniform_(-1, 1, generator=gen) / 512**0.5)
        base.bias.copy_(torch.empty(1024).uniform_(-1, 1, generator=gen) / 512**0.5)
    x, x_warm = torch.randn(4, 256, 512, generator=gen), torch.randn(4, 256, 512, generator=gen)
    grad = torch.randn(4, 256, 1024, generator=gen)

    def step(model: nn.Module, inp: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, ...]:
        inp = inp.clone().requires_grad_()
        with lf.fp8_autocast() if fp8 else contextlib.nullcontext():
            out = model(inp)
        out.backward(grad.to(out.dtype))
        layer = model[0] if isinstance(model, nn.Sequential) else model
        return out.detach(), inp.grad, layer.weight.grad

    reference = step(copy.deepcopy(base).double(), x.double(), fp8=False)
    rows: dict[str, dict[str, Any]] = {}
    for recipe, fmt in recipe_formats():
        model = copy.deepcopy(base)
        lf.convert_to_fp8(model, recipe=lf.FP8Recipe(name=recipe, fp8_format=fmt), log_summary=False)
        if recipe == "delayed":
            step(model, x_warm, fp8=True)
            model.zero_grad()
        got = step(model, x, fp8=True)
        rows[f"ours-{recipe}-{fmt}"] = {"name": f"ours {recipe} ({fmt})", "recipe": recipe, "format": fmt,
                                        "db": [sqnr_db(r, g) for r, g in zip(reference, got)]}
    for kind in available_kinds(with_fp32=False):
        if not kind.startswith("torchao-"):
            continue
        recipe = kind.split("-", 1)[1]
        model = build_variant(kind, nn.Sequential(copy.deepcopy(base))).model
        got = step(model, x, fp8=False)
        rows[kind] = {"name": TORCHAO_NAMES[recipe], "recipe": recipe,
                      "format": "e4m3 fwd, e5m2 grads" if recipe == "tensorwise" else "e4m3",
                      "db": [sqnr_db(r, g) for r, g in zip(reference, got)]}
    return {"tensors": ["output", "grad_input", "grad_weight"], "rows": rows}


def recipe_formats() -> list[tuple[str, str]]:
    """Every (recipe, format) pair of our recipes that the library accepts, ``hybrid`` first."""
    pairs = []
    for recipe in OURS_RECIPES:
        for fmt in FORMATS:
            try:
                lf.FP8Recipe(name=recipe, fp8_format=fmt)
            except ValueError:  # e.g. rowwise and blockwise take E4M3 only
                continue
            pairs.append((recipe, fmt))
    return pairs


# --------------------------------------------------------------------------------------------------
# report


def fmt_mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _not_measured(torchao: dict[str, dict[str, Any]], cells: int) -> list[str]:
    """Table rows for the torchao variants that could not run here (``cells`` empty cells after the reason)."""
    return [f"| {info['name']} | not measured (see above) |" + " |" * (cells - 1)
            for info in torchao.values() if not info["measured"]]


def render(cfg: Config, env: dict[str, str], mem: dict, speed: dict, syncs: dict, stats: dict, sqnr: dict,
           total_s: float, torchao: dict[str, dict[str, Any]]) -> str:
    L: list[str] = []
    L.append("# lightning_fp8 benchmark: FP8Linear vs nn.Linear (fp32, bf16) and torchao's FP8 training layers")
    L.append("")
    mode = "quick" if cfg.quick else "small" if cfg.small else "full"
    L.append(f"Generated by `python benchmarks/bench_linear.py{'' if mode == 'full' else ' --' + mode}` "
             f"in {total_s:.0f} s. Mode: {mode}.")
    L.append("")
    L.append("| | |")
    L.append("|---|---|")
    for key, val in env.items():
        L.append(f"| {key} | {val} |")
    L.append("")
    load = float(env["load average at start"].split()[0])
    cores = os.cpu_count() or 1
    if load > 0.5 * cores or max(os.getloadavg()) > 0.5 * cores:
        L.append(f"> **Warning: the machine was shared.** Load average {env['load average at start']} at start and "
                 f"{' '.join(f'{v:.2f}' for v in os.getloadavg())} at the end, on {cores} CPUs: other processes "
                 "competed for the cores, so wall times are noisy (see the min-max spread). Prefer the `(min)` and "
                 "`(CPU s)` ratios, and rerun on an idle machine before drawing conclusions from small differences.")
        L.append("")
    L.append("> **Read this first.** This machine has no FP8 hardware. Our FP8 GEMMs run the *emulated* path "
             "(FP8 values widened to float32, float32 GEMM, scales applied to the float32 result, one rounding), and "
             "torchao runs with `Float8LinearConfig(emulate=True)` (FP8 values dequantized to float32, `torch.mm`), "
             "and its prototype `MXFP8Linear` with `KernelPreference.EMULATED` (PyTorch casts, MX values dequantized "
             "to the input's dtype, `torch.mm`). "
             "Both therefore pay a GEMM at least as expensive as bf16 *plus* the quantization casts, so on this "
             "machine FP8 can only be slower than bf16. The speed goal (faster than bf16) needs FP8 tensor cores "
             "(CUDA compute capability 8.9+), which were not available. What *is* meaningful here: bytes saved "
             "for backward (hardware-independent), host syncs, op counts, and the relative cost of our casts "
             "and statistics versus torchao's.")
    L.append("")
    L.append(f"Our recipes: {', '.join(f'`{r}`' for r in OURS_RECIPES)} (`lightning_fp8.recipe.RECIPES`; block "
             f"recipes: {', '.join(f'`{r}`' for r in BLOCK_RECIPES)}). torchao's counterparts:")
    L.append("")
    for info in torchao.values():
        state = "measured" if info["measured"] else f"**not measured**: {info['reason']}"
        L.append(f"- `{info['recipe']}`: {info['name']} (`{info['layer']}`): {state}")
    L.append("- `delayed`: none (torchao removed delayed scaling)")
    L.append("")

    # 1
    m, k, n = mem["shape"]
    L.append(f"## 1. Bytes saved for backward, one layer, M={m}, K={k}, N={n}")
    L.append("")
    L.append("Counted with `torch.autograd.graph.saved_tensors_hooks` during one forward under "
             "`torch.autocast('cpu', torch.bfloat16)` (ours also inside `fp8_autocast()`); storages shared with "
             "a parameter are not counted, each storage once. MiB, and the ratio to `nn.Linear` under bf16 "
             "autocast in the same scenario. Target for ours (tensorwise, delayed): <= 0.55x bf16 (scenario A).")
    L.append("")
    for key, desc in mem["scenarios"].items():
        L.append(f"- **{key}**: {desc}")
    L.append("")
    keys = list(mem["scenarios"])
    L.append("| layer | " + " | ".join(f"{key}: MiB | {key}: x bf16" for key in keys) + " |")
    L.append("|---|" + "---:|---:|" * len(keys))
    rows = mem["rows"]
    for kind, row in rows.items():
        cells = []
        for key in keys:
            ref = rows["bf16"][key]["bytes"]
            b = row[key]["bytes"]
            if b is None:
                cells.append("failed | ")
                continue
            ratio = f"{b / ref:.3f}" if ref else "n/a"
            cells.append(f"{fmt_mib(b)} | {ratio}")
        L.append(f"| {row[keys[0]]['name']} | " + " | ".join(cells) + " |")
    L.extend(_not_measured(torchao, 2 * len(keys)))
    L.append("")
    for kind, row in rows.items():
        for key in keys:
            if "error" in row[key]:
                L.append(f"- {row[key]['name']}, scenario {key}: failed: {row[key]['error']}")
    L.append("")
    L.append("What each variant saved in scenario A:")
    L.append("")
    for kind, row in rows.items():
        L.append(f"- {row['A']['name']}: {', '.join(row['A']['tensors']) or 'nothing'}")
    L.append("")

    # 2
    times = speed["times"]
    names = speed["names"]
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    cpu = {k: statistics.median(v) for k, v in speed["cpu"].items()}
    L.append("## 2. Forward+backward time per step")
    L.append("")
    L.append(f"Stack: {cfg.blocks} pre-norm block(s), hidden {cfg.hidden}, MLP {cfg.mlp_ratio}x, {cfg.tokens} tokens; "
             "Linear layers qkv (h->3h), proj (h->h), fc1, fc2; attention replaced by an elementwise gate so "
             "that all GEMMs are Linear layers. One step = zero grads, forward under the variant's autocast, "
             "`out.float().pow(2).mean().backward()` outside autocast. "
             f"{cfg.warmup} warm-up step(s) per variant, then {cfg.reps} timed steps per variant, interleaved "
             f"(round-robin) so that load drift affects all variants alike; median and [min - max]. "
             f"{speed['flops'] / 1e9:.0f} GFLOP of Linear GEMMs per step. Ratios use the medians; "
             "`x bf16 (min)` uses the fastest step of each and `x bf16 (CPU s)` the median process CPU time "
             "(all threads); both are less sensitive than the median wall time to other processes on a shared "
             "machine.")
    L.append("")
    ref_ao = med.get("torchao-tensorwise")
    L.append("| variant | ms / step (median) | [min - max] | GEMM TFLOP/s | x bf16 | x bf16 (min) | x bf16 (CPU s) | "
             "x torchao tensorwise | x torchao same recipe |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, t in med.items():
        ao = f"{t / ref_ao:.2f}" if ref_ao else "n/a"
        same = "-"
        if kind.startswith("ours-") and "+" not in kind:
            twin = f"torchao-{kind.split('-', 1)[1]}"
            same = f"{t / med[twin]:.2f}" if twin in med else "not measured" if twin in torchao else "none in torchao"
        L.append(f"| {names[kind]} | {fmt_ms(t)} | [{fmt_ms(low[kind])} - {fmt_ms(max(times[kind]))}] | "
                 f"{speed['flops'] / t / 1e12:.2f} | {t / med['bf16']:.2f} | {low[kind] / low['bf16']:.2f} | "
                 f"{cpu[kind] / cpu['bf16']:.2f} | {ao} | {same} |")
    L.extend(_not_measured(torchao, 8))
    L.append("")
    L.append("x bf16 > 1 means slower than bf16. On this CPU that is expected for every FP8 variant (see the note "
             "at the top); the ratio shows the cost of the emulated path, not FP8 speed. torchao's emulation "
             "runs its forward GEMM in bf16 (CPU autocast applies to its `torch.mm`) but its two backward GEMMs in "
             "float32 (backward runs outside autocast), ours multiplies the FP8 values of all three in float32 and rounds once, as `torch._scaled_mm` does. "
             "torchao's `MXFP8Linear` is not affected by CPU autocast: it quantizes the float32 input and runs its three "
             "emulated GEMMs in float32. Our block recipes dequantize each operand per block and multiply in float32.")
    L.append("")
    L.append("### torch.compile (inductor)")
    L.append("")
    comp = speed["compile"]
    if not comp:
        L.append("Skipped (`--quick` or `--no-compile`).")
    else:
        L.append(f"Compiled in this process before the timed loop (compile time = first two steps; the remaining "
                 f"variants are skipped once {speed.get('compile_budget_s', COMPILE_BUDGET_S):.0f} s of compile time is spent). Their step times are "
                 "rows of the table above (`+ torch.compile`).")
        L.append("")
        L.append("| variant | compile s (first 2 steps) | graphs | graph breaks | FP8 state updated when compiled | "
                 "x eager same recipe | x bf16 + compile |")
        L.append("|---|---:|---:|---:|---|---:|---:|")
        bf16c = med.get("bf16+compile")
        for key, info in comp.items():
            kind = key.split("+")[0]
            if "error" in info:
                L.append(f"| {names.get(kind, kind)} + torch.compile | {info['error']} | | | | | |")
                continue
            upd = {True: "yes", False: "**no**"}.get(info.get("state_updated"), "n/a")
            vs = f"{med[key] / bf16c:.2f}" if bf16c else "n/a"
            L.append(f"| {names[key]} | {info['compile_s']:.1f} | {info['graphs']} | {info['graph_breaks']} | {upd} | "
                     f"{med[key] / med[kind]:.2f} | {vs} |")
    L.append("")

    # 3
    L.append("## 3. Device-to-host synchronisations per fwd+bwd")
    L.append("")
    L.append(f"`aten._local_scalar_dense` calls (what `.item()`, `bool(tensor)`, `int(tensor)` dispatch to) counted "
             f"under a `TorchDispatchMode` during one fwd+bwd step of the section-2 block stack "
             f"({syncs['linears']} Linear layers) at {syncs['shape'][0]} tokens, hidden {syncs['shape'][1]} (counts do "
             "not depend on the shapes), after one un-counted step, eager. The aten op count is a proxy for "
             "per-step dispatch overhead and for the number of memory passes of the eager casts.")
    L.append("")
    L.append(f"`full-size ops`: ops with an output of at least hidden x hidden = {syncs['shape'][1] ** 2} elements "
             "(each is roughly one pass over an activation, gradient or weight).")
    L.append("")
    L.append("| variant | syncs / step | aten ops / step | full-size ops / step | aten ops / Linear layer (approx.) |")
    L.append("|---|---:|---:|---:|---:|")
    for kind, row in syncs["rows"].items():
        L.append(f"| {row['name']} | {row['syncs']} | {row['ops']} | {row['large_ops']} | "
                 f"{row['ops'] / syncs['linears']:.0f} |")
    L.extend(_not_measured(torchao, 4))
    L.append("")

    # 4
    m, k, n = stats["shape"]
    pub = stats["public"]
    L.append(f"## 4. Cost of our statistics, one FP8Linear, M={m}, K={k}, N={n}")
    L.append("")
    L.append("Public API: the same converted layer timed in `module.train()` (casts, then the state is updated: "
             "scale, amax pending/history roll, overflow/underflow/seen counters) and in `module.eval()` "
             "(the same scaling, but the casts compute no statistics and the state is untouched; backward still "
             "runs and also skips them). "
             "`fwd` = forward only under `torch.no_grad()`. Interleaved, median of "
             f"{cfg.layer_reps}. fp32 input requiring grad, bf16 autocast + `fp8_autocast()`.")
    L.append("")
    L.append("| recipe | fwd+bwd train ms | fwd+bwd eval ms | train/eval (median) | train/eval (min) | fwd train ms | "
             "fwd eval ms | train/eval (median) | train/eval (min) | fwd+bwd train x bf16 |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    md = {k: statistics.median(v) for k, v in pub.items()}
    mn = {k: min(v) for k, v in pub.items()}
    for recipe in OURS_RECIPES:
        cells = []
        for what in ("fwd+bwd", "fwd"):
            tr, ev = f"{recipe}|train|{what}", f"{recipe}|eval|{what}"
            cells.append(f"{fmt_ms(md[tr])} | {fmt_ms(md[ev])} | {md[tr] / md[ev]:.2f} | {mn[tr] / mn[ev]:.2f}")
        L.append(f"| {recipe} | {' | '.join(cells)} | {md[f'{recipe}|train|fwd+bwd'] / md['bf16|fwd+bwd']:.2f} |")
    bf16_row = f"{fmt_ms(md['bf16|fwd+bwd'])} | | | | {fmt_ms(md['bf16|fwd'])} | | | | 1.00"
    L.append(f"| *nn.Linear bf16 autocast* | {bf16_row} |")
    L.append("")
    L.append("Note: in eval mode the casts skip the statistics entirely (`saturated_cast` only: no per-cast counts, "
             "no `record_cast` state update). So train/eval measures the whole cost of the statistics, counting "
             "plus state update. The internal micro-benchmark below separates the counting (`cast_with_statistics` "
             "vs `saturated_cast`).")
    L.append("")
    L.append(f"Internal functions (`lightning_fp8.quantize`, not public API), one {m}x{k} float32 tensor to E4M3, "
             f"fastest of {cfg.micro_reps} calls:")
    L.append("")
    L.append("| operation | ms | x plain cast |")
    L.append("|---|---:|---:|")
    internal = stats["internal"]
    plain = internal["plain (x * scale).clamp().to(fp8) [reference]"]
    for name, t in internal.items():
        L.append(f"| {name} | {fmt_ms(t)} | {t / plain:.2f} |")
    L.append("")
    L.append("## 5. Quantization error (SQNR against float64, dB, higher is better)")
    L.append("")
    L.append((bench_sqnr.__doc__ or "").split("\n\n")[0].replace("\n    ", " ").strip())
    L.append("")
    L.append("| variant | " + " | ".join(sqnr["tensors"]) + " |")
    L.append("|---|" + "---:|" * len(sqnr["tensors"]))
    for row in sqnr["rows"].values():
        L.append(f"| {row['name']} | " + " | ".join(f"{v:.2f}" for v in row["db"]) + " |")
    L.extend(_not_measured(torchao, len(sqnr["tensors"])))
    L.append("")
    L.append(f"Load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}.")
    L.append("")
    return "\n".join(L)


# --------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, fewer repetitions, no torch.compile")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"Markdown output file (default {DEFAULT_OUT})")
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"raw numbers as JSON (default {DEFAULT_JSON})")
    parser.add_argument("--small", action="store_true",
                        help="small shapes for CPUs without bf16 matrix units (full repetitions and compile)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile measurements")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default: torch's own choice); 1 is steadier on a loaded machine")
    parser.add_argument("--compile-budget", type=float, default=COMPILE_BUDGET_S,
                        help=f"seconds of compile time after which the remaining variants are not compiled "
                             f"(default {COMPILE_BUDGET_S:.0f})")
    args = parser.parse_args()

    cfg = make_config(args.quick, args.small)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    env = environment()
    if load_torchao() is None:
        print("torchao not importable: torchao rows are left out", file=sys.stderr)

    def stage(name: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {name}", file=sys.stderr, flush=True)

    stage("1. bytes saved for backward")
    mem = bench_saved_bytes(cfg)
    for info in torchao_status().values():
        if not info["measured"]:
            print(f"{info['name']}: not measured: {info['reason']}", file=sys.stderr)
    compile_kinds = () if (cfg.quick or args.no_compile) else ("bf16", *(f"ours-{r}" for r in OURS_RECIPES))
    stage("2. fwd+bwd step time" + (" (compiling bf16 and our recipes first)" if compile_kinds else ""))
    speed = bench_step_time(cfg, compile_kinds, args.compile_budget)
    stage("3. syncs")
    syncs = bench_syncs(cfg)
    stage("4. statistics overhead")
    stats = bench_stats_overhead(cfg)
    stage("5. quantization error")
    sqnr = bench_sqnr()
    total = time.perf_counter() - t_start
    stage("done")

    text = render(cfg, env, mem, speed, syncs, stats, sqnr, total, torchao_status())
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    command = ("python benchmarks/bench_linear.py" + (" --quick" if cfg.quick else "") + (" --small" if cfg.small else "")
               + (" --no-compile" if args.no_compile else "") + (f" --threads {args.threads}" if args.threads else "")
               + (f" --compile-budget {args.compile_budget:g}" if args.compile_budget != COMPILE_BUDGET_S else ""))
    harness.write_result(args.json, env, command, config=dataclasses.asdict(cfg), total_s=total,
                         recipes=list(OURS_RECIPES), block_recipes=list(BLOCK_RECIPES), torchao=torchao_status(),
                         saved_bytes=mem, step_time=speed, syncs=syncs, statistics=stats, sqnr=sqnr)
    print(f"\nwritten to {args.out} and {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
