#!/usr/bin/env python
"""Convergence: does FP8 training reach bf16's validation loss? (issue 12)

The example's language model (``examples/fp8_lm/train.py``: ``ByteTransformerLM`` on ``StdlibBytes``, the
Python standard library's own source, no download) is trained through a real ``lightning.Trainer`` in

* ``bf16``: Lightning's ``precision="bf16-mixed"``, the reference;
* ``torchao``: torchao's ``convert_to_float8_training`` with ``Float8LinearConfig(emulate=True)`` (tensorwise,
  the configuration ``bench_linear.py`` measures), under ``bf16-mixed``;
* ``fp8-<recipe>``: ``FP8Precision(recipe=<recipe>)`` for each recipe of ``lightning_fp8.recipe.RECIPES``;

each from the same initial weights, on the same batches in the same order, with the same hyper-parameters
(AdamW, warm-up and cosine decay to the last step, gradient clipping 1.0), once per seed, long enough for the
validation loss to flatten. Per run it records the validation loss every ``--val-every`` steps, the training loss
and the FP8 statistics of the whole run (overflow / underflow fractions per layer and tensor, from
``lightning_fp8.FP8Stats``).

Two scenarios:

* ``plain``: the model as it is;
* ``outliers``: the same model with *planted massive activations*: the input of each layer of
  ``--outlier-layers`` is multiplied by ``--outlier-factor`` (a power of two, so the product is exact in every
  floating-point format) at the token positions ``--outlier-positions`` (a BOS-like token: the first position
  of every sequence) and that layer's output by its inverse. In exact arithmetic, and in bf16, this is the
  identity; with one scale per tensor those few tokens set the FP8 scale and every other token is cast far below
  its own range. The scenario adds ``fp8-tensorwise+exclude``: ``tensorwise`` with the ``exclude`` list that
  ``lightning_fp8.sensitivity_report`` writes from a few training batches of the initial model (per seed). Its
  ``bf16`` run is the plain one: the planted model is trained ``identity_check_steps`` steps in bf16, and where
  its losses equal the plain run's bit for bit the plain run is reused (otherwise it runs in full).

The runs go to a pool of ``--workers`` processes with ``--threads`` torch threads each (on this project's 2-core
machine two one-thread processes do twice the work of one two-thread process for a model this small).

Results: ``--json`` (default ``benchmarks/results/convergence.json``: the raw curves, the configuration, the
machine and versions, and a summary), ``--plot`` (default ``docs/assets/convergence.png``) and, when the JSON
is the repository's, the tables ``benchmarks/results/tables/convergence*.md`` (``benchmarks/docs_tables.py``
renders the same tables from the JSON).

Adding recipes to an existing result: ``--recipes blockwise,mxfp8`` runs only those recipes (plus any baseline
the file lacks) with the file's seeds and configuration, and merges them into the file; a differing
configuration is refused (``--fresh`` starts a new file instead).

Usage::

    python benchmarks/bench_convergence.py                              # every variant, both scenarios, 3 seeds
    python benchmarks/bench_convergence.py --recipes blockwise,mxfp8    # add recipes to the existing results
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import shlex
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

# Idle OpenMP threads sleep instead of spinning (read when torch loads): the machine is shared.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import docs_tables
import harness

EXAMPLE = os.path.join(ROOT, "examples", "fp8_lm", "train.py")
DEFAULT_JSON = os.path.join(HERE, "results", "convergence.json")
DEFAULT_PLOT = os.path.join(ROOT, "docs", "assets", "convergence.png")
TABLES = {"plain": "convergence.md", "outliers": "convergence_outliers.md"}
BASELINE, TORCHAO = "bf16", "torchao"
EXCLUDE_SUFFIX = "+exclude"
SCENARIOS = ("plain", "outliers")


# ----------------------------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that must be equal for two runs to be comparable (a merge checks it)."""

    seeds: tuple[int, ...] = (0, 1, 2)
    # model (ByteTransformerLM) and data (StdlibBytes)
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    seq_len: int = 64
    batch_size: int = 32
    val_windows: int = 512
    # optimisation (the example's AdamW, warm-up and cosine schedule; clipping as in its cpu.yaml)
    steps: int = 300
    val_every: int = 60
    lr: float = 2e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    gradient_clip_val: float = 1.0
    # the outlier scenario
    outlier_layers: tuple[str, ...] = ("blocks.*.qkv",)
    outlier_factor: float = 2.0**17
    outlier_positions: tuple[int, ...] = (0,)
    sensitivity_batches: int = 4
    #: the outliers scenario's bf16 run is the plain one's, bit for bit (the planted factors are powers of two):
    #: it is checked on this many training steps (losses compared bitwise) and then taken from the plain run
    identity_check_steps: int = 10
    # the torchao variant
    torchao_recipe: str = "tensorwise"
    data_dir: str | None = None  # None: this interpreter's standard library

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Config:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names})


def fp8_name(recipe: str) -> str:
    return f"fp8-{recipe}"


def variants_for(scenario: str, recipes: Sequence[str], baselines: bool, torchao: bool) -> list[str]:
    """The variants of a scenario, in table order."""
    names = ([BASELINE] + ([TORCHAO] if torchao else [])) if baselines else []
    names += [fp8_name(r) for r in recipes]
    if scenario == "outliers" and "tensorwise" in recipes:
        names.append(fp8_name("tensorwise") + EXCLUDE_SUFFIX)
    return names


# ----------------------------------------------------------------------------------------------- the model
class MassiveTokens(nn.Module):
    """``linear(x * s) * (1 / s)`` with ``s = factor`` at the token positions ``positions`` and 1 elsewhere.

    ``factor`` is a power of two, so both products are exact in every floating-point format: the module is the
    identity around ``linear`` in exact arithmetic and in bf16 (no rounding differs). What it changes is what
    ``linear`` sees: a few tokens ``factor`` times larger than the rest, the "massive activations" of large
    language models, which one scale per tensor cannot represent together with the other tokens.
    """

    def __init__(self, linear: nn.Linear, factor: float, positions: Sequence[int]) -> None:
        super().__init__()
        if not math.log2(factor).is_integer():
            raise ValueError(f"factor must be a power of two (exact multiplication), got {factor}")
        self.linear, self.factor, self.positions = linear, float(factor), list(positions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.ones(x.shape[-2], 1, dtype=x.dtype, device=x.device)
        s[self.positions] = self.factor
        y = self.linear(x * s)
        return y * (1.0 / s).to(y.dtype)


def plant_outliers(model: nn.Module, patterns: Sequence[str], factor: float, positions: Sequence[int]) -> list[str]:
    """Wrap every ``nn.Linear`` whose name matches a glob of ``patterns`` in :class:`MassiveTokens`; their names."""
    import fnmatch

    targets = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]
    if not targets:
        raise ValueError(f"no nn.Linear layer matches {list(patterns)}")
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, MassiveTokens(getattr(parent, child), factor, positions))
    return targets


def example_classes() -> tuple[type, type, Any]:
    """``ByteTransformerLM``, ``StdlibBytes`` and the example's module (loaded from its file, once per process)."""
    from lightning_fp8.compare import load_class

    model_class = load_class(f"{EXAMPLE}:ByteTransformerLM")
    return model_class, load_class(f"{EXAMPLE}:StdlibBytes"), sys.modules[model_class.__module__]


def build_model(cfg: Config, scenario: str) -> tuple[nn.Module, list[str]]:
    model_class, _, _ = example_classes()
    model = model_class(
        dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, mlp_ratio=cfg.mlp_ratio, seq_len=cfg.seq_len,
        lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio,
    )
    planted = []
    if scenario == "outliers":
        planted = plant_outliers(model, cfg.outlier_layers, cfg.outlier_factor, cfg.outlier_positions)
    return model, planted


_DATA: dict[tuple, Any] = {}


def datamodule(cfg: Config) -> Any:
    """The example's data module, loaded once per process (the text is read once)."""
    key = (cfg.seq_len, cfg.batch_size, cfg.val_windows, cfg.data_dir)
    if key not in _DATA:
        _, data_class, _ = example_classes()
        dm = data_class(seq_len=cfg.seq_len, batch_size=cfg.batch_size, val_windows=cfg.val_windows,
                        stdlib_dir=cfg.data_dir)
        dm.setup("fit")
        _DATA[key] = dm
    return _DATA[key]


# ----------------------------------------------------------------------------------------------- one run
def _recorder_class() -> type:
    from lightning.pytorch.callbacks import Callback

    from lightning_fp8 import FP8Stats

    class Recorder(Callback):
        """Validation losses, bucketed training losses, a checksum of the batches, the FP8 statistics of the run."""

        def __init__(self, bucket: int) -> None:
            self.bucket = bucket
            self.val: list[list[float]] = []
            self.train: list[float] = []
            self.batches = 0
            self.stats: FP8Stats | None = None
            self.fp8_metrics: dict[str, float] = {}
            self.recording = True

        def on_train_start(self, trainer, pl_module) -> None:
            if hasattr(trainer.precision_plugin, "fp8_models"):
                self.stats = FP8Stats(trainer.precision_plugin)
                self.stats.take_baseline()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            data = b"".join(t.detach().contiguous().numpy().tobytes() for t in batch)
            self.batches = zlib.crc32(data, self.batches)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.train.append(float(loss))

        def on_validation_end(self, trainer, pl_module) -> None:
            if self.recording and not trainer.sanity_checking:
                self.val.append([trainer.global_step, float(trainer.callback_metrics["val_loss"])])

        def on_train_end(self, trainer, pl_module) -> None:
            if self.stats is not None:
                metrics = self.stats.metrics()
                self.fp8_metrics = {k: v for k, v in metrics.items() if k.endswith(("_frac", "_layer", "skipped_steps"))}
                self.fp8_metrics["layer_names"] = list(self.stats.layer_names)  # type: ignore[assignment]

    return Recorder


def sensitivity_exclude(cfg: Config, model: nn.Module, seed: int) -> tuple[list[str], list[dict[str, Any]]]:
    """``lightning_fp8.sensitivity_report`` of ``model`` on ``cfg.sensitivity_batches`` training batches: its
    ``exclude`` list and the scores of the measured layers."""
    import torch.nn.functional as F

    from lightning_fp8 import sensitivity_report

    _, _, example = example_classes()
    dm = datamodule(cfg)
    loader = torch.utils.data.DataLoader(
        dm.train_dataloader().dataset, batch_size=cfg.batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == cfg.sensitivity_batches:
            break

    def step(m: nn.Module, batch: Any) -> torch.Tensor:
        idx, target = batch
        return F.cross_entropy(m(idx).float().view(-1, example.VOCAB), target.view(-1))

    report = sensitivity_report(model, batches, recipe="tensorwise", step_fn=step)
    scores = [{"layer": e.name, "score_db": e.score_db} for e in report.layers]
    return report.exclude(), scores


def run_one(cfg_json: dict[str, Any], scenario: str, variant: str, seed: int,
            fp8_kwargs: dict[str, Any] | None = None, check_steps: int | None = None) -> dict[str, Any]:
    """Train one variant of one scenario from one seed; the record of the run. ``fp8_kwargs``: more
    ``FP8Precision`` arguments, for a diagnosis (the benchmark's own variants take none). ``check_steps``: only
    this many steps, no validation: the record holds the training losses (the identity check)."""
    import lightning as L

    from lightning_fp8 import FP8Precision

    cfg = Config.from_json(cfg_json)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*KernelPreference.*")
        warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")
        L.seed_everything(seed, verbose=False)
        model, planted = build_model(cfg, scenario)
        record: dict[str, Any] = {"scenario": scenario, "variant": variant, "seed": seed}
        kwargs: dict[str, Any]
        if variant == BASELINE:
            kwargs = {"precision": "bf16-mixed"}
        elif variant == TORCHAO:
            from bench_linear import load_torchao, torchao_config

            loaded = load_torchao()
            if loaded is None:
                raise RuntimeError("torchao is not installed")
            convert, _ = loaded
            convert(model, config=torchao_config(cfg.torchao_recipe))
            kwargs = {"precision": "bf16-mixed"}
        else:
            recipe, _, extra = variant[len("fp8-"):].partition("+")
            exclude: list[str] = []
            if extra == "exclude":
                exclude, scores = sensitivity_exclude(cfg, model, seed)
                record["exclude"], record["sensitivity_scores_db"] = exclude, scores
            elif extra:
                raise ValueError(f"unknown variant {variant}")
            plugin = FP8Precision(**{**(fp8_kwargs or {}), "recipe": recipe,
                                     "exclude": exclude + list((fp8_kwargs or {}).get("exclude", []))})
            kwargs = {"precision": None, "plugins": [plugin]}
        recorder = _recorder_class()(bucket=10)
        L.seed_everything(seed, verbose=False)  # the same data order whatever the set-up drew
        if check_steps is not None:
            kwargs.update(limit_val_batches=0)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = L.Trainer(
                accelerator="cpu", devices=1, max_steps=check_steps or cfg.steps, val_check_interval=cfg.val_every,
                check_val_every_n_epoch=None, num_sanity_val_steps=0, gradient_clip_val=cfg.gradient_clip_val,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                callbacks=[recorder], default_root_dir=tmp, **kwargs,
            )
            trainer.fit(model, datamodule=datamodule(cfg))
            hp_eval = None
            if check_steps is not None:
                return {**record, "planted": planted, "first_train_losses": recorder.train}
            if hasattr(trainer.precision_plugin, "fp8_eval"):
                # the same weights evaluated in bf16: how much of the gap is the FP8 inference, how much the training
                trainer.precision_plugin.fp8_eval = False
                recorder.recording = False
                hp_eval = float(trainer.validate(model, datamodule=datamodule(cfg), verbose=False)[0]["val_loss"])
    if trainer.global_step != cfg.steps:
        raise RuntimeError(f"{scenario}/{variant}/seed {seed}: stopped after {trainer.global_step} of {cfg.steps} steps")
    report = getattr(trainer.precision_plugin, "report", None)
    train = recorder.train
    buckets = [sum(train[i : i + recorder.bucket]) / len(train[i : i + recorder.bucket])
               for i in range(0, len(train), recorder.bucket)]
    record.update(
        final_val_loss=recorder.val[-1][1],
        final_val_loss_bf16_eval=hp_eval,
        val_curve=recorder.val,
        train_curve={"every": recorder.bucket, "mean_loss": buckets},
        first_train_losses=train[: cfg.identity_check_steps],
        data_checksum=recorder.batches,
        planted=planted,
        fp8_layers=len(report.fp8_layers) if report is not None else None,
        fp8_stats=recorder.fp8_metrics,
        wall_s=round(time.perf_counter() - start, 1),
    )
    print(f"  {scenario:8s} {variant:24s} seed {seed}: val loss {record['final_val_loss']:.4f} "
          f"({record['wall_s']:.0f} s)", flush=True)
    return record


# ----------------------------------------------------------------------------------------------- the runs
_QUIET = {"torchao": logging.ERROR, "lightning.pytorch": logging.WARNING, "lightning.fabric": logging.WARNING,
          "lightning_fp8": logging.WARNING}


def _init_worker(threads: int) -> None:
    """A worker process's settings: its thread count, and quiet loggers."""
    torch.set_num_threads(threads)
    for name, level in _QUIET.items():
        logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _worker_settings(threads: int) -> Iterator[None]:
    """The worker settings in this process, restored on exit (the runs may be called from a test session)."""
    before = torch.get_num_threads(), {name: logging.getLogger(name).level for name in _QUIET}
    _init_worker(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        for name, level in before[1].items():
            logging.getLogger(name).setLevel(level)


def _cost(variant: str) -> int:
    """Rough relative cost on a CPU without bf16 matrix units: the longest runs go first."""
    return 0 if variant == BASELINE else 2 if variant == TORCHAO else 1


Task = tuple[str, str, int, "int | None"]  # scenario, variant, seed, check_steps (None: a whole run)


def run_all(cfg: Config, tasks: list[Task], workers: int, threads: int) -> list[dict[str, Any]]:
    """Run ``tasks`` on ``workers`` processes; the records in the order of ``tasks``."""
    order = sorted(range(len(tasks)), key=lambda i: (tasks[i][3] is not None, _cost(tasks[i][1]), i))
    results: dict[int, dict[str, Any]] = {}
    if workers <= 1:
        with _worker_settings(threads):
            for i in order:
                scenario, variant, seed, check = tasks[i]
                results[i] = run_one(cfg.to_json(), scenario, variant, seed, check_steps=check)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                                 initargs=(threads,)) as pool:
            futures = {}
            for i in order:
                scenario, variant, seed, check = tasks[i]
                futures[i] = pool.submit(run_one, cfg.to_json(), scenario, variant, seed, check_steps=check)
            for i, future in futures.items():
                results[i] = future.result()
    return [results[i] for i in range(len(tasks))]


def outlier_baselines(cfg: Config, records: list[dict[str, Any]], plain_bf16: dict[str, dict[str, Any]],
                      threads: int) -> list[dict[str, Any]]:
    """``records`` with each identity check replaced by the outliers scenario's bf16 record: the plain bf16 run
    where the check's losses equal its first ones bit for bit, else a whole run of its own."""
    out = []
    for rec in records:
        if "final_val_loss" in rec:
            out.append(rec)
            continue
        plain = plain_bf16[str(rec["seed"])]
        checked = len(rec["first_train_losses"])
        if rec["first_train_losses"] == plain["first_train_losses"][:checked]:
            same = copy.deepcopy(plain)
            same.update(scenario="outliers", planted=rec["planted"], wall_s=0.0,
                        identical_to_plain={"checked_steps": checked, "bitwise_equal_losses": True})
            print(f"  outliers bf16                     seed {rec['seed']}: the plain run's, bit for bit "
                  f"({checked} steps checked)", flush=True)
            out.append(same)
        else:
            print(f"  outliers bf16 seed {rec['seed']}: differs from the plain run; running it whole", flush=True)
            with _worker_settings(threads):
                out.append(run_one(cfg.to_json(), "outliers", BASELINE, rec["seed"]))
    return out


# ----------------------------------------------------------------------------------------------- result file
class ConfigMismatch(ValueError):
    """The existing result file was measured with another configuration."""


def merge(existing: dict[str, Any] | None, cfg: Config, records: list[dict[str, Any]], env: dict[str, str],
          command: str) -> dict[str, Any]:
    """The result file with ``records`` added (a variant measured again replaces its earlier runs)."""
    if existing is not None:
        old = Config.from_json(existing["config"])
        if old != cfg:
            diff = {k: (getattr(old, k), getattr(cfg, k)) for k in cfg.to_json() if getattr(old, k) != getattr(cfg, k)}
            raise ConfigMismatch(
                "the existing results were measured with another configuration (existing, now): "
                + ", ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in diff.items())
                + "; run with the same settings to add variants, or --fresh to start a new result file"
            )
        data = copy.deepcopy(existing)
    else:
        data = {"environment": env, "command": command, "config": cfg.to_json(), "additions": [],
                "scenarios": {s: {"variants": {}} for s in SCENARIOS}}
    added: dict[str, list[str]] = {}
    for rec in records:
        runs = data["scenarios"][rec["scenario"]]["variants"].setdefault(rec["variant"], {})
        runs[str(rec["seed"])] = rec
        added.setdefault(rec["scenario"], [])
        if rec["variant"] not in added[rec["scenario"]]:
            added[rec["scenario"]].append(rec["variant"])
    if existing is not None:
        data["additions"].append({"date": env["date"], "command": command, "variants": added,
                                  "lightning_fp8": env["lightning_fp8"], "torch": env["torch"]})
    data["summary"] = {s: docs_tables.convergence_summary(data, s) for s in SCENARIOS}
    return data


def plot(data: dict[str, Any], path: str) -> None:
    """Validation loss (top) and its relative gap to bf16 (bottom) of every variant, mean over the seeds; one
    column per scenario."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scenarios = [s for s in SCENARIOS if data["scenarios"][s]["variants"]]
    fig = Figure(figsize=(6.5 * len(scenarios), 8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(scenarios), squeeze=False)
    names = list(dict.fromkeys(n for s in scenarios for n in data["scenarios"][s]["variants"]))
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
               "tab:cyan"]
    fp8 = [n for n in names if n not in (BASELINE, TORCHAO)]
    colors = {BASELINE: "black", TORCHAO: "tab:gray", **{n: palette[i % len(palette)] for i, n in enumerate(fp8)}}
    for col, scenario in enumerate(scenarios):
        variants = data["scenarios"][scenario]["variants"]
        base = variants.get(BASELINE, {})
        seeds = sorted({s for runs in variants.values() for s in runs}, key=int)
        for name, runs in variants.items():
            style = {"color": colors[name], "linewidth": 2.2 if name == BASELINE else 1.3, "marker": "o",
                     "markersize": 3, "linestyle": "--" if name.endswith(EXCLUDE_SUFFIX) else "-", "label": name}
            curves = [r["val_curve"] for r in runs.values()]
            steps = [p[0] for p in curves[0]]
            axes[0][col].plot(steps, [sum(c[i][1] for c in curves) / len(curves) for i in range(len(steps))], **style)
            paired = [s for s in runs if s in base]
            if paired:
                gaps = [[100 * (runs[s]["val_curve"][i][1] / base[s]["val_curve"][i][1] - 1) for s in paired]
                        for i in range(len(steps))]
                axes[1][col].plot(steps, [sum(g) / len(g) for g in gaps], **style)
        top, bottom = axes[0][col], axes[1][col]
        title = "plain model" if scenario == "plain" else "planted massive activations"
        top.set_title(f"{title} ({len(seeds)} seeds)")
        top.set_ylabel("validation loss (mean over seeds)")
        bottom.set_ylabel("gap to bf16, % (mean over seeds)")
        bottom.axhline(0, color="black", linewidth=0.8)
        for ax in (top, bottom):
            ax.set_xlabel("training step")
            ax.grid(alpha=0.3)
        top.legend(fontsize=8)
        # the first validation is far above the rest: zoom on where the curves flatten
        later = [p[1] for runs in variants.values() for r in runs.values() for p in r["val_curve"][1:]]
        if later:
            low, high = min(later), max(later)
            top.set_ylim(low - 0.05 * (high - low + 1e-3), high + 0.1 * (high - low + 1e-3))
    fig.suptitle("Byte-level LM on the stdlib source: FP8 recipes against bf16 (CPU, FP8 GEMMs emulated)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)


# ----------------------------------------------------------------------------------------------- command line
def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from lightning_fp8.recipe import RECIPES

    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipes", type=_names, default=tuple(RECIPES),
                   help=f"comma-separated FP8 recipes, from {list(RECIPES)} (default: all); a subset is merged "
                   "into the existing result file")
    p.add_argument("--scenarios", type=_names, default=SCENARIOS, help="comma-separated, from plain,outliers")
    p.add_argument("--seeds", type=_ints, default=d.seeds, help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps per run")
    p.add_argument("--val-every", type=int, default=d.val_every, help="validate every this many steps")
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--layers", type=int, default=d.n_layers, help="transformer blocks")
    p.add_argument("--heads", type=int, default=d.n_heads)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--val-windows", type=int, default=d.val_windows, help="validation sequences")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--outlier-layers", type=_names, default=d.outlier_layers,
                   help="comma-separated globs of the Linear layers that get massive input tokens")
    p.add_argument("--outlier-factor", type=float, default=d.outlier_factor, help="a power of two")
    p.add_argument("--outlier-positions", type=_ints, default=d.outlier_positions, help="token positions")
    p.add_argument("--sensitivity-batches", type=int, default=d.sensitivity_batches,
                   help="training batches of the sensitivity report behind fp8-tensorwise+exclude")
    p.add_argument("--data-dir", default=None, help="a directory of .py files instead of the standard library")
    p.add_argument("--no-torchao", action="store_true", help="leave out the torchao variant")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes running runs")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--json", default=DEFAULT_JSON, help="result file (merged into if it exists)")
    p.add_argument("--plot", default=DEFAULT_PLOT, help="PNG of the loss curves")
    p.add_argument("--fresh", action="store_true", help="replace the result file instead of merging into it")
    args = p.parse_args(argv)
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        p.error(f"unknown recipe(s) {unknown}; choose from {list(RECIPES)}")
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario(s) {bad}; choose from {list(SCENARIOS)}")
    if args.steps % args.val_every:
        p.error("--steps must be a multiple of --val-every (the last step is validated)")
    return args


def config_from(args: argparse.Namespace) -> Config:
    return Config(
        seeds=args.seeds, dim=args.dim, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len,
        batch_size=args.batch_size, val_windows=args.val_windows, steps=args.steps, val_every=args.val_every,
        lr=args.lr, warmup_steps=args.warmup_steps, outlier_layers=args.outlier_layers,
        outlier_factor=args.outlier_factor, outlier_positions=args.outlier_positions,
        sensitivity_batches=args.sensitivity_batches, data_dir=args.data_dir,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = config_from(args)
    command = "python benchmarks/bench_convergence.py" + ("" if argv is None and len(sys.argv) == 1 else
                                                          " " + shlex.join(sys.argv[1:] if argv is None else argv))
    existing = None
    if os.path.exists(args.json) and not args.fresh:
        with open(args.json) as f:
            existing = json.load(f)
    have = {s: set(existing["scenarios"][s]["variants"]) for s in SCENARIOS} if existing else {s: set() for s in SCENARIOS}
    tasks: list[Task] = []
    for scenario in args.scenarios:
        names = variants_for(scenario, args.recipes, baselines=True, torchao=not args.no_torchao)
        # the baselines are measured once: a run that adds recipes reuses the file's
        names = [n for n in names if n not in (BASELINE, TORCHAO) or n not in have[scenario]]
        tasks += [(scenario, name, seed, None) for name in names for seed in cfg.seeds]
    # the outliers scenario's bf16 run is the plain one (checked on a few steps) wherever there is a plain one
    plain_bf16 = BASELINE in have["plain"] or ("plain", BASELINE, cfg.seeds[0], None) in tasks
    if plain_bf16:
        check = min(cfg.identity_check_steps, cfg.steps)
        tasks = [(s, v, seed, check if (s, v) == ("outliers", BASELINE) else None)
                 for s, v, seed, _ in tasks]
    torch.set_num_threads(args.threads)  # what the runs use (and what the environment reports)
    env = harness.environment()
    env["cores"] += f"; {args.workers} worker processes with {args.threads} thread(s) each"
    if existing is not None:  # refuse before hours of work, not after
        merge(existing, cfg, [], env, command)
    runs = sum(1 for t in tasks if t[3] is None)
    print(f"{runs} runs ({', '.join(args.scenarios)}; seeds {list(cfg.seeds)}) on {args.workers} workers", flush=True)
    start = time.perf_counter()
    records = run_all(cfg, tasks, args.workers, args.threads)
    if plain_bf16:
        reference = dict(existing["scenarios"]["plain"]["variants"].get(BASELINE, {})) if existing else {}
        reference.update({str(r["seed"]): r for r in records if (r["scenario"], r["variant"]) == ("plain", BASELINE)})
        records = outlier_baselines(cfg, records, reference, args.threads)
    wall = time.perf_counter() - start
    env["wall time of this run"] = f"{wall / 60:.1f} min for {runs} runs"
    data = merge(existing, cfg, records, env, command)
    harness.write_result(args.json, data["environment"], data["command"],
                         **{k: v for k, v in data.items() if k not in ("environment", "command")})
    print(f"wrote {os.path.relpath(args.json)}")
    if args.plot:
        plot(data, args.plot)
        print(f"wrote {os.path.relpath(args.plot)}")
    for scenario in SCENARIOS:
        if data["scenarios"][scenario]["variants"]:
            text = docs_tables.convergence_table(data, scenario) + "\n"
            print("\n" + text)
            if os.path.abspath(args.json) == os.path.abspath(DEFAULT_JSON):
                path = os.path.join(docs_tables.TABLES, TABLES[scenario])
                with open(path, "w") as f:
                    f.write(text)
                print(f"wrote {os.path.relpath(path)}")
    print(f"{runs} runs in {wall / 60:.1f} min")
    return data


if __name__ == "__main__":
    try:
        main()
    except ConfigMismatch as err:
        sys.exit(f"error: {err}")
