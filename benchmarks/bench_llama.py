#!/usr/bin/env python
"""Llama-style decoder blocks: bf16, torchao float8 and every lightning_fp8 recipe, eager and compiled, in one run.

Usage::

    python benchmarks/bench_llama.py                  # the small sizes (tiny, small): a CPU or a GPU
    python benchmarks/bench_llama.py --large          # Llama-3.2-1B- and Llama3-8B-shaped blocks: a GPU
    python benchmarks/bench_llama.py --no-compile     # eager only
    python benchmarks/bench_llama.py --replot         # redraw the plot from the JSON, measure nothing

The model is a stack of Llama-style decoder blocks written here: RMSNorm, attention with rotary embeddings,
grouped-query attention through ``F.scaled_dot_product_attention`` (causal), RMSNorm, SwiGLU MLP; the seven Linear
layers of a block (q, k, v, o, gate, up, down; no bias) are what the FP8 variants convert. The input is a batch of
random hidden states; the loss is the mean square of the last block's output (no embedding, no LM head).

Variants, all in one process on the same weights (the model copies share the Parameter objects) and the same data:

* ``bf16``: ``torch.autocast(bfloat16)`` around the forward, what Lightning's ``precision="bf16-mixed"`` does;
* ``torchao-tensorwise``, ``torchao-rowwise``: torchao's ``convert_to_float8_training`` with
  ``Float8LinearConfig.from_recipe_name(...)`` (``emulate=True`` where the device has no FP8 tensor cores), under
  the same bf16 autocast;
* ``ours-<recipe>`` for every recipe of ``lightning_fp8.recipe.RECIPES``: ``convert_to_fp8`` and, around the
  forward, bf16 autocast plus ``fp8_autocast(defer_amax_history_roll=True)``; ``roll_amax_history`` once per step
  after the optimizer step, as the precision plugin does;
* each of them again under ``torch.compile`` (inductor by default; the model is compiled, or with
  ``--compile-scope blocks`` each block on its own, torchtitan's way; the loss, backward call and optimizer step stay
  eager, as in a Lightning training step). Compiling stops once ``--compile-budget`` seconds of
  compile time have been spent on one size; the variants left are reported as skipped. Before it is timed, each
  compiled variant's gradients (one step, no optimizer step) are compared with its eager twin's on the same weights
  and batch (``gradient_check``); one more than ``GRADIENT_TOLERANCE`` off, or with a parameter's gradient zero
  where the twin's is not, is reported as invalid and not timed (torch 2.11 once trained our compiled layers with
  zero gradients at a plausible speed).

A step is ``zero_grad(set_to_none=True)``, the forward, ``loss.backward()``, one ``AdamW(fused=True)`` step (one
optimizer over the shared parameters: no host sync in the step itself) and, for our recipes, the amax-history roll.
No loss scaling (bf16 needs none) and no gradient clipping.

Measured per variant and size, after ``--warmup`` steps:

* step time: ``--reps`` steps per variant, interleaved round-robin across all variants (``harness.interleaved``),
  median, fastest and slowest, and the median process CPU time; on CUDA each step ends with a synchronize, and
  tokens per second and model FLOPs utilisation (MFU) are derived from the median;
* host syncs per step: ``aten::_local_scalar_dense`` and ``aten::equal`` in one profiled step (``torch.profiler``
  sees what compiled code dispatches too); on CUDA also the synchronizing calls ``torch.cuda.set_sync_debug_mode``
  reports;
* peak memory of one step above its start: CUDA ``torch.cuda.max_memory_allocated``; on a CPU the peak of torch's
  CPU allocator from the profiler's memory events (tensors only, not the process RSS);
* bytes saved for backward by one forward (``saved_tensors_hooks``; eager variants only: a compiled graph decides
  itself what to save, which its peak memory shows), in all and by the Linear layers alone;
* graph breaks and graphs compiled during the warm-up, and recompilations (new graphs) and graph breaks after it,
  from ``torch._dynamo``'s counters.

Model FLOPs per step (for MFU): ``6 * linear_params * tokens`` plus causal attention ``6 * blocks * batch * seq**2 *
hidden`` (QK^T and PV, forward and backward, half the square for the causal mask). MFU divides the achieved model
FLOP/s by the GPU's dense peak: the bf16 peak for bf16, the FP8 peak for the FP8 variants (``--peak-bf16-tflops``,
``--peak-fp8-tflops`` override the built-in table of NVIDIA's datasheet values).

The raw numbers go to ``benchmarks/results/llama.json`` (with the machine, the versions and the load), the plot of
the step-time ratios to ``docs/assets/llama_step_time.png``; ``python benchmarks/docs_tables.py`` renders the tables
(``benchmarks/results/tables/llama_*.md``) from the JSON. On a CPU the FP8 GEMMs are emulated: see
``docs/benchmarks.md`` for what the CPU ratios mean.

Under a time limit (``timeout``, which sends ``SIGTERM``), the script stops where it is and still writes the result
file, plot and tables with what it measured: the file then has ``"stopped"`` (when, and which sizes were not run),
each variant timed in the rounds completed keeps that timing, and the others say where the run stopped. It exits
with status 1 then.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8 as lf
from lightning_fp8.recipe import RECIPES
from lightning_fp8.state import state_tables

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

logging.getLogger("torchao").setLevel(logging.ERROR)  # torchao warns about its CUDA-only extensions on import

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(HERE, "results", "llama.json")
DEFAULT_PLOT = os.path.join(os.path.dirname(HERE), "docs", "assets", "llama_step_time.png")
#: Compile seconds (first steps of each compiled variant) per size after which the remaining ones are skipped.
COMPILE_BUDGET_S = 1800.0


# ------------------------------------------------------------------------------------------------- sizes


@dataclasses.dataclass(frozen=True)
class Size:
    """One model size: a stack of ``blocks`` decoder blocks and a step of ``batch`` sequences of ``seq`` tokens."""

    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    blocks: int
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def linear_params(self) -> int:
        """Weights of the Linear layers (the ones FP8 converts)."""
        kv = self.kv_heads * self.head_dim
        return self.blocks * (2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.ffn)

    @property
    def model_flops(self) -> float:
        """Model FLOPs of one training step: the Linear GEMMs (forward and two backward) and causal attention."""
        return 6.0 * self.linear_params * self.tokens + 6.0 * self.blocks * self.batch * self.seq**2 * self.hidden


SIZES: dict[str, Size] = {
    # the default: affordable on a CPU without bf16 matrix units, where a bf16 matmul runs at about 1 GFLOP/s
    "tiny": Size("tiny", hidden=128, ffn=448, heads=4, kv_heads=1, blocks=2, batch=2, seq=128),
    "small": Size("small", hidden=256, ffn=896, heads=4, kv_heads=1, blocks=2, batch=2, seq=128),
    # --large (a GPU): Llama-3.2-1B-shaped and Llama3-8B-shaped blocks, 8192 tokens per step
    "llama3.2-1b": Size("llama3.2-1b", hidden=2048, ffn=8192, heads=32, kv_heads=8, blocks=4, batch=2, seq=4096),
    "llama3-8b": Size("llama3-8b", hidden=4096, ffn=14336, heads=32, kv_heads=8, blocks=4, batch=1, seq=8192),
    # the test suite's
    "test": Size("test", hidden=64, ffn=128, heads=2, kv_heads=1, blocks=1, batch=1, seq=32),
}
DEFAULT_SIZES = ("tiny", "small")
LARGE_SIZES = ("llama3.2-1b", "llama3-8b")


# ------------------------------------------------------------------------------------------------- model


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (the rotate-half form) of ``x`` (batch, heads, seq, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings; q, k, v, o projections without bias."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = size.heads, size.kv_heads, size.head_dim
        self.wq = nn.Linear(size.hidden, size.heads * size.head_dim, bias=False)
        self.wk = nn.Linear(size.hidden, size.kv_heads * size.head_dim, bias=False)
        self.wv = nn.Linear(size.hidden, size.kv_heads * size.head_dim, bias=False)
        self.wo = nn.Linear(size.heads * size.head_dim, size.hidden, bias=False)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, size.head_dim, 2).float() / size.head_dim))  # Llama 3's theta
        angles = torch.outer(torch.arange(size.seq).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:s], self.sin[:s]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``, without bias."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.w1 = nn.Linear(size.hidden, size.ffn, bias=False)
        self.w3 = nn.Linear(size.hidden, size.ffn, bias=False)
        self.w2 = nn.Linear(size.ffn, size.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    """Pre-norm Llama block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(size.hidden, eps=1e-5)
        self.attention = Attention(size)
        self.ffn_norm = nn.RMSNorm(size.hidden, eps=1e-5)
        self.feed_forward = SwiGLU(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


def make_stack(size: Size, device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(DecoderBlock(size) for _ in range(size.blocks))).to(device)


# ------------------------------------------------------------------------------------------------- variants

TORCHAO_RECIPES = ("tensorwise", "rowwise")
KINDS: tuple[str, ...] = ("bf16", *(f"torchao-{r}" for r in TORCHAO_RECIPES), *(f"ours-{r}" for r in RECIPES))
#: The compiled variants in the order they are compiled (the references first: the budget may skip the last ones).
COMPILE_ORDER: tuple[str, ...] = ("bf16", "torchao-tensorwise", "torchao-rowwise", "ours-tensorwise", "ours-rowwise",
                                  "ours-delayed", "ours-mxfp8", "ours-blockwise")


#: The suffix of a variant of ours whose steps do not count (``ours-tensorwise:uncounted``): each step runs inside
#: ``fp8_autocast(count_statistics=False)``, what the plugins' ``statistics_every_n_steps=n`` runs on the ``n - 1``
#: steps between two counting steps (amaxes and scales recorded, no counters or histograms). With the counting
#: variant in the same run, a step of ``statistics_every_n_steps=n`` costs ``(counted + (n - 1) * uncounted) / n``.
UNCOUNTED = ":uncounted"


def base_kind(kind: str) -> str:
    """``kind`` without :data:`UNCOUNTED`: the variant whose conversion it shares."""
    return kind.removesuffix(UNCOUNTED)


def valid_kind(kind: str) -> bool:
    """A variant of :data:`KINDS`, or one of ours with :data:`UNCOUNTED`."""
    base = base_kind(kind)
    return base in KINDS and (base == kind or base.startswith("ours-"))


def variant_name(kind: str) -> str:
    if kind == "bf16":
        return "bf16 autocast"
    source, recipe = base_kind(kind).split("-", 1)
    name = f"torchao {recipe}" if source == "torchao" else f"ours {recipe}"
    return name + (", steps not counting" if kind != base_kind(kind) else "")


def fp8_hardware(device: str) -> bool:
    """Whether ``device`` has FP8 tensor cores (CUDA compute capability 8.9+)."""
    return torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def torchao_available() -> str | None:
    """``None`` if torchao's float8 training imports, else why not."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as err:  # noqa: BLE001 - whatever keeps it from importing: its variants are left out
        return f"{type(err).__name__}: {err}"
    return None


@dataclasses.dataclass
class Variant:
    key: str  #: ``kind`` or ``kind+compile``
    kind: str
    model: nn.Module  #: the converted copy (its Parameters are the base model's)
    module: nn.Module  #: ``model``, ``torch.compile(model)``, or ``model`` with each block compiled in its place
    fp8: bool  #: ours: inside ``fp8_autocast`` and rolled after each step
    device: str
    scope: str | None = None  #: what was compiled: ``model``, ``blocks`` (see :func:`compile_in_scope`), or nothing
    count_statistics: bool = True  #: ours: the casts count (``fp8_autocast(count_statistics=...)``)

    @property
    def compiled(self) -> bool:
        return self.scope is not None

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16))
            if self.fp8:
                stack.enter_context(lf.fp8_autocast(defer_amax_history_roll=True, count_statistics=self.count_statistics))
            yield

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.context():
            return self.module(x)


#: What ``--compile-scope`` compiles: the whole stack, or each block on its own (torchtitan's way: identical blocks
#: share one graph, so the compile costs about one block's whatever the depth; no fusion across a block boundary).
COMPILE_SCOPES = ("model", "blocks")


def compile_in_scope(model: nn.Sequential, scope: str, backend: str) -> nn.Module:
    """The module to call for ``model`` compiled as ``scope`` says: ``torch.compile(model)`` (``model``), or ``model``
    itself with each block replaced by its compiled self (``blocks``)."""
    if scope == "model":
        return torch.compile(model, backend=backend)
    if scope == "blocks":
        for i, block in enumerate(model):
            model[i] = torch.compile(block, backend=backend)
        return model
    raise ValueError(f"unknown compile scope {scope!r}; choose from {COMPILE_SCOPES}")


def build_variant(kind: str, base: nn.Module, device: str, compile_backend: str | None,
                  scope: str = "model") -> Variant:
    """A copy of ``base`` whose modules are new but whose Parameters are ``base``'s, converted for ``kind`` and, with
    ``compile_backend``, compiled as ``scope`` says (:func:`compile_in_scope`)."""
    if not valid_kind(kind):
        raise ValueError(f"unknown variant {kind!r}")
    counted, kind = kind == base_kind(kind), base_kind(kind)
    model = copy.deepcopy(base, memo={id(p): p for p in base.parameters()})
    fp8 = False
    if kind.startswith("torchao-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(kind.split("-", 1)[1])
        if not fp8_hardware(device):
            config = dataclasses.replace(config, emulate=True)  # torchao's only path without FP8 tensor cores
        convert_to_float8_training(model, config=config)
    elif kind.startswith("ours-"):
        report = lf.convert_to_fp8(model, recipe=kind.split("-", 1)[1], log_summary=False)
        assert report.converted and not report.skipped, report.summary()
        fp8 = True
    shared = {id(p) for p in base.parameters()}
    assert all(id(p) in shared for p in model.parameters()), f"{kind}: the conversion replaced Parameters"
    module = compile_in_scope(model, scope, compile_backend) if compile_backend else model
    kind = kind if counted else kind + UNCOUNTED
    return Variant(f"{kind}+compile" if compile_backend else kind, kind, model, module, fp8, device,
                   scope if compile_backend else None, count_statistics=counted)


def forward_backward(variant: Variant, x: torch.Tensor) -> None:
    """The forward and the backward of the benchmark's loss (a step without its optimizer step)."""
    out = variant.forward(x)
    out.float().pow(2).mean().backward()  # outside autocast, as Lightning's backward


def make_step(variant: Variant, x: torch.Tensor, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """One training step of ``variant``."""
    tables = state_tables(variant.model) if variant.fp8 else []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        forward_backward(variant, x)
        optimizer.step()
        if tables:
            lf.roll_amax_history(tables)  # once per optimizer step, as FP8Precision does

    return step


#: The largest relative difference (norm of the difference over the reference's norm, over all parameters) of a
#: compiled variant's gradients from its eager twin's that still counts as the same training: two FP8 runs differ by
#: their roundings (a few percent), a broken one by about 1 (zeros) or more.
GRADIENT_TOLERANCE = 0.25


def _gradients(variant: Variant, x: torch.Tensor, params: list[nn.Parameter],
               optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    optimizer.zero_grad(set_to_none=True)
    forward_backward(variant, x)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
    optimizer.zero_grad(set_to_none=True)
    return grads


def gradient_check(variant: Variant, reference: Variant, x: torch.Tensor, params: list[nn.Parameter],
                   optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The gradients of one step of ``variant`` against ``reference``'s on the same weights and batch (no optimizer
    step, the FP8 states as they are): ``relative_difference`` = ||g - r|| / ||r|| over all parameters (``inf`` when
    ``g`` is not finite), and the parameters whose gradient is zero where the reference's is not."""
    ref = _gradients(reference, x, params, optimizer)
    got = _gradients(variant, x, params, optimizer)
    diff = sum(float((g.double() - r.double()).pow(2).sum()) for g, r in zip(got, ref)) ** 0.5
    norm = sum(float(r.double().pow(2).sum()) for r in ref) ** 0.5
    finite = all(bool(torch.isfinite(g).all()) for g in got)
    zero = sum(1 for g, r in zip(got, ref) if not g.any() and r.any())
    return {"reference": reference.key, "relative_difference": diff / norm if finite and norm else float("inf"),
            "zero_gradients": zero, "parameters": len(params)}


# ------------------------------------------------------------------------------------------------- GPU peaks

#: Dense (no sparsity) peak TFLOP/s from NVIDIA's datasheets: (bf16, fp8), matched against the device name in order.
GPU_PEAK_TFLOPS: tuple[tuple[str, tuple[float, float | None]], ...] = (
    ("H100 PCIe", (756.0, 1513.0)),
    ("H100 NVL", (835.0, 1670.0)),
    ("H100", (989.4, 1978.9)),  # SXM
    ("H800", (989.4, 1978.9)),
    ("H200", (989.4, 1978.9)),
    ("L40S", (362.05, 733.0)),
    ("L4", (121.0, 242.5)),
    ("A100", (312.0, None)),
)


def gpu_peaks(device: str, bf16: float | None, fp8: float | None) -> dict[str, Any]:
    """The dense peaks MFU divides by (FLOP/s), and where they come from."""
    if torch.device(device).type != "cuda":
        return {"bf16": None, "fp8": None, "source": "no GPU: no MFU"}
    name = torch.cuda.get_device_name(device)
    table = next((peaks for key, peaks in GPU_PEAK_TFLOPS if key in name), (None, None))
    source = f"{name}: " + ("NVIDIA datasheet, dense" if table[0] else "not in the built-in table")
    if bf16 or fp8:
        source += "; overridden on the command line"
    bf16 = bf16 or table[0]
    fp8 = fp8 or table[1]
    return {"bf16": bf16 * 1e12 if bf16 else None, "fp8": fp8 * 1e12 if fp8 else None, "source": source}


# ------------------------------------------------------------------------------------------------- measuring


def _linear_depth(model: nn.Module) -> tuple[Callable[[], str], list[Any]]:
    """``where()`` for ``harness.saved_tensor_bytes``: ``"linear"`` while a Linear layer's forward runs (ours,
    torchao's and ``nn.Linear`` all subclass it), else ``"other"``; and the hook handles to remove."""
    depth = [0]

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    handles = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    return (lambda: "linear" if depth[0] else "other"), handles


def saved_for_backward(variant: Variant, x: torch.Tensor, x2: torch.Tensor, params: list[nn.Parameter]) -> dict[str, int]:
    """Bytes saved for backward by one forward of ``x`` and of ``x2`` (twice the batch), in all and by the Linear
    layers: ``saved_bytes``, ``saved_bytes_linear`` (at ``x``); ``activation_bytes``, ``activation_bytes_linear``
    (the part that grows with the tokens: at ``x2`` minus at ``x``); ``fixed_bytes``, ``fixed_bytes_linear`` (the part
    that does not: the weights' bf16 or FP8 copies)."""
    where, handles = _linear_depth(variant.model)
    try:
        counts = []
        for inp in (x, x2):
            buckets, out = harness.saved_tensor_bytes(lambda inp=inp: variant.forward(inp), params, where)
            del out
            counts.append((sum(buckets.values()), buckets.get("linear", 0)))
    finally:
        for h in handles:
            h.remove()
    (total, linear), (total2, linear2) = counts
    return {"saved_bytes": total, "saved_bytes_linear": linear,
            "activation_bytes": total2 - total, "activation_bytes_linear": linear2 - linear,
            "fixed_bytes": 2 * total - total2, "fixed_bytes_linear": 2 * linear - linear2}


#: Why a variant compiled with ``backend="eager"`` (dynamo alone) has no compiled ``saved_bytes``.
SAVED_UNMEASURED_EAGER_BACKEND = ("not measured: under backend 'eager' the tensors that dynamo's traced "
                                  "autograd.Functions save bypass saved_tensors_hooks")


def saved_for_backward_compiled(variant: Variant, x: torch.Tensor, params: list[nn.Parameter]) -> dict[str, int]:
    """Bytes a compiled variant saves for backward in one forward of ``x``: ``saved_bytes`` (what the compiled graphs
    keep, after the partitioner chose what to save and what to recompute in the backward). In all only: the split of
    :func:`saved_for_backward` needs a forward at twice the batch, which would compile the variant again, and module
    hooks, which change what dynamo guards on. ``saved_tensors_hooks`` cause no recompilation (the recompilation count
    after warm-up, measured over the timed steps after this, checks it). Needs a backend that goes through
    AOTAutograd (inductor, aot_eager), whose compiled function saves everything with ``save_for_backward``: under
    ``backend="eager"`` what the ``autograd.Function`` calls that dynamo traces save (our FP8 copies) bypasses the
    hooks."""
    buckets, out = harness.saved_tensor_bytes(lambda: variant.forward(x), params)
    del out
    return {"saved_bytes": sum(buckets.values())}


def failure(err: BaseException) -> tuple[str, str]:
    """A variant's failure: the status (type and first line of the message, for the tables) and the detail for the
    result file and the log: the lines of a longer message that name a kernel or an error (an inductor error from a
    compile worker says only "An exception occurred in a subprocess:" on its first line)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    status = f"failed: {type(err).__name__}: {lines[0][:200] if lines else ''}"
    detail = [line for line in lines[1:] if line.startswith("Name=") or re.match(r"[\w.]*(Error|Exception)\b", line)]
    return status, " | ".join(dict.fromkeys(detail))[:1000]


def measure_size(size: Size, kinds: tuple[str, ...], device: str, compile_backend: str | None, warmup: int,
                 reps: int, budget_s: float, peaks: dict[str, Any], log: Callable[[str], None] = print,
                 compile_kinds: tuple[str, ...] | None = None, compile_scope: str = "model") -> dict[str, Any]:
    """Every variant of ``kinds`` and, with ``compile_backend``, each of ``compile_kinds`` (default: all) compiled, on
    one size: the numbers of the JSON."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    base = make_stack(size, device)
    params = list(base.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
    x = torch.randn(size.batch, size.seq, size.hidden, device=device)
    results: dict[str, dict[str, Any]] = {}
    variants: dict[str, Variant] = {}
    steps: dict[str, Callable[..., None]] = {}

    def entry(kind: str, compiled: bool) -> dict[str, Any]:
        recipe = base_kind(kind).split("-", 1)[1] if "-" in kind else None
        path = lf.gemm_path(device, recipe) if kind.startswith("ours-") else (
            "native" if fp8_hardware(device) else "emulated") if kind.startswith("torchao-") else "bf16"
        return {"kind": kind, "name": variant_name(kind) + (" + compile" if compiled else ""), "compiled": compiled,
                "status": "measured", "gemm_path": path}

    spent = 0.0
    changes: dict[str, dict[str, int]] = {}  # graphs and graph breaks after warm-up, per compiled variant
    last_log = ["setting up"]  # where the run is: for the variants that a stop leaves unmeasured

    def note(message: str) -> None:
        last_log[0] = message
        log(message)

    def summary() -> dict[str, Any]:
        return {"size": {**dataclasses.asdict(size), "tokens": size.tokens, "linear_params": size.linear_params,
                         "model_flops": size.model_flops},
                "compile_budget_s": budget_s if compile_kinds else None, "compile_spent_s": spent,
                "variants": results}

    def record_timings(timing: dict[str, harness.Timing]) -> None:
        for key, t in timing.items():
            r = results[key]
            r.update(median_s=t.median, fastest_s=t.fastest, slowest_s=max(t.walls), cpu_s=t.cpu, times=t.walls)
            r["tokens_per_s"] = size.tokens / t.median
            r["model_tflops"] = size.model_flops / t.median / 1e12
            peak = peaks["fp8"] if r["kind"] != "bf16" else peaks["bf16"]
            r["mfu"] = size.model_flops / t.median / peak if peak else None
            if r["compiled"]:
                r["recompiles_after_warmup"] = changes[key]["graphs"]
                r["graph_breaks_after_warmup"] = changes[key]["graph_breaks"]

    try:
        for kind in kinds:
            results[kind] = entry(kind, False)
            try:
                variants[kind] = build_variant(kind, base, device, None)
            except Exception as err:  # noqa: BLE001 - report it, do not abort the run
                results[kind]["status"], results[kind]["error"] = failure(err)
                continue
            steps[kind] = make_step(variants[kind], x, optimizer)
        wanted = kinds if compile_kinds is None else compile_kinds
        compile_kinds = tuple(sorted((k for k in dict.fromkeys(wanted) if k in variants), key=lambda k: (
            COMPILE_ORDER.index(base_kind(k)), k))) if compile_backend else ()
        if compile_kinds:
            torch._dynamo.reset()  # one size at a time: the stack's code objects are shared by all compiled variants
            # every compiled variant is a cache entry of the same code objects: room for all, and one recompilation each
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(compile_kinds))
            if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
                torch._dynamo.config.accumulated_recompile_limit = max(
                    torch._dynamo.config.accumulated_recompile_limit, 16 * len(compile_kinds))

        # warm-up: eager variants, then each compiled one (compiled while it warms up, within the budget)
        for kind, step in list(steps.items()):
            note(f"{size.name}: warm-up {kind}")
            try:
                for _ in range(warmup):
                    step()
            except Exception as err:  # noqa: BLE001 - report it, do not abort the run
                results[kind]["status"], results[kind]["error"] = failure(err)
                note(f"{size.name}: {kind} {results[kind]['status']} {results[kind]['error']}")
                del steps[kind], variants[kind]
        for kind in compile_kinds:
            key = f"{kind}+compile"
            results[key] = info = entry(kind, True)
            if spent > budget_s:
                info["status"] = f"skipped: compile budget of {budget_s:.0f} s used up ({spent:.0f} s)"
                note(f"{size.name}: {key} {info['status']}")
                continue
            note(f"{size.name}: compiling {key}")
            variant = build_variant(kind, base, device, compile_backend, compile_scope)
            step = make_step(variant, x, optimizer)
            from torch._dynamo.utils import counters

            before, reasons0 = harness.dynamo_counts(), dict(counters["graph_break"])
            caches0 = {k: dict(counters[k]) for k in ("inductor", "aot_autograd")}
            phases0 = harness.compile_phase_seconds()
            t0 = time.perf_counter()
            try:
                step()
                if cuda:
                    torch.cuda.synchronize(device)
                info["first_step_s"] = time.perf_counter() - t0
                phases1 = harness.compile_phase_seconds()
                info["compile_phases_s"] = {k: phases1[k] - phases0[k] for k in phases1}
                for _ in range(warmup - 1):
                    step()
                if cuda:
                    torch.cuda.synchronize(device)
            except Exception as err:  # noqa: BLE001 - report it, do not abort the run
                info["status"], info["error"] = failure(err)
                note(f"{size.name}: {key} {info['status']} {info['error']}")
                continue
            info["warmup_s"] = time.perf_counter() - t0
            spent += info["warmup_s"]
            after = harness.dynamo_counts()
            info["graphs"] = after["graphs"] - before["graphs"]
            info["graph_breaks"] = after["graph_breaks"] - before["graph_breaks"]
            info["graph_break_reasons"] = sorted(k for k, v in counters["graph_break"].items() if v > reasons0.get(k, 0))
            # inductor's and AOTAutograd's on-disk caches: a second run of the same shapes compiles from them
            info["compile_cache_hits"] = sum(counters[k][c] - caches0[k].get(c, 0) for k, c in (
                ("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit")))
            variants[key], steps[key] = variant, step

        # each compiled variant's gradients against its eager twin's (bf16's where the twin is not run), on the same
        # weights and batch: a compiled step that trains wrongly is not timed (torch 2.11 once gave our compiled layers
        # zero gradients, and the timing looked plausible)
        for key in [k for k in steps if variants[k].compiled]:
            kind = variants[key].kind
            reference = next((k for k in (kind, base_kind(kind), "bf16") if k in steps), None)
            if reference is None:
                continue
            note(f"{size.name}: checking the gradients of {key} against {reference}'s")
            check = gradient_check(variants[key], variants[reference], x, params, optimizer)
            results[key]["gradient_check"] = check
            note(f"{size.name}: {key} gradients against {reference}'s: relative difference "
                 f"{check['relative_difference']:.3g}")
            if check["zero_gradients"]:
                results[key]["status"] = (f"invalid: {check['zero_gradients']} of {check['parameters']} gradients zero "
                                          f"where {reference}'s are not")
            elif not check["relative_difference"] <= GRADIENT_TOLERANCE:
                results[key]["status"] = (f"invalid: gradients {check['relative_difference']:.2g} off {reference}'s "
                                          f"(tolerance {GRADIENT_TOLERANCE})")
            if results[key]["status"] != "measured":
                note(f"{size.name}: {key} {results[key]['status']}: not timed")
                del steps[key], variants[key]

        # one profiled step each: host syncs, aten ops, peak memory; the bytes saved for backward (eager: split by a
        # second batch size; compiled: in all)
        changes.update({key: {"graphs": 0, "graph_breaks": 0} for key in steps})

        def counted(key: str, fn: Callable[[], Any]) -> Callable[[], Any]:
            """``fn``, adding what dynamo compiles during the call to the key's count (after warm-up)."""

            def run() -> Any:
                c0 = harness.dynamo_counts()
                try:
                    return fn()
                finally:  # also when a stop cuts the call short: a recompilation it started still counts
                    c1 = harness.dynamo_counts()
                    changes[key]["graphs"] += c1["graphs"] - c0["graphs"]
                    changes[key]["graph_breaks"] += c1["graph_breaks"] - c0["graph_breaks"]

            return run

        x2 = torch.cat([x, torch.randn_like(x)])  # twice the batch: what grows with the tokens, and what does not
        for key, step in steps.items():
            note(f"{size.name}: profiling {key}")
            optimizer.zero_grad(set_to_none=True)  # the peak above the start: activations, gradients, temporaries
            prof = harness.profile_step(counted(key, step), device)
            results[key].update(syncs=prof.syncs, aten_ops=prof.aten_ops, peak_bytes=prof.peak_bytes,
                                peak_source=prof.peak_source, cuda_syncs=prof.cuda_syncs,
                                cuda_sync_sites=prof.cuda_sync_sites, fused_optimizer_reads=prof.fused_kernel_reads)
            if variants[key].compiled and compile_backend == "eager":
                results[key]["saved_bytes_unmeasured"] = SAVED_UNMEASURED_EAGER_BACKEND
            elif variants[key].compiled:
                results[key].update(saved_for_backward_compiled(variants[key], x, params))
            else:
                results[key].update(saved_for_backward(variants[key], x, x2, params))

        # the timed steps, interleaved across all variants
        def timed(key: str) -> Callable[[], None]:
            step = steps[key]

            def run() -> None:
                step()
                if cuda:
                    torch.cuda.synchronize(device)

            return counted(key, run)

        note(f"{size.name}: timing {len(steps)} variants, {reps} interleaved rounds")
        record_timings(harness.interleaved({key: timed(key) for key in steps}, rounds=reps, calls=1, warmup=0))
    except harness.Stopped as stop:
        # what was measured stays (a timing from the rounds completed); what was not says where the run was
        record_timings(stop.timings)
        for info in results.values():
            if info["status"] == "measured" and "median_s" not in info:
                info["status"] = f"not timed: run stopped by {stop} at \"{last_log[0]}\""
        stop.size_result = summary()
        raise
    return summary()


def run(sizes: list[Size], kinds: tuple[str, ...] = KINDS, device: str = "cpu", compile_backend: str | None = "inductor",
        warmup: int = 3, reps: int = 11, budget_s: float = COMPILE_BUDGET_S, peak_bf16: float | None = None,
        peak_fp8: float | None = None, log: Callable[[str], None] = print,
        compile_kinds: tuple[str, ...] | None = None, compile_scope: str = "model") -> dict[str, Any]:
    """Measure every size; the result file's numbers (without environment and command). ``compile_kinds``: the variants
    to compile too (default: all of ``kinds``); ``compile_scope``: see :func:`compile_in_scope`.

    Within :func:`harness.stop_on_signals` (as :func:`main` runs it), a ``SIGTERM`` ends the run early but still
    returns: the result then has ``"stopped"`` (why, when, which sizes were not run), the variants measured so far
    keep their numbers (a timing from the interleaved rounds completed), and the others have a status that says where
    the run was."""
    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"unknown compile scope {compile_scope!r}; choose from {COMPILE_SCOPES}")
    missing = torchao_available()
    if missing:
        kinds = tuple(k for k in kinds if not k.startswith("torchao-"))
    peaks = gpu_peaks(device, peak_bf16, peak_fp8)
    out: dict[str, Any] = {
        "device": device,
        "fp8_hardware": fp8_hardware(device),
        "config": {"kinds": list(kinds), "compile_backend": compile_backend, "compile_scope": compile_scope,
                   "warmup": warmup, "reps": reps,
                   "compile_budget_s": budget_s, "threads": torch.get_num_threads(),
                   "optimizer": "AdamW(lr=1e-5, weight_decay=0, fused=True), one over the shared parameters",
                   "autocast": "bfloat16", "recipes": list(RECIPES)},
        "torchao": missing or "measured",
        "peaks": peaks,
        "sizes": {},
    }
    limits = {name: getattr(torch._dynamo.config, name) for name in ("recompile_limit", "accumulated_recompile_limit")
              if hasattr(torch._dynamo.config, name)}
    t0 = time.perf_counter()
    done: list[str] = []
    try:
        for size in sizes:
            out["sizes"][size.name] = measure_size(size, kinds, device, compile_backend, warmup, reps, budget_s, peaks,
                                                   log, compile_kinds, compile_scope)
            done.append(size.name)
        out["load_average_end"] = harness.load_average()
    except harness.Stopped as stop:  # keep what was measured: the sizes done and this one's variants so far
        current = next((s for s in sizes if s.name not in done), None)
        if current is not None and getattr(stop, "size_result", None) is not None:
            out["sizes"][current.name] = stop.size_result
        left = [s.name for s in sizes if s.name not in done and s is not current]
        out["stopped"] = (f"stopped by {stop} after {time.perf_counter() - t0:.0f} s"
                          + (f", measuring {current.name}" if current is not None else ", after the last size")
                          + (f"; not run: {', '.join(left)}" if left else ""))
        log(f"{out['stopped']}: writing what was measured")
    finally:  # measure_size raises them for its compiled variants
        for name, value in limits.items():
            setattr(torch._dynamo.config, name, value)
    return out


# ------------------------------------------------------------------------------------------------- plot


def plot(data: dict[str, Any], path: str) -> None:
    """Step time of each variant as a ratio to bf16 and to torchao tensorwise (same mode: eager to eager, compiled to
    compiled), one row of panels per size; log scale, bars from 1 (the reference), each labelled with its ratio."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter

    sizes = list(data["sizes"])
    if not sizes:  # a run stopped before its first size was measured
        print(f"no plot: no size was measured ({data.get('stopped', 'empty result')})", file=sys.stderr)
        return
    fig, axes = plt.subplots(len(sizes), 2, figsize=(12, 0.7 + 3.4 * len(sizes)), squeeze=False)
    for row, name in enumerate(sizes):
        variants = data["sizes"][name]["variants"]
        size = data["sizes"][name]["size"]
        kinds = [k for k in data["config"]["kinds"] if "median_s" in variants.get(k, {})]
        for col, ref in enumerate(("bf16", "torchao-tensorwise")):
            ax = axes[row][col]
            values = []
            for j, (suffix, label, color) in enumerate((("", "eager", "#7b68ee"), ("+compile", "compiled", "#ff8c00"))):
                base = variants.get(ref + suffix, {}).get("median_s")
                ys, vals = [], []
                for i, kind in enumerate(kinds):
                    t = variants.get(kind + suffix, {}).get("median_s")
                    if t and base:
                        ys.append(i + (j - 0.5) * 0.4)
                        vals.append(t / base)
                ax.barh(ys, [v - 1 for v in vals], left=1, height=0.4, color=color, label=label)
                for y, v in zip(ys, vals):
                    ax.annotate(f"{v:.2f}", (v, y), xytext=(3 if v >= 1 else -3, 0), textcoords="offset points",
                                ha="left" if v >= 1 else "right", va="center", fontsize=7)
                values += vals
            ax.axvline(1.0, color="black", lw=0.8)
            ax.set_xscale("log")
            low, high = min(values + [1.0]), max(values + [1.0])
            ax.set_xlim(low / 1.6, high * 1.6)
            ticks = [2.0**k for k in range(-8, 9) if low / 1.6 <= 2.0**k <= high * 1.6]
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_yticks(range(len(kinds)), [variant_name(k) for k in kinds])
            ax.invert_yaxis()
            ax.set_xlabel(f"step time ÷ {variant_name(ref)}'s, same mode (< 1: faster)", fontsize=9)
            blocks = f"{size['blocks']} block" + ("s" if size["blocks"] != 1 else "")
            ax.set_title(f"{name}: {blocks}, hidden {size['hidden']}, {size['tokens']} tokens per step", fontsize=9)
            ax.grid(axis="x", alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    env = data["environment"]
    where = env.get("device", f"CPU ({env.get('cpu', '')}), emulated FP8 GEMMs")
    fig.suptitle(f"Llama-style blocks, ratios of the median step times: {where}; {env.get('date', '')}, "
                 f"torch {env.get('torch')}, torchao {env.get('torchao')}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- main


def fresh_compile_cache() -> str:
    """Point inductor's (and Triton's) on-disk caches at a new empty directory, for this process: every variant then
    compiles cold, so compile times compare like for like (otherwise a variant whose code did not change since an
    earlier run, such as torchao's, compiles from the cache). Returns the directory, which is removed when the process
    exits (a cold cache of this benchmark holds about a hundred MB)."""
    path = tempfile.mkdtemp(prefix="bench_llama_compile_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")
    return path


def command_line(args: argparse.Namespace) -> str:
    """The command, for the result file: the flags that were given."""
    parts = ["python benchmarks/bench_llama.py"]
    if args.large:
        parts.append("--large")
    if args.sizes:
        parts += ["--sizes", args.sizes]
    if args.no_compile:
        parts.append("--no-compile")
    if args.cold_compile:
        parts.append("--cold-compile")
    for flag, value in (("--kinds", args.kinds), ("--compile-kinds", args.compile_kinds)):
        if value:
            parts += [flag, value]
    for flag, value, default in (("--threads", args.threads, 0), ("--warmup", args.warmup, 3), ("--reps", args.reps, 11),
                                 ("--compile-budget", args.compile_budget, COMPILE_BUDGET_S),
                                 ("--backend", args.backend, "inductor"), ("--compile-scope", args.compile_scope, "model")):
        if value != default:
            parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--large", action="store_true",
                        help=f"the large sizes ({', '.join(LARGE_SIZES)}; Llama3-8B-shaped: hidden 4096, FFN 14336, "
                             "32 heads, 8 KV heads, 8192 tokens per step): a GPU")
    parser.add_argument("--sizes", default="", help=f"comma-separated sizes of {', '.join(SIZES)} "
                                                   f"(default {','.join(DEFAULT_SIZES)})")
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    parser.add_argument("--kinds", default="", help=f"comma-separated variants of {', '.join(KINDS)} (default: all); "
                                                   f"ours also as ours-<recipe>{UNCOUNTED}: steps that do not count")
    parser.add_argument("--compile-kinds", default="",
                        help="comma-separated variants to compile too (default: all of --kinds, in the order "
                             f"{', '.join(COMPILE_ORDER)})")
    parser.add_argument("--compile-budget", type=float, default=COMPILE_BUDGET_S,
                        help="compile seconds per size after which the remaining compiled variants are skipped "
                             f"(default {COMPILE_BUDGET_S:.0f})")
    parser.add_argument("--cold-compile", action="store_true",
                        help="compile every variant without the on-disk caches of earlier runs (a new empty cache "
                             "directory), so that compile times compare like for like")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--compile-scope", default="model", choices=COMPILE_SCOPES,
                        help="compile the whole stack (model, default) or each block on its own (blocks, torchtitan's "
                             "way: identical blocks share one graph, so compiling costs about one block's)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant (default 3)")
    parser.add_argument("--reps", type=int, default=11, help="timed steps per variant, interleaved (default 11)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device (default: cuda if available, else cpu)")
    parser.add_argument("--peak-bf16-tflops", type=float, default=None, help="dense bf16 peak of the GPU, for MFU")
    parser.add_argument("--peak-fp8-tflops", type=float, default=None, help="dense FP8 peak of the GPU, for MFU")
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"result file (default {os.path.relpath(DEFAULT_JSON)})")
    parser.add_argument("--plot", default=DEFAULT_PLOT, help=f"plot file (default {os.path.relpath(DEFAULT_PLOT)})")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the result file")
    args = parser.parse_args(argv)

    if args.replot:
        with open(args.json) as f:
            plot(json.load(f), args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
        return 0
    names = args.sizes.split(",") if args.sizes else list(LARGE_SIZES if args.large else DEFAULT_SIZES)
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
    compile_kinds = tuple(args.compile_kinds.split(",")) if args.compile_kinds else None
    bad = [k for k in kinds + (compile_kinds or ()) if not valid_kind(k)]
    if bad or any(k not in kinds for k in compile_kinds or ()):
        parser.error(f"unknown or unselected variant(s) {bad or list(compile_kinds or ())}; choose from {list(KINDS)}"
                     f" (ours also as ours-<recipe>{UNCOUNTED})")
    if args.threads:
        torch.set_num_threads(args.threads)
    env = harness.environment(args.device)
    if args.cold_compile:
        fresh_compile_cache()
    t_start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f} s] {message}", file=sys.stderr, flush=True)

    # under `timeout`: a SIGTERM stops the measuring and the result is still written; the signals stay handled (a
    # second one ignored) until the result file is
    with harness.stop_on_signals():
        try:
            data = run([SIZES[n] for n in names], kinds, args.device, None if args.no_compile else args.backend,
                       args.warmup, args.reps, args.compile_budget, args.peak_bf16_tflops, args.peak_fp8_tflops, log,
                       compile_kinds, args.compile_scope)
        except harness.Stopped as stop:  # before the first size began: nothing measured, nothing to write
            print(f"stopped by {stop} before anything was measured", file=sys.stderr)
            return 1
        data["total_s"] = time.perf_counter() - t_start
        data["config"]["cold_compile"] = args.cold_compile
        harness.write_result(args.json, env, command_line(args), **data)
    with open(args.json) as f:
        data = json.load(f)
    plot(data, args.plot)
    import docs_tables

    for name, text in docs_tables.llama_tables(data).items():
        print(f"\n<!-- {name} -->\n{text}")
    print(f"\nwritten to {args.json} and {args.plot} in {data['total_s']:.0f} s; "
          "render the docs tables with python benchmarks/docs_tables.py", file=sys.stderr)
    if "stopped" in data:
        print(f"incomplete: {data['stopped']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
