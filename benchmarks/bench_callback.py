#!/usr/bin/env python
"""Benchmark the cost of FP8StatsCallback in a real Lightning Trainer (CPU, ``FP8Precision()``).

Usage::

    python benchmarks/bench_callback.py [--quick] [--out benchmarks/RESULTS_callback.md]

Model: ``tests/models.py``'s ``TinyDecoder`` (byte-level decoder-only transformer; every Linear layer of
the blocks and the LM head runs in FP8), AdamW, a ``CSVLogger``, no progress bar, no checkpointing.

Sections (all numbers from this one process):

1. per-step time without the callback vs with it on *non-logging* steps (Trainer
   ``log_every_n_steps=1000``, so no step logs): overhead in %, with a hierarchical bootstrap
   interval; plus the callback's own hook time on those steps, measured directly;
2. the extra time of a *logging* step (``FP8StatsCallback(log_every_n_steps=1)`` vs the non-logging
   run), in ms and as a fraction of a step, with a breakdown of where that time goes;
3. device-to-host synchronisations (``aten._local_scalar_dense``, counted under a
   ``TorchDispatchMode``) and aten ops inside the callback's hooks, on logging and non-logging steps,
   and for whole training steps;
4. one-time costs (baseline read at train start, summary table and heatmap PNG at the end of fit).

A step time is the interval between two consecutive ``on_train_batch_start`` calls: it covers the
forward, backward, optimizer step, every ``on_train_batch_end`` hook, Lightning's own logging and
the fetch of the next batch. Whole fits are interleaved: every round runs each variant once, in a
rotated order, so that load drift on a shared machine hits all variants alike.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import logging
import math
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # bench_linear (environment table)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # models.TinyDecoder

logging.getLogger("torchao").setLevel(logging.ERROR)

import lightning as L
from harness import environment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from models import ByteWindows, TinyDecoder, stdlib_bytes

from lightning_fp8 import FP8Precision, FP8StatsCallback

DEFAULT_OUT = os.path.join(HERE, "RESULTS_callback.md")
TARGET_PCT = 2.0  # issue: < 2 % on non-logging steps
# Ops that read a device value on the host (the test suite's SyncCounter uses the same set).
SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal"}
HOOKS = ("on_train_start", "on_train_batch_end", "on_fit_end")  # the hooks FP8StatsCallback implements


# --------------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class Config:
    quick: bool
    dim: int = 128
    heads: int = 4
    layers: int = 2
    seq_len: int = 64
    batch: int = 8
    warmup: int = 10  # steps of every fit that are not timed
    steps: int = 100  # timed steps per fit (>= 100 so that one CSVLogger flush falls inside the window)
    rounds: int = 8  # every round fits every variant once
    sync_steps: int = 9
    sync_every: int = 3
    profile_logs: int = 20
    scale_layers: tuple[int, ...] = (2, 8)  # blocks of the TinyDecoder for the logging-hook scaling
    scale_steps: int = 12
    boot: int = 2000
    threads: int = 1


def make_config(quick: bool, threads: int) -> Config:
    if quick:
        return Config(quick=True, dim=64, seq_len=32, warmup=3, steps=20, rounds=2, profile_logs=5, boot=500,
                      threads=threads, scale_layers=(1, 4), scale_steps=5)
    return Config(quick=False, threads=threads)


@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    label: str
    callback: bool
    callback_every: int | None  # FP8StatsCallback(log_every_n_steps=...)
    trainer_every: int  # Trainer(log_every_n_steps=...)


VARIANTS = (
    Variant("none", "no FP8StatsCallback", False, None, 1000),
    Variant("none_b", "no FP8StatsCallback, second identical fit (A/A control)", False, None, 1000),
    Variant("nolog", "FP8StatsCallback, no logging step (Trainer log_every_n_steps=1000)", True, None, 1000),
    Variant("log", "FP8StatsCallback(log_every_n_steps=1): every step logs", True, 1, 1000),
    Variant("pl_log", "no FP8StatsCallback, Trainer log_every_n_steps=1 (Lightning logs train_loss every step)",
            False, None, 1),
)
VARIANT = {v.key: v for v in VARIANTS}


# --------------------------------------------------------------------------------------------------
# instrumentation


class StepTimer(Callback):
    """Wall and process-CPU clock at every ``on_train_batch_start``; consecutive differences are step times."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())


class DispatchCounter(TorchDispatchMode):
    """Counts aten ops, host reads of device values (``SYNC_OPS``) and device-to-host copies."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.d2h = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        if func._schema.name in SYNC_OPS:
            self.syncs += 1
        out = func(*args, **(kwargs or {}))
        if func._schema.name in ("aten::_to_copy", "aten::copy_"):
            src = args[1] if func._schema.name == "aten::copy_" else args[0]
            if (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.device.type != "cpu"
                    and out.device.type == "cpu"):
                self.d2h += 1
        return out


def wrap_hooks(callback: FP8StatsCallback, record: Callable[[str, Callable[[], Any], Any], Any]) -> None:
    """Replace the callback's hooks by instance attributes that call ``record(hook, call, trainer)``."""
    for hook in HOOKS:
        original = getattr(callback, hook)

        def wrapped(trainer: Any, *args: Any, _hook: str = hook, _original: Any = original) -> Any:
            return record(_hook, lambda: _original(trainer, *args), trainer)

        setattr(callback, hook, wrapped)


def quiet() -> None:
    warnings.filterwarnings("ignore")  # dataloader workers, logger directory reuse, ...
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fp8"):
        logging.getLogger(name).setLevel(logging.ERROR)


# --------------------------------------------------------------------------------------------------
# one fit


def make_loader(cfg: Config, steps: int) -> torch.utils.data.DataLoader:
    data = stdlib_bytes(10**7)
    need = steps * cfg.batch * cfg.seq_len + 1
    data = data.repeat(math.ceil(need / len(data)))
    ds = ByteWindows(data, cfg.seq_len)
    return torch.utils.data.DataLoader(ds, batch_size=cfg.batch, shuffle=False)


def make_trainer(cfg: Config, variant: Variant, root: str, steps: int, extra: list[Callback],
                 callback: FP8StatsCallback | None) -> L.Trainer:
    callbacks: list[Callback] = ([callback] if callback is not None else []) + extra
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[FP8Precision()],
        callbacks=callbacks,
        logger=CSVLogger(root, name=variant.key),
        max_steps=steps,
        log_every_n_steps=variant.trainer_every,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )


def make_model(cfg: Config, optimizer: str = "adamw") -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(dim=cfg.dim, heads=cfg.heads, layers=cfg.layers, seq_len=cfg.seq_len, optimizer=optimizer)


def timed_fit(cfg: Config, variant: Variant, root: str) -> dict[str, Any]:
    """One fit of ``warmup + steps + 1`` steps; returns the timed step intervals and the hook times."""
    total = cfg.warmup + cfg.steps + 1
    hook_times: list[tuple[str, int, bool, float, float]] = []  # hook, global_step, logged, wall s, CPU s
    callback = None
    if variant.callback:
        callback = FP8StatsCallback(log_every_n_steps=variant.callback_every)

        def record(hook: str, call: Callable[[], Any], trainer: Any) -> Any:
            before = callback.fetches
            c0, t0 = time.thread_time(), time.perf_counter()  # the hook runs in this thread
            out = call()
            t1, c1 = time.perf_counter(), time.thread_time()
            hook_times.append((hook, trainer.global_step, callback.fetches > before, t1 - t0, c1 - c0))
            return out

        wrap_hooks(callback, record)
    timer = StepTimer()
    trainer = make_trainer(cfg, variant, root, total, [timer], callback)
    t0 = time.perf_counter()
    trainer.fit(make_model(cfg), make_loader(cfg, total))
    fit_s = time.perf_counter() - t0
    assert len(timer.wall) == total, (len(timer.wall), total)
    lo, hi = cfg.warmup, cfg.warmup + cfg.steps  # interval i = start[i+1] - start[i]
    wall = [timer.wall[i + 1] - timer.wall[i] for i in range(lo, hi)]
    cpu = [timer.cpu[i + 1] - timer.cpu[i] for i in range(lo, hi)]
    # hooks of the timed window: on_train_batch_end of batch i runs with global_step == i + 1
    window = [x for x in hook_times if x[0] != "on_train_batch_end" or lo + 1 <= x[1] <= hi]
    logs = callback.fetches - 1 if callback is not None else 0  # minus the baseline read
    return {"wall": wall, "cpu": cpu, "hooks": window, "fit_s": fit_s, "logs": logs}


# --------------------------------------------------------------------------------------------------
# statistics


def hierarchical_bootstrap(a: list[list[float]], b: list[list[float]], n: int, seed: int = 0) -> tuple[float, float]:
    """95 % interval of median(a) / median(b), resampling rounds (paired) and then steps within them."""
    rng = random.Random(seed)
    rounds = len(a)
    ratios = []
    for _ in range(n):
        pick = [rng.randrange(rounds) for _ in range(rounds)]
        sa = [x for r in pick for x in rng.choices(a[r], k=len(a[r]))]
        sb = [x for r in pick for x in rng.choices(b[r], k=len(b[r]))]
        ratios.append(statistics.median(sa) / statistics.median(sb))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def diff_bootstrap(a: list[list[float]], b: list[list[float]], n: int, stat: Callable[[list[float]], float],
                   seed: int = 1) -> tuple[float, float]:
    """95 % interval of stat(a) - stat(b), same resampling as :func:`hierarchical_bootstrap`."""
    rng = random.Random(seed)
    rounds = len(a)
    diffs = []
    for _ in range(n):
        pick = [rng.randrange(rounds) for _ in range(rounds)]
        sa = [x for r in pick for x in rng.choices(a[r], k=len(a[r]))]
        sb = [x for r in pick for x in rng.choices(b[r], k=len(b[r]))]
        diffs.append(stat(sa) - stat(sb))
    diffs.sort()
    return diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]


def flat(rounds: list[list[float]]) -> list[float]:
    return [x for r in rounds for x in r]


# --------------------------------------------------------------------------------------------------
# 1 + 2: interleaved timed fits


def bench_timing(cfg: Config, root: str, stage: Callable[[str], None]) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {v.key: [] for v in VARIANTS}
    # one un-timed fit first: imports, allocator and thread-pool warm-up
    timed_fit(dataclasses.replace(cfg, warmup=2, steps=3), VARIANT["nolog"], os.path.join(root, "warm"))
    for r in range(cfg.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            res = timed_fit(cfg, variant, os.path.join(root, f"round{r}"))
            results[variant.key].append(res)
        meds = {k: statistics.median(v[-1]["wall"]) * 1e3 for k, v in results.items()}
        stage(f"   round {r + 1}/{cfg.rounds}: median ms/step " + ", ".join(f"{k} {m:.1f}" for k, m in meds.items()))
    return results


def analyse_timing(cfg: Config, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    wall = {k: [r["wall"] for r in v] for k, v in results.items()}
    cpu = {k: [r["cpu"] for r in v] for k, v in results.items()}
    out: dict[str, Any] = {"rows": {}}
    ref = statistics.median(flat(wall["none"]))
    ref_min = min(flat(wall["none"]))
    ref_cpu = statistics.median(flat(cpu["none"]))
    for v in VARIANTS:
        w = flat(wall[v.key])
        out["rows"][v.key] = {
            "label": v.label,
            "median": statistics.median(w),
            "min": min(w),
            "max": max(w),
            "mean": statistics.fmean(w),
            "cpu": statistics.median(flat(cpu[v.key])),
            "x_med": statistics.median(w) / ref,
            "x_min": min(w) / ref_min,
            "x_cpu": statistics.median(flat(cpu[v.key])) / ref_cpu,
            "logs": sum(r["logs"] for r in results[v.key]) / len(results[v.key]),
        }
    # (a) overhead of the callback on non-logging steps
    per_round = [statistics.median(a) / statistics.median(b) - 1 for a, b in zip(wall["nolog"], wall["none"])]
    per_round_cpu = [statistics.median(a) / statistics.median(b) - 1 for a, b in zip(cpu["nolog"], cpu["none"])]
    lo, hi = hierarchical_bootstrap(wall["nolog"], wall["none"], cfg.boot)
    clo, chi = hierarchical_bootstrap(cpu["nolog"], cpu["none"], cfg.boot)
    alo, ahi = hierarchical_bootstrap(wall["none_b"], wall["none"], cfg.boot)
    aclo, achi = hierarchical_bootstrap(cpu["none_b"], cpu["none"], cfg.boot)
    out["aa"] = {
        "wall": out["rows"]["none_b"]["x_med"] - 1, "wall_ci": (alo - 1, ahi - 1),
        "cpu": out["rows"]["none_b"]["x_cpu"] - 1, "cpu_ci": (aclo - 1, achi - 1),
        "per_round": [statistics.median(a) / statistics.median(b) - 1 for a, b in zip(wall["none_b"], wall["none"])],
        "per_round_cpu": [statistics.median(a) / statistics.median(b) - 1 for a, b in zip(cpu["none_b"], cpu["none"])],
    }
    hooks_nolog = [t for r in results["nolog"] for h, _, lg, t, _ in r["hooks"] if h == "on_train_batch_end" and not lg]
    hooks_nolog_cpu = [c for r in results["nolog"] for h, _, lg, _, c in r["hooks"]
                       if h == "on_train_batch_end" and not lg]
    out["core_share"] = ref_cpu / ref
    out["overhead"] = {
        "pooled": out["rows"]["nolog"]["x_med"] - 1,
        "ci": (lo - 1, hi - 1),
        "per_round": per_round,
        "per_round_cpu": per_round_cpu,
        "min": out["rows"]["nolog"]["x_min"] - 1,
        "cpu": out["rows"]["nolog"]["x_cpu"] - 1,
        "cpu_ci": (clo - 1, chi - 1),
        "hook_cpu_us_median": statistics.median(hooks_nolog_cpu) * 1e6 if hooks_nolog_cpu else float("nan"),
        "hook_cpu_pct": statistics.median(hooks_nolog_cpu) / ref_cpu * 100 if hooks_nolog_cpu else float("nan"),
        "hook_us_median": statistics.median(hooks_nolog) * 1e6 if hooks_nolog else float("nan"),
        "hook_us_max": max(hooks_nolog) * 1e6 if hooks_nolog else float("nan"),
        "hook_calls": len(hooks_nolog),
        "hook_pct": statistics.median(hooks_nolog) / ref * 100 if hooks_nolog else float("nan"),
    }
    # (b) extra time of a logging step
    med = statistics.median
    hooks_log = [t for r in results["log"] for h, _, lg, t, _ in r["hooks"] if h == "on_train_batch_end" and lg]
    hooks_log_cpu = [c for r in results["log"] for h, _, lg, _, c in r["hooks"] if h == "on_train_batch_end" and lg]
    per_round_log_cpu = [med(a) - med(b) for a, b in zip(cpu["log"], cpu["nolog"])]
    per_round_log = [med(a) - med(b) for a, b in zip(wall["log"], wall["nolog"])]
    per_round_pl = [med(a) - med(b) for a, b in zip(wall["pl_log"], wall["none"])]
    out["logging"] = {
        "median_ms": (med(flat(wall["log"])) - med(flat(wall["nolog"]))) * 1e3,
        "median_ci_ms": tuple(x * 1e3 for x in diff_bootstrap(wall["log"], wall["nolog"], cfg.boot, med)),
        "mean_ms": (statistics.fmean(flat(wall["log"])) - statistics.fmean(flat(wall["nolog"]))) * 1e3,
        "mean_ci_ms": tuple(x * 1e3 for x in diff_bootstrap(wall["log"], wall["nolog"], cfg.boot, statistics.fmean)),
        "min_ms": (min(flat(wall["log"])) - min(flat(wall["nolog"]))) * 1e3,
        "cpu_ms": (med(flat(cpu["log"])) - med(flat(cpu["nolog"]))) * 1e3,
        "cpu_ci_ms": tuple(x * 1e3 for x in diff_bootstrap(cpu["log"], cpu["nolog"], cfg.boot, med)),
        "per_round_cpu_ms": [x * 1e3 for x in per_round_log_cpu],
        "hook_cpu_ms_median": med(hooks_log_cpu) * 1e3 if hooks_log_cpu else float("nan"),
        "ref_cpu_ms": ref_cpu * 1e3,
        "per_round_ms": [x * 1e3 for x in per_round_log],
        "hook_ms_median": med(hooks_log) * 1e3 if hooks_log else float("nan"),
        "hook_ms_min": min(hooks_log) * 1e3 if hooks_log else float("nan"),
        "hook_ms_max": max(hooks_log) * 1e3 if hooks_log else float("nan"),
        "hook_calls": len(hooks_log),
        "pl_ms": (med(flat(wall["pl_log"])) - med(flat(wall["none"]))) * 1e3,
        "pl_per_round_ms": [x * 1e3 for x in per_round_pl],
        "ref_ms": ref * 1e3,
    }
    # The CSVLogger writes its buffered rows every 100 steps: the step with global_step 100 (timed index
    # 100 - warmup - 1). Its extra time over the median of its fit, median over the rounds.
    flush = 100 - cfg.warmup - 1
    out["flush"] = None
    if 0 <= flush < cfg.steps:
        out["flush"] = {
            key: statistics.median(r[flush] - statistics.median(r) for r in wall[key]) * 1e3 for key in ("log", "nolog")
        }
    # one-time hooks
    one_time: dict[str, list[float]] = {}
    for key in ("nolog", "log"):
        for r in results[key]:
            for h, _, _, t, _ in r["hooks"]:
                if h != "on_train_batch_end":
                    one_time.setdefault(f"{key}|{h}", []).append(t)
    out["one_time"] = {k: statistics.median(v) for k, v in one_time.items()}
    out["fit_s"] = {k: statistics.median([r["fit_s"] for r in v]) for k, v in results.items()}
    return out


# --------------------------------------------------------------------------------------------------
# 2b: where the logging-step time goes


def profile_logging(cfg: Config, root: str) -> dict[str, Any]:
    """cProfile of the callback's ``on_train_batch_end`` on logging steps (every step logs)."""
    variant = VARIANT["log"]
    callback = FP8StatsCallback(log_every_n_steps=1)
    prof = cProfile.Profile()
    calls = 0

    access: list[float] = []  # seconds per `trainer.callback_metrics` access during a training step
    unprofiled: list[float] = []  # seconds of the hook on a logging step, without the profiler

    def record(hook: str, call: Callable[[], Any], trainer: Any) -> Any:
        nonlocal calls
        if hook != "on_train_batch_end" or trainer.global_step <= 3:
            return call()
        if trainer.global_step % 2:  # odd steps: time without the profiler, and one property access
            t0 = time.perf_counter()
            for _ in range(20):
                trainer.callback_metrics  # noqa: B018
            access.append((time.perf_counter() - t0) / 20)
            t0 = time.perf_counter()
            out = call()
            unprofiled.append(time.perf_counter() - t0)
            return out
        calls += 1
        prof.enable()
        try:
            return call()
        finally:
            prof.disable()

    wrap_hooks(callback, record)
    total = 2 * cfg.profile_logs + 4
    trainer = make_trainer(cfg, variant, root, total, [], callback)
    trainer.fit(make_model(cfg), make_loader(cfg, total))
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    interesting = {
        "FP8StatsCallback._read (stack, reduce, copy, unpack)": ("callbacks.py", "_read"),
        "FP8StatsCallback._metrics (build the dict)": ("callbacks.py", "_metrics"),
        "FP8StatsCallback._alerts": ("callbacks.py", "_alerts"),
        "`trainer.callback_metrics` property (runs `_ResultCollection.metrics`)": ("logger_connector.py",
                                                                                   "callback_metrics"),
        "torch.tensor(value) for callback_metrics": ("~", "<built-in method torch.tensor>"),
        "logger.log_metrics (CSVLogger)": ("csv_logs.py", "log_metrics"),
    }
    total_s = 0.0
    for (file, _, func), (cc, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        if func == "on_train_batch_end" and file.endswith("callbacks.py"):
            total_s = ct
    for label, (file_end, func_name) in interesting.items():
        # matching entries may nest (a subclass method calling its parent's): keep the outermost
        ct_max, n_max = 0.0, 0
        for (file, _, func), (cc, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
            if file.endswith(file_end) and func.startswith(func_name) and ct > ct_max:
                ct_max, n_max = ct, nc
        rows.append((label, ct_max / max(calls, 1), n_max / max(calls, 1)))
    metrics = len(callback.last_metrics)
    return {"calls": calls, "total_per_call": total_s / max(calls, 1), "rows": rows, "metrics": metrics,
            "layers": len(callback.layer_names), "access_us": statistics.median(access) * 1e6,
            "unprofiled_ms": statistics.median(unprofiled) * 1e3, "unprofiled_n": len(unprofiled)}


# --------------------------------------------------------------------------------------------------
# 1b: Lightning's dispatch of the base-class (no-op) hooks to one more callback


def bench_dispatch(cfg: Config, root: str) -> dict[str, Any]:
    """Per training step, Lightning calls every callback hook on every callback. Count the hooks of one
    step, then time ``_call_callback_hooks`` for each with and without the (non-overriding) callback."""
    from lightning.pytorch.trainer import call as pl_call

    original = pl_call._call_callback_hooks
    counts: dict[str, int] = {}
    first_args: dict[str, tuple[Any, ...]] = {}

    def counting(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
        counts[hook_name] = counts.get(hook_name, 0) + 1
        first_args.setdefault(hook_name, args)
        return original(trainer, hook_name, *args, **kwargs)

    steps = 20
    trainers = {}
    pl_call._call_callback_hooks = counting
    try:
        for key, callback in (("with", FP8StatsCallback()), ("without", None)):
            counts.clear()
            trainer = make_trainer(cfg, VARIANT["nolog" if callback else "none"], root, steps, [], callback)
            trainer.fit(make_model(cfg), make_loader(cfg, steps))
            trainers[key] = trainer
            if key == "with":
                per_step = {h: n // steps for h, n in counts.items() if n >= steps}
    finally:
        pl_call._call_callback_hooks = original
    # the hooks FP8StatsCallback overrides are timed directly in the fits; here only the no-op ones
    noop = {h: n for h, n in per_step.items() if h not in HOOKS}
    reps, rounds = 2000, 7
    diff_us: dict[str, float] = {}
    for hook in noop:
        args = first_args[hook]
        best = {"with": math.inf, "without": math.inf}
        for _ in range(rounds):
            for key, trainer in trainers.items():
                t0 = time.perf_counter()
                for _ in range(reps):
                    original(trainer, hook, *args)
                best[key] = min(best[key], (time.perf_counter() - t0) / reps)
        diff_us[hook] = (best["with"] - best["without"]) * 1e6
    total = sum(diff_us[h] * n for h, n in noop.items())
    return {"per_step": per_step, "noop": noop, "diff_us": diff_us, "total_us": total}


def bench_log_scaling(cfg: Config, root: str) -> list[dict[str, Any]]:
    """Logging-hook time against the number of FP8 layers (every step logs; no profiler)."""
    rows = []
    for layers in cfg.scale_layers:
        c = dataclasses.replace(cfg, layers=layers)
        callback = FP8StatsCallback(log_every_n_steps=1)
        times: list[float] = []
        access: list[float] = []

        def record(hook: str, call: Callable[[], Any], trainer: Any, times: list[float] = times,
                   access: list[float] = access) -> Any:
            if hook != "on_train_batch_end" or trainer.global_step <= 2:
                return call()
            t0 = time.perf_counter()
            for _ in range(20):
                trainer.callback_metrics  # noqa: B018
            access.append((time.perf_counter() - t0) / 20)
            t0 = time.perf_counter()
            out = call()
            times.append(time.perf_counter() - t0)
            return out

        wrap_hooks(callback, record)
        steps = cfg.scale_steps + 2
        trainer = make_trainer(c, VARIANT["log"], root, steps, [], callback)
        trainer.fit(make_model(c), make_loader(c, steps))
        rows.append({"blocks": layers, "fp8_layers": len(callback.layer_names), "metrics": len(callback.last_metrics),
                     "hook_ms": statistics.median(times) * 1e3, "hook_min_ms": min(times) * 1e3,
                     "access_us": statistics.median(access) * 1e6, "n": len(times)})
    return rows


# --------------------------------------------------------------------------------------------------
# 3: synchronisations


class StepCounter(Callback):
    """Counts dispatched ops from one ``on_train_batch_start`` to the next (a whole training step)."""

    def __init__(self) -> None:
        self.mode: DispatchCounter | None = None
        self.steps: list[tuple[int, int, int, int]] = []  # global_step of the step, syncs, ops, d2h

    def _close(self, trainer: Any) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.steps.append((trainer.global_step, self.mode.syncs, self.mode.ops, self.mode.d2h))
            self.mode = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._close(trainer)
        self.mode = DispatchCounter()
        self.mode.__enter__()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close(trainer)


def bench_syncs(cfg: Config, root: str) -> dict[str, Any]:
    every = cfg.sync_every
    hooks: list[dict[str, Any]] = []
    callback = FP8StatsCallback(log_every_n_steps=every)

    def record(hook: str, call: Callable[[], Any], trainer: Any) -> Any:
        before = callback.fetches
        with DispatchCounter() as counter:
            out = call()
        hooks.append({"hook": hook, "step": trainer.global_step, "fetches": callback.fetches - before,
                      "syncs": counter.syncs, "ops": counter.ops, "d2h": counter.d2h})
        return out

    wrap_hooks(callback, record)
    variant = dataclasses.replace(VARIANT["log"], callback_every=every)
    trainer = make_trainer(cfg, variant, root, cfg.sync_steps, [], callback)
    trainer.fit(make_model(cfg), make_loader(cfg, cfg.sync_steps))

    # whole training steps, with and without the callback (first step excluded: lazy initialisation)
    whole: dict[str, dict[str, Any]] = {}
    runs = (("none", None, "adamw"), ("nolog", 1000, "adamw"), ("log", 1, "adamw"),
            ("log_fused", 1, "adamw_fused"), ("log_sgd", 1, "sgd"))
    for key, cb_every, optimizer in runs:
        counter = StepCounter()
        cb = FP8StatsCallback(log_every_n_steps=cb_every) if cb_every else None
        v = dataclasses.replace(VARIANT["none"], key=f"sync_{key}")
        trainer = make_trainer(cfg, v, root, 4, [counter], cb)
        trainer.fit(make_model(cfg, optimizer), make_loader(cfg, 4))
        steps = counter.steps[1:]
        whole[key] = {"syncs": [s for _, s, _, _ in steps], "ops": [o for _, _, o, _ in steps],
                      "d2h": [d for _, _, _, d in steps]}
    return {"hooks": hooks, "every": every, "whole": whole}


# --------------------------------------------------------------------------------------------------
# report


def pct(x: float) -> str:
    return f"{x * 100:+.2f} %"


def render(cfg: Config, env: dict[str, str], timing: dict[str, Any], dispatch: dict[str, Any], prof: dict[str, Any],
           scaling: list[dict[str, Any]], syncs: dict[str, Any], total_s: float, load_end: str) -> str:
    L: list[str] = []
    L.append("# lightning_fp8 benchmark: cost of FP8StatsCallback in a Lightning Trainer")
    L.append("")
    L.append(f"Generated by `python benchmarks/bench_callback.py{' --quick' if cfg.quick else ''}` in {total_s:.0f} s. "
             f"Mode: {'quick' if cfg.quick else 'full'}.")
    L.append("")
    L.append("| | |")
    L.append("|---|---|")
    for key, val in env.items():
        L.append(f"| {key} | {val} |")
    L.append(f"| load average at end | {load_end} |")
    L.append("")
    cores = os.cpu_count() or 1
    load0 = float(env["load average at start"].split()[0])
    load1 = float(load_end.split()[0])
    if max(load0, load1) > 0.5 * cores:
        L.append(f"> **Warning: the machine was shared.** Load average {env['load average at start']} at start and "
                 f"{load_end} at the end, on {cores} CPUs: other processes competed for the cores, so step times "
                 "are noisy. The fits are interleaved (rotated order in every round) so that drift hits all variants "
                 "alike; trust the bootstrap intervals, the per-round spread and the directly measured hook times "
                 "more than any single median.")
        L.append("")
    rows = timing["rows"]
    ov = timing["overhead"]
    lg = timing["logging"]
    ref = lg["ref_ms"]
    L.append("## Setup")
    L.append("")
    L.append(f"`tests/models.py` `TinyDecoder(dim={cfg.dim}, heads={cfg.heads}, layers={cfg.layers}, "
             f"seq_len={cfg.seq_len})`, batch {cfg.batch} ({cfg.batch * cfg.seq_len} tokens per step), AdamW, "
             f"`Trainer(accelerator='cpu', plugins=[FP8Precision()])` (recipe `tensorwise`, bf16 autocast, dynamic "
             "loss scaling), `CSVLogger` (default `flush_logs_every_n_steps=100`), no progress bar, no checkpointing, "
             f"no validation, {cfg.threads} torch intra-op thread(s) (`--threads`). {prof['layers']} FP8 layers. Every fit runs {cfg.warmup} un-timed warm-up steps, then "
             f"{cfg.steps} timed steps. A step time is the interval between consecutive `on_train_batch_start` "
             "calls (forward, backward, optimizer, all `on_train_batch_end` hooks, Lightning's logging, next batch). "
             f"{cfg.rounds} rounds; each round fits every variant once, in a rotated order. The callback's hooks are "
             "wrapped to time them directly (the wrapper adds about 1 us per call).")
    L.append("")
    L.append("| variant | ms / step (median) | [min - max] | mean | CPU ms (median) | x none (median) | x none (min) | "
             "x none (CPU) | callback logs / fit |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in rows.items():
        L.append(f"| {r['label']} | {r['median'] * 1e3:.2f} | [{r['min'] * 1e3:.2f} - {r['max'] * 1e3:.2f}] | "
                 f"{r['mean'] * 1e3:.2f} | {r['cpu'] * 1e3:.2f} | {r['x_med']:.4f} | {r['x_min']:.4f} | "
                 f"{r['x_cpu']:.4f} | {r['logs']:.0f} |")
    L.append("")

    L.append("## 1. Overhead on non-logging steps")
    L.append("")
    refc = lg["ref_cpu_ms"]

    def verdict(ci: tuple[float, float]) -> str:
        if ci[1] * 100 < TARGET_PCT:
            return "meets the target"
        if ci[0] * 100 > TARGET_PCT:
            return "misses the target"
        return "cannot decide the target"

    L.append(f"Target: < {TARGET_PCT:.0f} % per step. With the callback, on steps that do not log, against no "
             f"callback. This process got {timing['core_share'] * 100:.0f} % of a core on average (median CPU time / "
             "median wall time of a step without the callback): wall times also measure the other processes, "
             "process CPU time measures this process's own work, which is what a callback adds on a CPU run.")
    L.append("")
    L.append("| measure | overhead (pooled medians) | 95 % bootstrap interval | per round (paired) | verdict |")
    L.append("|---|---:|---|---|---|")
    L.append(f"| wall time / step | {pct(ov['pooled'])} | [{pct(ov['ci'][0])}, {pct(ov['ci'][1])}] | "
             f"{', '.join(pct(x) for x in ov['per_round'])} | {verdict(ov['ci'])} |")
    L.append(f"| process CPU time / step | {pct(ov['cpu'])} | [{pct(ov['cpu_ci'][0])}, {pct(ov['cpu_ci'][1])}] | "
             f"{', '.join(pct(x) for x in ov['per_round_cpu'])} | {verdict(ov['cpu_ci'])} |")
    L.append(f"| fastest step of each (wall) | {pct(ov['min'])} | | | |")
    aa = timing["aa"]
    L.append(f"| *A/A control: a second fit without the callback vs the first, wall* | {pct(aa['wall'])} | "
             f"[{pct(aa['wall_ci'][0])}, {pct(aa['wall_ci'][1])}] | {', '.join(pct(x) for x in aa['per_round'])} | |")
    L.append(f"| *A/A control, CPU* | {pct(aa['cpu'])} | [{pct(aa['cpu_ci'][0])}, {pct(aa['cpu_ci'][1])}] | "
             f"{', '.join(pct(x) for x in aa['per_round_cpu'])} | |")
    L.append("")
    L.append(f"Intervals: {cfg.boot} resamples of the rounds (paired), then of the steps within each round. "
             "The A/A rows compare two identical configurations: their spread is the noise floor of a whole-fit "
             "comparison on this machine; an overhead smaller than that cannot be resolved end to end.")
    L.append("")
    L.append(f"**Directly: the callback's `on_train_batch_end` takes {ov['hook_us_median']:.1f} us wall "
             f"({ov['hook_cpu_us_median']:.1f} us CPU; median of {ov['hook_calls']} non-logging calls, max "
             f"{ov['hook_us_max']:.1f} us) = {ov['hook_pct']:.4f} % of a {ref:.1f} ms step "
             f"({ov['hook_cpu_pct']:.4f} % of its {refc:.1f} ms CPU time).** It is the only per-step hook the "
             "callback implements.")
    L.append("")
    hooks_txt = ", ".join(f"`{h}` x{n}" for h, n in dispatch["noop"].items())
    per_hook = ", ".join(f"{dispatch['diff_us'][h]:.2f}" for h in dispatch["noop"])
    both = ov["hook_us_median"] + dispatch["total_us"]
    L.append(f"Lightning also calls, on every step, the base-class (no-op) hooks of every callback: {hooks_txt}. "
             f"Timing `_call_callback_hooks` for each with and without the callback (fastest of 7 x 2000 calls) gives "
             f"{per_hook} us per call, **{dispatch['total_us']:.1f} us per step**. Together with the hook: "
             f"**{both:.1f} us = {both / ref * 1e-1:.3f} % of a step** on non-logging steps.")
    L.append("")
    L.append("The end-to-end intervals are the honest bound this machine allows; the direct hook time is the "
             "callback's own cost and does not depend on the model size (it grows only with the number of FP8 "
             "layers on logging steps).")
    L.append("")

    L.append("## 2. Cost of a logging step")
    L.append("")
    L.append("`FP8StatsCallback(log_every_n_steps=1)` (every step logs) against the non-logging run, both with the "
             "Trainer's `log_every_n_steps=1000`:")
    L.append("")
    L.append("| measure | extra ms per logging step | 95 % bootstrap interval | per round (paired) | of a step |")
    L.append("|---|---:|---|---|---:|")
    L.append(f"| wall time, median | {lg['median_ms']:.2f} | [{lg['median_ci_ms'][0]:.2f}, {lg['median_ci_ms'][1]:.2f}] | "
             f"{', '.join(f'{x:.2f}' for x in lg['per_round_ms'])} | {lg['median_ms'] / ref * 100:.1f} % |")
    L.append(f"| wall time, mean (includes the CSV flush every 100 steps) | {lg['mean_ms']:.2f} | "
             f"[{lg['mean_ci_ms'][0]:.2f}, {lg['mean_ci_ms'][1]:.2f}] | | {lg['mean_ms'] / ref * 100:.1f} % |")
    L.append(f"| process CPU time, median | {lg['cpu_ms']:.2f} | [{lg['cpu_ci_ms'][0]:.2f}, {lg['cpu_ci_ms'][1]:.2f}] | "
             f"{', '.join(f'{x:.2f}' for x in lg['per_round_cpu_ms'])} | {lg['cpu_ms'] / refc * 100:.1f} % |")
    L.append(f"| wall time, fastest step of each | {lg['min_ms']:.2f} | | | |")
    L.append(f"| **the logging hook itself, wall (median of {lg['hook_calls']})** | **{lg['hook_ms_median']:.2f}** | "
             f"[{lg['hook_ms_min']:.2f} - {lg['hook_ms_max']:.2f}] (min - max) | | "
             f"{lg['hook_ms_median'] / ref * 100:.1f} % |")
    L.append(f"| the logging hook itself, CPU (median) | {lg['hook_cpu_ms_median']:.2f} | | | "
             f"{lg['hook_cpu_ms_median'] / refc * 100:.1f} % |")
    L.append(f"| *reference: Lightning logging its one `train_loss` metric every step (Trainer `log_every_n_steps=1` "
             f"vs 1000, no callback), wall median* | {lg['pl_ms']:.2f} | | "
             f"{', '.join(f'{x:.2f}' for x in lg['pl_per_round_ms'])} | |")
    L.append("")
    L.append("`of a step`: against the median step without the callback (wall, or CPU for the CPU rows).")
    L.append("")
    if timing["flush"] is not None:
        fl = timing["flush"]
        L.append(f"The CSVLogger writes its buffered rows to disk every 100 steps (`flush_logs_every_n_steps`). That "
                 f"step took {fl['log']:.2f} ms more than the median step of its fit when the callback logs every "
                 f"step ({fl['nolog']:.2f} ms in the non-logging run): amortised, {fl['log'] / 100:.3f} ms per step.")
        L.append("")
    L.append(f"Where the logging hook's time goes (cProfile over {prof['calls']} logging steps, {prof['metrics']} "
             f"metrics per log, {prof['layers']} layers; the profiler inflates Python-heavy code, so read the shares, "
             f"not the absolute times): total {prof['total_per_call'] * 1e3:.2f} ms per call under the profiler.")
    L.append("")
    L.append("| part (cumulative, may nest) | ms / logging step | calls / logging step | share |")
    L.append("|---|---:|---:|---:|")
    for label, t, n in prof["rows"]:
        share = t / prof["total_per_call"] * 100 if prof["total_per_call"] else float("nan")
        L.append(f"| {label} | {t * 1e3:.3f} | {n:.0f} | {share:.0f} % |")
    L.append("")
    implied = prof["access_us"] * prof["metrics"] / 1e3
    L.append(f"Without the profiler, in the same fit: the logging hook took {prof['unprofiled_ms']:.2f} ms (median of "
             f"{prof['unprofiled_n']}); one access to `trainer.callback_metrics` during a training step costs "
             f"{prof['access_us']:.1f} us (median), and `log_now` makes one access per metric "
             f"(`trainer.callback_metrics[key] = torch.tensor(value)` in a loop over {prof['metrics']} metrics), "
             f"i.e. about {implied:.2f} ms = {implied / prof['unprofiled_ms'] * 100:.0f} % of the hook. Each access "
             "re-runs Lightning's `_ResultCollection.metrics()` (it iterates over everything the LightningModule "
             "logged, so it also grows with the module's own `self.log` calls); reading the dict once before the "
             "loop would make this cost independent of the number of metrics.")
    L.append("")
    L.append(f"Logging hook against the number of FP8 layers (same dims, `TinyDecoder(layers=...)`, every step logs, "
             f"median of {cfg.scale_steps} logging steps, no profiler):")
    L.append("")
    L.append("| blocks | FP8 layers | metrics per log | logging hook ms (median) | min | "
             "`trainer.callback_metrics` access us | x metrics = ms |")
    L.append("|---:|---:|---:|---:|---:|---:|---:|")
    for r in scaling:
        L.append(f"| {r['blocks']} | {r['fp8_layers']} | {r['metrics']} | {r['hook_ms']:.2f} | {r['hook_min_ms']:.2f} | "
                 f"{r['access_us']:.1f} | {r['access_us'] * r['metrics'] / 1e3:.2f} |")
    if len(scaling) >= 2:
        a, b = scaling[0], scaling[-1]
        per_metric = (b["hook_ms"] - a["hook_ms"]) / (b["metrics"] - a["metrics"]) * 1e3
        L.append("")
        L.append(f"About {per_metric:.1f} us per metric ({per_metric * 12:.0f} us per FP8 layer: 3 tensors x 4 metrics), "
                 "linear in the number of layers.")
    L.append("")

    L.append("## 3. Device-to-host synchronisations")
    L.append("")
    L.append(f"Counted under a `TorchDispatchMode` inside each hook of the callback, during a "
             f"{cfg.sync_steps}-step fit with `FP8StatsCallback(log_every_n_steps={syncs['every']})` and a CSVLogger. "
             "`syncs`: `aten._local_scalar_dense` (what `.item()`, `bool(t)`, `int(t)`, `float(t)` dispatch to; also "
             "`item`, `is_nonzero`, `equal`). `D2H copies`: `_to_copy`/`copy_` from a non-CPU device to the CPU "
             "(always 0 on a CPU run: `.to('cpu')` and `.tolist()` of a CPU tensor dispatch nothing, so the one "
             "batched transfer of a logging step is invisible to a dispatch mode here). "
             "`batched copies`: the callback's own `fetches` counter (one `flat.to('cpu').tolist()` per read); on "
             "CUDA each of these is the one blocking transfer of that step.")
    L.append("")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for h in syncs["hooks"]:
        kind = h["hook"]
        if kind == "on_train_batch_end":
            kind += " (logging step)" if h["fetches"] else " (non-logging step)"
        groups.setdefault((kind, ""), []).append(h)
    L.append("| hook | calls | syncs / call | aten ops / call | D2H copies / call | batched copies / call |")
    L.append("|---|---:|---:|---:|---:|---:|")
    for (kind, _), hs in groups.items():
        def avg(field: str, hs: list[dict[str, Any]] = hs) -> str:
            vals = [h[field] for h in hs]
            lo, hi = min(vals), max(vals)
            return f"{lo}" if lo == hi else f"{lo}-{hi}"
        L.append(f"| `{kind}` | {len(hs)} | {avg('syncs')} | {avg('ops')} | {avg('d2h')} | {avg('fetches')} |")
    L.append("")
    L.append("Whole training steps (from one `on_train_batch_start` to the next; steps 2-4 of a 4-step fit; "
             "`FP8Precision()`; AdamW unless stated). None of these syncs is the callback's. AdamW (neither fused "
             "nor capturable) reads one `step` counter per parameter with `.item()`; these counters live on the CPU, "
             "so on CUDA they are no device syncs. With a non-fused optimizer `GradScaler.step` reads its inf flag "
             "once (the SGD row); with `AdamW(fused=True)` the step has none:")
    L.append("")
    L.append("| run | syncs / step | aten ops / step |")
    L.append("|---|---|---|")
    names = {"none": "no callback", "nolog": "callback, non-logging steps", "log": "callback, every step logs",
             "log_fused": "callback, every step logs, `AdamW(fused=True)`",
             "log_sgd": "callback, every step logs, `SGD(momentum=0.9)`"}
    for key, w in syncs["whole"].items():
        L.append(f"| {names[key]} | {', '.join(map(str, w['syncs']))} | {', '.join(map(str, w['ops']))} |")
    L.append("")

    L.append("## 4. One-time costs")
    L.append("")
    L.append("| hook | median ms |")
    L.append("|---|---:|")
    for key, t in timing["one_time"].items():
        run, hook = key.split("|")
        what = {"on_train_start": "baseline read of the counters",
                "on_fit_end": "summary table + heatmap PNG"}.get(hook, "")
        L.append(f"| `{hook}` ({what}), {'every step logs' if run == 'log' else 'no logging step'} | {t * 1e3:.1f} |")
    L.append("")
    L.append("Median wall time of a whole fit (" + str(cfg.warmup + cfg.steps + 1) + " steps, including Trainer "
             "setup and teardown): " + ", ".join(f"{k} {v:.2f} s" for k, v in timing["fit_s"].items()) + ".")
    L.append("")
    return "\n".join(L)


# --------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps and rounds (~2 min)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"Markdown output file (default {DEFAULT_OUT})")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared 2-core machine, 2 threads made steps "
                             "several times slower and noisier through OpenMP contention)")
    parser.add_argument("--raw", default=None, help="also write the raw step and hook times to this JSON file")
    args = parser.parse_args()
    quiet()
    cfg = make_config(args.quick, args.threads)
    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    env = environment()

    def stage(name: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {name}", file=sys.stderr, flush=True)

    root = tempfile.mkdtemp(prefix="bench_callback_")
    try:
        stage(f"1+2. interleaved timed fits ({cfg.rounds} rounds x {len(VARIANTS)} variants)")
        results = bench_timing(cfg, root, stage)
        if args.raw:
            with open(args.raw, "w") as f:
                json.dump({"config": dataclasses.asdict(cfg), "results": results}, f)
        timing = analyse_timing(cfg, results)
        stage("1b. Lightning's dispatch to one more callback")
        dispatch = bench_dispatch(cfg, os.path.join(root, "dispatch"))
        stage("2b. profile of the logging hook")
        prof = profile_logging(cfg, os.path.join(root, "profile"))
        stage("2c. logging hook vs number of FP8 layers")
        scaling = bench_log_scaling(cfg, os.path.join(root, "scaling"))
        stage("3. syncs")
        syncs = bench_syncs(cfg, os.path.join(root, "syncs"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = time.perf_counter() - t_start
    stage("done")
    load_end = " ".join(f"{v:.2f}" for v in os.getloadavg())
    text = render(cfg, env, timing, dispatch, prof, scaling, syncs, total, load_end)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"\nwritten to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
