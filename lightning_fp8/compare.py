"""Is FP8 faster for my model? Train it a few steps in ``bf16-mixed`` and under each FP8 recipe, side by side.

:func:`compare_precisions` runs the same model, from the same initial weights, on the same batches in the same
order, once in Lightning's ``bf16-mixed`` and once per recipe under :class:`~lightning_fp8.FP8Precision`, each in
its own ``lightning.Trainer`` (no logger, no checkpoints, no validation). A small callback measures each run;
the result is a :class:`PrecisionComparison` (a Markdown table, a JSON file and a loss-curve plot).

From the command line, with the yaml you pass to ``fit --config``::

    python -m lightning_fp8.compare --config config.yaml --recipes tensorwise delayed --steps 50 --warmup 5

Where the FP8 GEMMs are emulated (no FP8 tensor cores: any CPU, GPUs below compute capability 8.9) the
report says so in its first line: the numerics are FP8's, the speed is not.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import importlib.util
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn
from typing_extensions import override

from lightning_fp8.gemm import gemm_path
from lightning_fp8.linear import FP8Linear
from lightning_fp8.precision import FP8Precision
from lightning_fp8.recipe import RECIPES

BASELINE = "bf16-mixed"
EMULATED_NOTE = (
    "**FP8 GEMMs are emulated on {device}: no speedup possible here; FP8 GEMMs need an NVIDIA GPU with compute "
    "capability >= 8.9 (Ada, Hopper, Blackwell).** The FP8 numerics (loss columns) are real. The speed columns "
    "compare the emulation (FP8 values multiplied in float32) with this device's bf16 matmuls, not FP8 hardware "
    "with bf16: where bf16 matmuls are slow (CPUs without AMX or AVX-512 BF16) the emulation can even look faster."
)
# FP8Precision arguments that tune one recipe; dropped when a config's plugin is run under another recipe.
_RECIPE_TUNING = ("fp8_format", "amax_compute_algo", "margin", "power_of_2_scale", "calibration_batches")
# Trainer options of a config that change what a training step computes; everything else is replaced.
_TRAINER_KEYS = ("accelerator", "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm")


@dataclass
class RunResult:
    """One training run of :func:`compare_precisions`.

    Attributes:
        name: ``"bf16-mixed"`` or ``"fp8-<recipe>"``.
        step_time_s: median wall time of one training step (forward, backward, optimizer step; data loading
            excluded) over the timed steps, i.e. after the warm-up steps. CUDA is synchronised at both ends. A
            step is an optimizer step: with ``accumulate_grad_batches`` it holds all its micro-batches.
        samples_per_s: samples of the first step (batch size times the micro-batches) / ``step_time_s``.
        tokens_per_s: tokens / ``step_time_s`` where the batch's first tensor holds token ids (an integer
            tensor of at least 2 dimensions, tokens = its number of elements), else ``None``.
        peak_memory_bytes: ``torch.cuda.max_memory_allocated`` over the run (weights, optimizer state and
            activations); ``None`` on CPU, where the process RSS cannot be reset between runs in one process.
        saved_for_backward_bytes: bytes of the tensors autograd saved for the backward of the first step,
            each storage counted once, the model's parameters not counted (they exist anyway): the
            activation memory a step holds between forward and backward.
        step_times_s: the wall time of every step, warm-up included.
        losses: the training loss of every step (with gradient accumulation: the sum of its micro-batches'
            losses as Lightning normalises them, i.e. their mean).
        linear_flops_per_step: matmul FLOPs of every ``nn.Linear`` called in one training step:
            ``3 * 2 * in_features * out_features * tokens`` per call (forward, input and weight gradients),
            counted in the first micro-batch, plus the input and output projections of every
            ``nn.MultiheadAttention`` (it runs them functionally: never in FP8).
        fp8_flops_share: the share of ``linear_flops_per_step`` computed by ``FP8Linear`` layers.
        fp8_layers: the layers converted to FP8.
        skipped_layers: ``{layer: reason}`` for the Linear layers kept in high precision.
        batch_fingerprints: a checksum of each batch (to check every run saw the same data).
        weights_fingerprint: a checksum of the parameters and buffers as the first step found them (to check every
            run started from the same weights).
    """

    name: str
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float | None
    peak_memory_bytes: int | None
    saved_for_backward_bytes: int
    step_times_s: list[float]
    losses: list[float]
    linear_flops_per_step: int
    fp8_flops_share: float
    fp8_layers: list[str] = field(default_factory=list)
    skipped_layers: dict[str, str] = field(default_factory=dict)
    batch_fingerprints: list[int] = field(default_factory=list)
    weights_fingerprint: int = 0


@dataclass
class PrecisionComparison:
    """The result of :func:`compare_precisions`: one :class:`RunResult` per precision, the baseline first.

    Table columns (:meth:`to_markdown`):

    * **step (ms)**: median time of a timed training step; **samples/s**, **tokens/s**: throughput from it;
      **speed vs bf16**: the baseline's step time divided by this run's (above 1: faster than bf16).
    * **peak memory**: CUDA's peak allocated memory over the run; "n/a on CPU".
    * **saved for backward**: activation memory of one step (see :class:`RunResult`).
    * **final loss**: the last step's training loss; **loss vs bf16**: mean over all steps of
      ``|loss - loss_bf16| / |loss_bf16|``.
    * **FP8 share of Linear FLOPs**: the part of the Linear layers' matmul FLOPs that runs in FP8.
    * **FP8 / skipped layers**: how many Linear layers were converted and kept in high precision.
    """

    runs: list[RunResult]
    device: str
    gemm_path: str
    steps: int
    warmup: int
    seed: int

    @property
    def emulated(self) -> bool:
        """Whether the FP8 GEMMs were emulated (no FP8 speedup possible on this device)."""
        return self.gemm_path != "native"

    @property
    def same_data(self) -> bool:
        """Whether every run trained on the same batches in the same order."""
        return all(r.batch_fingerprints == self.runs[0].batch_fingerprints for r in self.runs)

    @property
    def same_weights(self) -> bool:
        """Whether every run started from the same weights."""
        return all(r.weights_fingerprint == self.runs[0].weights_fingerprint for r in self.runs)

    def loss_difference(self, run: RunResult) -> float:
        """Mean over the steps of ``|loss - loss_baseline| / |loss_baseline|``."""
        base = self.runs[0].losses
        return statistics.fmean(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(run.losses, base))

    def to_dict(self) -> dict[str, Any]:
        """Everything, as plain values (what :meth:`save` writes as JSON)."""
        runs = []
        for run in self.runs:
            runs.append(
                {
                    **asdict(run),
                    "final_loss": run.losses[-1],
                    "final_loss_diff_vs_bf16": run.losses[-1] - self.runs[0].losses[-1],
                    "mean_abs_rel_loss_diff_vs_bf16": self.loss_difference(run),
                    "speedup_vs_bf16": self.runs[0].step_time_s / run.step_time_s,
                }
            )
        return {
            "device": self.device,
            "gemm_path": self.gemm_path,
            "emulated": self.emulated,
            "steps": self.steps,
            "warmup": self.warmup,
            "seed": self.seed,
            "same_data": self.same_data,
            "same_weights": self.same_weights,
            "runs": runs,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrecisionComparison:
        """The comparison back from :meth:`to_dict` (a saved ``compare.json``): ``from_dict(c.to_dict()) == c``."""
        names = {f.name for f in fields(RunResult)}
        runs = [RunResult(**{k: v for k, v in run.items() if k in names}) for run in data["runs"]]
        return cls(runs=runs, device=data["device"], gemm_path=data["gemm_path"], steps=data["steps"],
                   warmup=data["warmup"], seed=data["seed"])

    def to_markdown(self) -> str:
        """The report: the emulation warning (where it applies), the table, and the skipped layers with reasons."""
        lines = []
        if self.emulated:
            lines += [EMULATED_NOTE.format(device=self.device), ""]
        lines += [
            f"Device {self.device}, FP8 GEMM path: {self.gemm_path}. {self.steps} steps per run, the first "
            f"{self.warmup} untimed; seed {self.seed}; "
            + ("every run saw the same batches." if self.same_data else "**the runs saw different batches.**")
            + ("" if self.same_weights else " **the runs started from different weights.**"),
            "",
            (
                "| run | step (ms) | samples/s | tokens/s | speed vs bf16 | peak memory | saved for backward "
                "| final loss | loss vs bf16 | FP8 share of Linear FLOPs | FP8 / skipped layers |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        base = self.runs[0]
        for run in self.runs:
            memory = f"{run.peak_memory_bytes / 2**20:.1f} MiB" if run.peak_memory_bytes is not None else "n/a on CPU"
            tokens = f"{run.tokens_per_s:,.0f}" if run.tokens_per_s is not None else "n/a"
            lines.append(
                f"| {run.name} | {run.step_time_s * 1e3:.1f} | {run.samples_per_s:,.1f} | {tokens} "
                f"| {base.step_time_s / run.step_time_s:.2f}x | {memory} "
                f"| {run.saved_for_backward_bytes / 2**20:.2f} MiB "
                f"| {run.losses[-1]:.4f} | {100 * self.loss_difference(run):.2f}% | {100 * run.fp8_flops_share:.1f}% "
                f"| {len(run.fp8_layers)} / {len(run.skipped_layers)} |"
            )
        skipped = {name: why for run in self.runs[1:] for name, why in run.skipped_layers.items()}
        if skipped:
            lines += ["", "Linear layers kept in high precision:", ""]
            lines += [f"- `{name or '<root>'}`: {why}" for name, why in skipped.items()]
        return "\n".join(lines) + "\n"

    def plot(self, path: str | os.PathLike) -> None:
        """Save the loss curves of all runs to ``path`` (PNG)."""
        # A Figure with the Agg canvas, not pyplot: the caller's matplotlib backend (a notebook's) is left alone.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for run in self.runs:
            ax.plot(range(1, len(run.losses) + 1), run.losses, label=run.name, linewidth=1.2)
        ax.set_xlabel("training step")
        ax.set_ylabel("training loss")
        ax.set_title(f"Loss curves ({self.device}, FP8 GEMMs {self.gemm_path})")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)

    def save(self, folder: str | os.PathLike) -> dict[str, Path]:
        """Write ``compare.md``, ``compare.json`` and ``compare_loss.png`` to ``folder``; returns their paths."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        names = {"markdown": "compare.md", "json": "compare.json", "plot": "compare_loss.png"}
        paths = {kind: folder / name for kind, name in names.items()}
        paths["markdown"].write_text(self.to_markdown())
        paths["json"].write_text(json.dumps(self.to_dict(), indent=2))
        self.plot(paths["plot"])
        return paths


class _BF16Mixed(MixedPrecision):
    """Lightning's ``bf16-mixed``, with gradient clipping allowed for fused optimizers as under FP8Precision.

    Lightning refuses to clip with an optimizer that unscales gradients itself (``fused=True``) because of
    float16's loss scale; bf16 has no loss scale, so there is nothing to unscale and clipping is exact.
    """

    def __init__(self, device: str) -> None:
        super().__init__("bf16-mixed", device)

    @override
    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        kwargs = {} if gradient_clip_algorithm is None else {"gradient_clip_algorithm": gradient_clip_algorithm}
        Precision.clip_gradients(self, optimizer, clip_val=clip_val, **kwargs)


def _autocast_device(trainer_kwargs: dict[str, Any] | None) -> str:
    """The device type of the run, as Lightning picks it for ``precision="bf16-mixed"``."""
    from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator

    accelerator = (trainer_kwargs or {}).get("accelerator", "auto")
    if isinstance(accelerator, Accelerator):  # an instance: Trainer(accelerator=CUDAAccelerator())
        return "cuda" if isinstance(accelerator, CUDAAccelerator) else "cpu"
    return "cuda" if str(accelerator) in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "cpu"


class _StepProbe(Callback):
    """Times every training step; on the first step also counts the saved-for-backward bytes and Linear calls."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.losses: list[torch.Tensor] = []
        self._step_time = 0.0  # the micro-batches of the current optimizer step
        self._step_loss: torch.Tensor | None = None
        self._global_step = 0
        self.fingerprints: list[int] = []
        self.samples = 0
        self.weights = 0
        self.tokens: int | None = None
        self.saved: dict[tuple[str, int], int] = {}
        self.linear_calls: list[tuple[int, bool]] = []  # (forward FLOPs, runs in FP8)
        self._probes: list[Any] = []
        self._start = 0.0

    @staticmethod
    def _sync(trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._global_step = trainer.global_step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        tensors = _tensors(batch)
        self.fingerprints.append(zlib.crc32(b"".join(_tensor_bytes(t) for t in tensors)))
        if not self.step_times:  # the micro-batches of the first step: samples and tokens
            first = tensors[0] if tensors else None
            self.samples += len(first) if first is not None and first.dim() else 1
            ids = first is not None and first.dim() >= 2 and not first.is_floating_point() and not first.is_complex()
            if len(self.fingerprints) == 1:
                self.tokens = 0 if ids else None
            if self.tokens is not None:
                self.tokens = self.tokens + first.numel() if ids else None
        if len(self.fingerprints) == 1:  # the first micro-batch: weights, memory and FLOPs
            state = [t for t in pl_module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
            self.weights = zlib.crc32(b"".join(_tensor_bytes(t) for t in state))
            self._start_probes(pl_module)
        self._start = time.perf_counter()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._stop_probes()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        self._step_time += time.perf_counter() - self._start
        self._stop_probes()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = loss.detach().float() if isinstance(loss, torch.Tensor) else torch.tensor(float("nan"))
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        if trainer.global_step != self._global_step:  # an optimizer step ended with this micro-batch
            self._global_step = trainer.global_step
            self.step_times.append(self._step_time)
            self.losses.append(self._step_loss)
            self._step_time, self._step_loss = 0.0, None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_probes()

    def _start_probes(self, module: nn.Module) -> None:
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            try:
                storage = tensor.untyped_storage()
                key, nbytes = (str(tensor.device), storage.data_ptr()), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
                key, nbytes = ("id", id(tensor)), tensor.numel() * tensor.element_size()
            if key[1] not in params:
                self.saved[key] = nbytes
            return tensor

        def count(layer: nn.Module, args: tuple, output: Any) -> None:
            rows = args[0].numel() // layer.in_features
            self.linear_calls.append((2 * layer.in_features * layer.out_features * rows, isinstance(layer, FP8Linear)))

        def count_attention(layer: nn.MultiheadAttention, args: tuple, kwargs: dict, output: Any) -> None:
            # q, k, v and output projections, as F.multi_head_attention_forward runs them (in high precision)
            inputs = [*args, *(kwargs[k] for k in ("query", "key", "value") if k in kwargs)][:3]
            rows = [x.numel() // x.shape[-1] for x in inputs]
            dims = (layer.embed_dim, layer.kdim, layer.vdim)
            flops = 2 * layer.embed_dim * (sum(r * d for r, d in zip(rows, dims)) + rows[0] * layer.embed_dim)
            self.linear_calls.append((flops, False))

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        hooks.__enter__()
        self._probes = [hooks] + [m.register_forward_hook(count) for m in module.modules() if isinstance(m, nn.Linear)]
        self._probes += [
            m.register_forward_hook(count_attention, with_kwargs=True)
            for m in module.modules()
            if isinstance(m, nn.MultiheadAttention)
        ]

    def _stop_probes(self) -> None:
        for probe in reversed(self._probes):
            if isinstance(probe, torch.autograd.graph.saved_tensors_hooks):
                probe.__exit__(None, None, None)
            else:
                probe.remove()
        self._probes = []


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _tensors(item)]
    return []


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _check_arguments(recipes: Sequence[str], steps: int, warmup: int) -> list[str]:
    recipes = list(recipes)
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise ValueError(f"unknown recipe(s) {unknown}; choose from {list(RECIPES)}")
    if len(set(recipes)) != len(recipes):
        raise ValueError(f"recipes are listed twice: {recipes}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the first step is measured for memory, not time), got {warmup}")
    if steps <= warmup:
        raise ValueError(f"steps must be larger than warmup (steps={steps}, warmup={warmup}): no step would be timed")
    return recipes


def compare_precisions(
    module_factory: Callable[[], L.LightningModule],
    data: L.LightningDataModule | torch.utils.data.DataLoader,
    recipes: Sequence[str] = ("tensorwise", "delayed", "rowwise"),
    steps: int = 50,
    warmup: int = 5,
    seed: int = 0,
    out_dir: str | os.PathLike | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    fp8_kwargs: dict[str, Any] | None = None,
) -> PrecisionComparison:
    """Train ``steps`` steps in ``bf16-mixed`` and under ``FP8Precision(recipe=r)`` for each recipe; compare.

    Every run starts from a model made by ``module_factory`` after ``lightning.seed_everything(seed)`` (so a
    factory that builds a fresh model gives the same initial weights each time) and trains on the same batches
    in the same order, in its own ``lightning.Trainer`` on one device (no logger, checkpoints, validation or
    progress bar). The first ``warmup`` steps are not timed; the first step is also where the activation memory
    and the Linear layers' FLOPs are counted. The columns are described in :class:`PrecisionComparison`.

    Args:
        module_factory: returns a new ``LightningModule`` with the same initial weights on every call.
        data: a ``LightningDataModule`` or a training ``DataLoader``.
        recipes: FP8 recipes to run, from ``"tensorwise"``, ``"delayed"``, ``"rowwise"``.
        steps: training steps per run, warm-up included.
        warmup: untimed steps at the start of each run (at least 1).
        seed: seed set before each model is made and before each run.
        out_dir: where to save the report (:meth:`PrecisionComparison.save`) and the Trainers' root dir;
            ``None``: nothing is saved, the Trainers write to a temporary directory.
        trainer_kwargs: more ``lightning.Trainer`` arguments for every run (e.g. ``accelerator``,
            ``gradient_clip_val``). What the comparison sets itself replaces them: ``precision``, ``plugins``,
            ``devices=1``, ``max_steps``, ``callbacks``, no logger, checkpoints, validation or progress bar.
        fp8_kwargs: more ``FP8Precision`` arguments for the FP8 runs (e.g. ``exclude=["lm_head"]``). A
            ``recipe`` entry names the recipe they were written for: their recipe tuning (``fp8_format``,
            ``amax_compute_algo``, ``margin``, ``power_of_2_scale``) then applies to that recipe's run only.

    Returns:
        A :class:`PrecisionComparison`, the ``bf16-mixed`` run first.

    Raises:
        ValueError: for an unknown recipe, ``warmup < 1`` or ``steps <= warmup``.
    """
    recipes = _check_arguments(recipes, steps, warmup)
    runs: list[RunResult] = []
    models: list[weakref.ref] = []  # every run's model, to refuse a factory that hands out the same one again
    device = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        for name in [BASELINE, *(f"fp8-{r}" for r in recipes)]:
            if name == BASELINE:
                plugin: Precision = _BF16Mixed(_autocast_device(trainer_kwargs))
            else:
                recipe = name[len("fp8-") :]
                plugin = FP8Precision(**_fp8_kwargs_for(fp8_kwargs, recipe), recipe=recipe)
            with _quiet_lightning():  # the device lines and tips, once per run, would hide each run's FP8 line
                trainer = L.Trainer(
                    **{
                        **(trainer_kwargs or {}),
                        "precision": None,
                        "plugins": [plugin],
                        "devices": 1,
                        "max_steps": steps,
                        "limit_val_batches": 0,
                        "num_sanity_val_steps": 0,
                        "logger": False,
                        "enable_checkpointing": False,
                        "enable_progress_bar": False,
                        "enable_model_summary": False,
                        "callbacks": [_StepProbe()],
                        "default_root_dir": str(out_dir) if out_dir is not None else tmp,
                    }
                )
            runs.append(_train(name, trainer, module_factory, data, seed, warmup, models))
            device = str(trainer.strategy.root_device)
    result = PrecisionComparison(runs, device, gemm_path(device), steps, warmup, seed)
    if out_dir is not None:
        result.save(out_dir)
    return result


def _train(name: str, trainer: L.Trainer, module_factory: Callable[[], L.LightningModule], data: Any, seed: int,
           warmup: int, models: list[weakref.ref]) -> RunResult:
    """One run: a new model from the seed, ``trainer.fit``, then the probe's measurements as a :class:`RunResult`."""
    probe = next(c for c in trainer.callbacks if isinstance(c, _StepProbe))
    # The previous run's Trainer, model and optimizer state reference each other: free them before this run (on
    # CUDA they would count in this run's peak memory).
    gc.collect()
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.empty_cache()
    L.seed_everything(seed, verbose=False)
    model = module_factory()
    if any(model is earlier() for earlier in models):
        raise ValueError(
            f"{name}: module_factory returned the model of an earlier run (trained, maybe converted to FP8): it must "
            "build a new model on every call, e.g. pass the class or `lambda: MyModel(...)`, not `lambda: model`"
        )
    models.append(weakref.ref(model))
    L.seed_everything(seed, verbose=False)  # the same data order whatever the factory drew
    device = trainer.strategy.root_device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if isinstance(data, L.LightningDataModule):
        trainer.fit(model, datamodule=data)
    else:
        trainer.fit(model, train_dataloaders=data)
    if len(probe.step_times) < trainer.max_steps:
        raise RuntimeError(f"{name}: the data ran out after {len(probe.step_times)} of {trainer.max_steps} steps")
    report = getattr(trainer.precision_plugin, "report", None)
    step_time = statistics.median(probe.step_times[warmup:])
    flops = 3 * sum(f for f, _ in probe.linear_calls)
    return RunResult(
        name=name,
        step_time_s=step_time,
        samples_per_s=probe.samples / step_time,
        tokens_per_s=probe.tokens / step_time if probe.tokens is not None else None,
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        saved_for_backward_bytes=sum(probe.saved.values()),
        step_times_s=probe.step_times,
        losses=[float(x) for x in torch.stack(probe.losses).cpu()],
        linear_flops_per_step=flops,
        fp8_flops_share=3 * sum(f for f, fp8 in probe.linear_calls if fp8) / flops if flops else 0.0,
        fp8_layers=list(report.fp8_layers) if report is not None else [],
        skipped_layers=dict(report.skipped) if report is not None else {},
        batch_fingerprints=probe.fingerprints,
        weights_fingerprint=probe.weights,
    )


# ----------------------------------------------------------------------------------------------- command line
def load_class(spec: str) -> type:
    """``"package.module.Class"`` or ``"path/to/file.py:Class"`` -> the class (a file is imported as a module)."""
    if ":" in spec:
        path, _, name = spec.rpartition(":")
        module_name = f"_compare_{Path(path).stem}_{zlib.crc32(str(Path(path).resolve()).encode()):08x}"
        module = sys.modules.get(module_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(module_name, path)
            if loader is None or not Path(path).is_file():
                raise FileNotFoundError(f"{path} (from {spec!r}) is not a Python file")
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module
            loader.loader.exec_module(module)
    else:
        module_name, _, name = spec.rpartition(".")
        module = importlib.import_module(module_name)
    return getattr(module, name)


def _from_config(config: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The trainer options kept from a LightningCLI config, and the init_args of its FP8Precision plugin."""
    trainer = config["trainer"]
    trainer_kwargs = {k: trainer[k] for k in _TRAINER_KEYS if trainer.get(k) is not None}
    plugins = trainer.get("plugins") or []
    plugins = plugins if isinstance(plugins, list) else [plugins]
    fp8 = [p for p in plugins if str(getattr(p, "class_path", "")).endswith("FP8Precision")]
    return trainer_kwargs, (fp8[0].init_args.as_dict() if fp8 else None)


def _names_a_class(config: str, key: str, overrides: Sequence[str]) -> bool:
    """Whether the config's ``model`` / ``data`` entry, or an override, has a ``class_path`` (or is a class name)."""
    import yaml

    with open(config) as f:
        entry = (yaml.safe_load(f) or {}).get(key)
    named = entry is None or isinstance(entry, str) or (isinstance(entry, dict) and "class_path" in entry)
    return named or any(o == f"--{key}" or o.startswith((f"--{key}=", f"--{key}.class_path")) for o in overrides)


def _fp8_kwargs_for(plugin_args: dict[str, Any] | None, recipe: str) -> dict[str, Any]:
    args = dict(plugin_args or {})
    if args.pop("recipe", recipe) != recipe:
        for key in _RECIPE_TUNING:
            args.pop(key, None)
    return args


def main(argv: Sequence[str] | None = None) -> PrecisionComparison:
    """``python -m lightning_fp8.compare --config CONFIG [options] [LightningCLI overrides]``."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_fp8.cli import FP8ArgumentParser

    parser = argparse.ArgumentParser(
        prog="python -m lightning_fp8.compare",
        description="Train a LightningCLI config's model a few steps in bf16-mixed and under each FP8 recipe, and "
        "compare speed, memory, loss and FP8 coverage. Other arguments (e.g. --model.init_args.dim=64, "
        "--data.batch_size=8) are passed to LightningCLI as overrides of the config.",
        allow_abbrev=False,
    )
    parser.add_argument("--config", required=True, help="the yaml you pass to `fit --config`")
    parser.add_argument("--model-class", help="the LightningModule, if the config has no model.class_path: "
                        "package.module.Class or path/to/file.py:Class")
    parser.add_argument("--data-class", help="the LightningDataModule, if the config has no data.class_path")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), help=f"FP8 recipes, from {list(RECIPES)}")
    parser.add_argument("--steps", type=int, default=50, help="training steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each run")
    parser.add_argument("--seed", type=int, help="default: the config's seed_everything, else 0")
    parser.add_argument("--out", default="fp8_compare", help="folder for compare.md, compare.json, compare_loss.png")
    args, overrides = parser.parse_known_args(argv)
    try:
        _check_arguments(args.recipes, args.steps, args.warmup)
    except ValueError as err:
        parser.error(str(err))

    for key in ("model", "data"):
        if getattr(args, f"{key}_class") is None and not _names_a_class(args.config, key, overrides):
            parser.error(
                f"{args.config}: {key}: has no class_path (a config for a script that passes its classes to "
                f"LightningCLI): name the class with --{key}-class package.module.Class or path/to/file.py:Class"
            )
    model_class = load_class(args.model_class) if args.model_class else None
    data_class = load_class(args.data_class) if args.data_class else None
    with warnings.catch_warnings():  # "args= given and sys.argv too": sys.argv is this command's, parsed above
        warnings.filterwarnings("ignore", "LightningCLI's args parameter")
        cli = LightningCLI(
            model_class,
            data_class,
            run=False,
            args=["--config", args.config, *overrides],
            parser_class=FP8ArgumentParser,
            save_config_callback=None,
            subclass_mode_model=model_class is None,
            subclass_mode_data=data_class is None,
        )
    trainer_kwargs, plugin_args = _from_config(cli.config)
    config_seed = cli.config.get("seed_everything")
    seed = args.seed if args.seed is not None else (config_seed if type(config_seed) is int else 0)
    template = cli.model
    if cli.datamodule is None:
        raise SystemExit("the config has no data: the comparison needs a LightningDataModule (data: ...)")

    result = compare_precisions(
        lambda: copy.deepcopy(template),
        cli.datamodule,
        recipes=args.recipes,
        steps=args.steps,
        warmup=args.warmup,
        seed=seed,
        out_dir=args.out,
        trainer_kwargs=trainer_kwargs,
        fp8_kwargs=plugin_args,
    )
    print(result.to_markdown())
    print(f"Saved to {os.path.abspath(args.out)}: compare.md, compare.json, compare_loss.png")
    return result


if __name__ == "__main__":
    main()
