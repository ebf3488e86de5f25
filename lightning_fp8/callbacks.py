"""FP8StatsCallback: the FP8 health of a run, logged to any Lightning logger at almost no cost.

The numbers come from :class:`lightning_fp8.FP8Stats` (see :mod:`lightning_fp8.stats` for the metric
names): on a logging step, one batched device snapshot of all FP8 state tables, one cross-rank
reduction, one device-to-host copy. On every other step this callback does nothing: no transfer, no
sync. The callback formats and logs: scalars to every logger and to ``trainer.callback_metrics`` (so
``ModelCheckpoint`` and ``EarlyStopping`` can monitor them), the amax history as a histogram per layer
and tensor (``fp8/<layer>/<tensor>/amax_history``, TensorBoard and W&B), a heatmap (layers x steps,
log10 amax, one panel per tensor) to TensorBoard and W&B and, for every logger with a local directory
(and always at the end of fit), to ``fp8_amax_heatmap.png``; alerts; and an end-of-fit summary table.

A run whose last step is not a logging step gets one more reading at its end (logged like the others, at
the last batch's step), so the summary and the heatmap cover the whole run, also when the run is shorter
than the logging interval (the callback warns about that at the start of training). ``include`` /
``exclude`` patterns that match no FP8 layer are an error at the start of fit, naming the closest layer
names.

Under DDP the values are reduced across ranks (amax: max, scale: min, counts: sum) and written once, by
rank 0 (Lightning loggers only write on rank 0). Every rank holds every layer's state, so a layer
that did not run on some rank contributes zeros and cannot cause a hang.
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.callbacks import Callback

from lightning_fp8.fabric import FP8PrecisionBase
from lightning_fp8.heatmap import amax_heatmap_figure, finite_positive
from lightning_fp8.quantize import AMAX_BIN_HIGH
from lightning_fp8.recipe import ROLES
from lightning_fp8.stats import FP8Stats, LayerReading, amax_bin_edges

TROUBLESHOOTING = "docs/troubleshooting.md"
HEATMAP_FILE = "fp8_amax_heatmap.png"


def stats_source(trainer: pl.Trainer, pl_module: torch.nn.Module) -> Any:
    """What a callback's ``FP8Stats`` reads: the Trainer's FP8 precision plugin (its models, loss scale and skipped
    steps), or the LightningModule itself when the Trainer runs another precision."""
    plugin = trainer.precision_plugin
    return plugin if isinstance(plugin, FP8PrecisionBase) else pl_module


class FP8StatsCallback(Callback):
    """Log FP8 statistics (amax, scale, overflow/underflow fractions, loss scale, skipped steps).

    Args:
        log_every_n_steps: log every this many optimizer steps; ``None`` (default) follows the Trainer's
            ``log_every_n_steps``. The last step of the run is always read (summary and heatmap cover the whole
            run); an interval longer than the run warns once at the start of training.
        include: glob patterns (``fnmatch``) of FP8 layer names to log (default: all FP8 layers).
        exclude: glob patterns of FP8 layer names not to log.
        histograms: send amax-history histograms to loggers that support them (TensorBoard, W&B).
        heatmap_every_n_logs: also draw the heatmap every this many logging steps (``0``: only at the end).
        heatmap_max_points: keep this many logging steps for the heatmap (oldest dropped).
        overflow_alert_threshold: warn when a tensor's overflow fraction stays above this value for
            ``alert_patience`` consecutive logs (``None`` disables the alert).
        alert_patience: consecutive logs above the threshold before the warning (a log whose interval counted
            nothing for the tensor, see ``statistics_every_n_steps``, neither clears nor extends the streak).
        summary: print the per-layer summary table at the end of fit (rank 0).

    Raises:
        ValueError: for invalid settings, naming the field; at the start of fit, for an ``include`` or ``exclude``
            pattern that matches no FP8 layer (naming the closest FP8 layer names); an ``exclude`` pattern that
            matches a layer the plugin keeps in high precision is accepted (that layer is not logged anyway).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        histograms: bool = True,
        heatmap_every_n_logs: int = 0,
        heatmap_max_points: int = 500,
        overflow_alert_threshold: float | None = 0.01,
        alert_patience: int = 3,
        summary: bool = True,
    ) -> None:
        if log_every_n_steps is not None and (isinstance(log_every_n_steps, bool) or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be None or an int >= 1, got {log_every_n_steps!r}")
        for field, value in (("include", include), ("exclude", exclude)):
            if value is not None and (isinstance(value, str) or not all(isinstance(p, str) for p in value)):
                raise ValueError(f"{field} must be a list of glob patterns (strings), got {value!r}")
        if heatmap_every_n_logs < 0:
            raise ValueError(f"heatmap_every_n_logs must be >= 0, got {heatmap_every_n_logs}")
        if heatmap_max_points < 1:
            raise ValueError(f"heatmap_max_points must be >= 1, got {heatmap_max_points}")
        if overflow_alert_threshold is not None and not 0 <= overflow_alert_threshold < 1:
            raise ValueError(f"overflow_alert_threshold must be in [0, 1) or None, got {overflow_alert_threshold}")
        if alert_patience < 1:
            raise ValueError(f"alert_patience must be >= 1, got {alert_patience}")
        self.log_every_n_steps = log_every_n_steps
        self.include = list(include) if include is not None else ["*"]
        self.exclude = list(exclude or [])
        self.histograms = histograms
        self.heatmap_every_n_logs = heatmap_every_n_logs
        self.heatmap_max_points = heatmap_max_points
        self.overflow_alert_threshold = overflow_alert_threshold
        self.alert_patience = alert_patience
        self.summary = summary
        #: Names of the logged FP8 layers, in metric order (``fp8/worst/*_layer`` index into it).
        self.layer_names: list[str] = []
        self.last_metrics: dict[str, float] = {}
        self._stats = FP8Stats(None, include=self.include, exclude=self.exclude)
        self._last_logged_step = -1
        self._above: dict[str, int] = {}
        self._alerted: set[str] = set()
        self._heatmap_steps: list[int] = []
        self._heatmap_amax: list[list[list[float]]] = []
        self._heatmap_layers: list[list[str]] = []  # the layers of each column (an FP8FallbackCallback drops some)
        self._logs = 0
        self._warned_no_logger = False
        self._warned_interval = False
        self._tail_step: int | None = None  # heatmap column of an end-of-run reading off the interval

    @property
    def fetches(self) -> int:
        """Batched device-to-host copies made (one per logging step, plus the baseline, the reading at the end of
        training, and one per checkpoint saved: see :meth:`lightning_fp8.FP8Stats.state_dict`)."""
        return self._stats.fetches

    @property
    def _total_counts(self) -> dict[str, list[list[float]]]:
        return self._stats.total_counts

    # ------------------------------------------------------------------ hooks
    def _every(self, trainer: pl.Trainer) -> int:
        return self.log_every_n_steps or max(1, trainer.log_every_n_steps or 1)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The models are converted by now: check the ``include`` / ``exclude`` patterns against their FP8 layers."""
        self._stats.source = stats_source(trainer, pl_module)
        self._check_patterns(trainer)

    def _check_patterns(self, trainer: pl.Trainer) -> None:
        kept = {}  # layers in high precision, with the reason (only known through the plugin)
        plugin = trainer.precision_plugin
        if isinstance(plugin, FP8PrecisionBase) and len(plugin.reports) == 1:
            kept = dict(plugin.reports[0].skipped)
        self._stats.check_patterns(kept, owner=f"FP8StatsCallback(include={self.include!r}, exclude={self.exclude!r})")

    def _run_length(self, trainer: pl.Trainer) -> int | None:
        """Optimizer steps the run ends at, as Lightning estimates them; ``None`` if unknown or unbounded."""
        try:
            total = trainer.estimated_stepping_batches
        except Exception:  # e.g. accumulate_grad_batches that changes between epochs
            return None
        if not isinstance(total, (int, float)) or not math.isfinite(total) or total <= 0:
            return None
        return int(total)

    def _warn_if_interval_exceeds_run(self, trainer: pl.Trainer) -> None:
        if self._warned_interval:
            return
        total = self._run_length(trainer)
        every = self._every(trainer)
        if total is None or (trainer.global_step // every + 1) * every <= total:
            return
        self._warned_interval = True
        source = (
            f"FP8StatsCallback(log_every_n_steps={self.log_every_n_steps})"
            if self.log_every_n_steps
            else f"Trainer(log_every_n_steps={trainer.log_every_n_steps}), which FP8StatsCallback follows"
        )
        rank_zero_warn(
            f"FP8StatsCallback: the logging interval of {every} steps ({source}) is longer than the run of {total} "
            "optimizer steps: no step of this run is a logging step, so FP8 statistics are read only once, at the end "
            f"of training (for the summary and the heatmap). To log during the run, set "
            f"FP8StatsCallback(log_every_n_steps=N) with N <= {total}."
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stats.source = stats_source(trainer, pl_module)
        self._warn_if_interval_exceeds_run(trainer)
        if not trainer.loggers and not self._warned_no_logger:
            self._warned_no_logger = True
            rank_zero_warn(
                "FP8StatsCallback: the Trainer has no logger, so FP8 statistics are not logged. The summary table "
                f"is still printed at the end of fit and the heatmap saved to {trainer.default_root_dir}."
            )
        if not self._stats.has_baseline:  # a resumed callback keeps its own baseline
            self._stats.take_baseline()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_logged_step or step % self._every(trainer) != 0 or step == 0:
            return
        self._last_logged_step = step
        self.log_now(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Read the steps since the last logging step (every rank: the reading is reduced across ranks), so that the
        summary and the heatmap cover the whole run, also a run shorter than the logging interval."""
        step = trainer.global_step
        if step == 0 or step == self._last_logged_step:
            return
        self._last_logged_step = step
        # the step axis of the last batch's metrics (Lightning has counted that batch by now)
        batches = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", step)
        self.log_now(trainer, pl_module, step=max(0, batches - 1))
        self._tail_step = step

    def log_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int | None = None) -> dict[str, float]:
        """Read, reduce, copy once and log the statistics now; returns the metrics (``/``-separated names).

        ``step``: the logger step (default: the step axis of Lightning's metrics of the current batch)."""
        self._stats.source = stats_source(trainer, pl_module)
        reading = self._stats.read()
        if reading is None:
            return {}
        metrics = self._stats.metrics(reading)
        self.layer_names = list(self._stats.layer_names)
        self._logs += 1
        self.last_metrics = metrics
        self._alerts(reading.layers)
        self._remember_heatmap(trainer.global_step, reading.layers)
        if step is None:
            step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        # One read: each access of trainer.callback_metrics recomputes Lightning's result collection.
        trainer.callback_metrics.update({key: torch.tensor(value) for key, value in metrics.items()})
        for logger in trainer.loggers:
            sep = getattr(logger, "group_separator", "/")
            logger.log_metrics({k.replace("/", sep): v for k, v in metrics.items()}, step=step)
        if trainer.is_global_zero:
            if self.histograms:
                self._log_histograms(trainer, reading.layers, step)
            if self.heatmap_every_n_logs and self._logs % self.heatmap_every_n_logs == 0:
                self._log_heatmap(trainer, step, final=False)
        return metrics

    # ------------------------------------------------------------------ alerts
    def _alerts(self, layers: dict[str, LayerReading]) -> None:
        for name, layer in layers.items():
            for r, role in enumerate(ROLES):
                key = f"{name}/{role}"
                amax = layer.history[r][0]
                if not math.isfinite(amax) and f"nonfinite:{key}" not in self._alerted:
                    self._alerted.add(f"nonfinite:{key}")
                    rank_zero_warn(
                        f"FP8: the amax of layer {name!r} ({role}) is {amax}: a NaN or Inf reached this layer. "
                        f"See {TROUBLESHOOTING}#nan-or-divergence."
                    )
                if self.overflow_alert_threshold is None:
                    continue
                frac = self.last_overflow(name, r)
                if frac is None:  # nothing counted in this interval (statistics_every_n_steps): no news, no reset
                    continue
                if frac > self.overflow_alert_threshold:
                    self._above[key] = self._above.get(key, 0) + 1
                    if self._above[key] >= self.alert_patience and key not in self._alerted:
                        self._alerted.add(key)
                        if layer.recipe == "delayed":
                            advice = "the delayed scale lags the tensor: try margin=1 or a shorter amax_history_len"
                        else:
                            advice = "with current scaling only NaN or Inf elements overflow: look for them upstream"
                        rank_zero_warn(
                            f"FP8: layer {name!r} ({role}) has overflowed on {frac:.2%} of its elements for "
                            f"{self._above[key]} consecutive logs (threshold {self.overflow_alert_threshold:.2%}); "
                            f"{advice}, or exclude the layer. See {TROUBLESHOOTING}#overflows."
                        )
                else:
                    self._above[key] = 0
                    self._alerted.discard(key)

    def last_overflow(self, layer: str, role: int) -> float | None:
        """Overflow fraction of ``layer``'s tensor ``role`` in the most recent logged interval."""
        return self.last_metrics.get(f"fp8/{layer}/{ROLES[role]}/overflow_frac")

    # ------------------------------------------------------------------ media
    def _remember_heatmap(self, step: int, layers: dict[str, LayerReading]) -> None:
        if self._tail_step is not None and self._heatmap_steps and self._heatmap_steps[-1] == self._tail_step:
            # training went on after an end-of-run reading (a resumed run): keep the heatmap on the interval grid
            del self._heatmap_steps[-1], self._heatmap_amax[-1], self._heatmap_layers[-1]
        self._tail_step = None
        self._heatmap_steps.append(step)
        self._heatmap_amax.append([layer.amax for layer in layers.values()])
        self._heatmap_layers.append(list(layers))
        if len(self._heatmap_steps) > self.heatmap_max_points:
            del self._heatmap_steps[0], self._heatmap_amax[0], self._heatmap_layers[0]

    def _heatmap_grid(self) -> tuple[list[str], list[list[list[float]]]]:
        """Rows: every layer any column has, in order of appearance; a layer missing from a column (switched to high
        precision by an ``FP8FallbackCallback``, for example) is a blank cell there."""
        names = list(dict.fromkeys(name for column in self._heatmap_layers for name in column))
        blank = [math.nan] * len(ROLES)
        grid = []
        for column, amax in zip(self._heatmap_layers, self._heatmap_amax):
            by_name = dict(zip(column, amax))
            grid.append([by_name.get(name, blank) for name in names])
        return names, grid

    def _log_histograms(self, trainer: pl.Trainer, layers: dict[str, LayerReading], step: int) -> None:
        for logger in trainer.loggers:
            kind = type(logger).__name__
            if kind not in ("TensorBoardLogger", "WandbLogger"):
                continue
            for name, layer in layers.items():
                for r, role in enumerate(ROLES):
                    values = finite_positive(layer.history[r])
                    if not values:
                        continue
                    tag = f"fp8/{name}/{role}/amax_history"
                    if kind == "TensorBoardLogger":
                        logger.experiment.add_histogram(tag, torch.tensor(values), global_step=step)
                    else:
                        import wandb

                        logger.experiment.log({tag: wandb.Histogram(values), "trainer/global_step": step})
                    if layer.amax_bins:
                        self._log_block_amax(logger, kind, f"fp8/{name}/{role}/block_amax_log2", layer.amax_bins[r], step)

    @staticmethod
    def _log_block_amax(logger: Any, kind: str, tag: str, histogram: list[float], step: int) -> None:
        """The histogram of the row / block amaxes since the start (finite, non-zero ones), over log2(amax)."""
        edges = [math.log2(e) for e in amax_bin_edges()[1:-1]] + [AMAX_BIN_HIGH + 1.0]  # bins 1 .. N-2
        counts = histogram[1:-1]
        used = [i for i, c in enumerate(counts) if c > 0]
        if not used:
            return
        lo, hi = used[0], used[-1] + 1
        counts, edges = counts[lo:hi], edges[lo : hi + 1]
        if kind == "TensorBoardLogger":
            mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
            logger.experiment.add_histogram_raw(
                tag,
                min=edges[0],
                max=edges[-1],
                num=int(sum(counts)),
                sum=sum(c * m for c, m in zip(counts, mids)),
                sum_squares=sum(c * m * m for c, m in zip(counts, mids)),
                bucket_limits=edges[1:],
                bucket_counts=counts,
                global_step=step,
            )
        else:
            import wandb

            logger.experiment.log({tag: wandb.Histogram(np_histogram=(counts, edges)), "trainer/global_step": step})

    def _log_heatmap(self, trainer: pl.Trainer, step: int, final: bool) -> list[str]:
        """Send the heatmap to loggers with media support and save the PNG where there is a directory."""
        if not self._heatmap_steps or not self.layer_names:
            return []
        import matplotlib.pyplot as plt

        names, grid = self._heatmap_grid()
        fig = amax_heatmap_figure(names, self._heatmap_steps, grid)
        paths: list[str] = []
        directories = []
        for logger in trainer.loggers:
            kind = type(logger).__name__
            if kind == "TensorBoardLogger":
                logger.experiment.add_figure("fp8/amax_heatmap", fig, global_step=step, close=False)
            elif kind == "WandbLogger":
                import wandb

                logger.log_image("fp8/amax_heatmap", [wandb.Image(fig)], step=step)
            directory = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
            if directory:
                directories.append(directory)
        if final and not directories:
            directories.append(trainer.default_root_dir)
        for directory in dict.fromkeys(directories):
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, HEATMAP_FILE)
            fig.savefig(path, dpi=110)
            paths.append(path)
        plt.close(fig)
        return paths

    # ------------------------------------------------------------------ end of fit
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        if self.summary and self._stats.total_counts:
            rank_zero_info(self.summary_table())
        paths = self._log_heatmap(trainer, trainer.global_step, final=True)
        if paths:
            rank_zero_info(f"FP8 amax heatmap saved to {', '.join(paths)}")

    def summary_table(self, top: int | None = None) -> str:
        """Per-layer table, worst offenders first: cumulative overflow/underflow fractions, last amax and scale."""
        rows = []
        for name, totals in self._stats.total_counts.items():
            for r, role in enumerate(ROLES):
                seen, nonzero, over, under = totals[r]
                rows.append(
                    (
                        over / seen if seen else 0.0,
                        under / nonzero if nonzero else 0.0,
                        name,
                        role,
                        self.last_metrics.get(f"fp8/{name}/{role}/amax", float("nan")),
                        self.last_metrics.get(f"fp8/{name}/{role}/scale", float("nan")),
                    )
                )
        rows.sort(key=lambda row: (-row[0], -row[1], row[2], row[3]))
        if top is not None:
            rows = rows[:top]
        width = max([len("layer")] + [len(r[2]) for r in rows])
        lines = [
            "FP8 summary (whole run, worst first)",
            f"{'layer':<{width}}  {'tensor':<11}  {'overflow':>9}  {'underflow':>9}  {'amax':>10}  {'scale':>10}",
        ]
        for over, under, name, role, amax, scale in rows:
            lines.append(f"{name:<{width}}  {role:<11}  {over:>9.3%}  {under:>9.3%}  {amax:>10.4g}  {scale:>10.4g}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "stats": self._stats.state_dict(),
            "last_logged_step": self._last_logged_step,
            "above": self._above,
            "alerted": sorted(self._alerted),
            "heatmap_steps": self._heatmap_steps,
            "heatmap_amax": self._heatmap_amax,
            "heatmap_layers": self._heatmap_layers,
            "layer_names": self.layer_names,
            "logs": self._logs,
            "tail_step": self._tail_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "stats" in state_dict:
            self._stats.load_state_dict(state_dict["stats"])
        else:  # written by lightning-fp8 0.1
            self._stats.load_state_dict(
                {
                    "last_counts": state_dict["last_counts"],
                    "total_counts": state_dict["total_counts"],
                    "last_skipped": state_dict["last_skipped"],
                }
            )
        self._last_logged_step = state_dict["last_logged_step"]
        self._above = state_dict["above"]
        self._alerted = set(state_dict["alerted"])
        self._heatmap_steps = state_dict["heatmap_steps"]
        self._heatmap_amax = state_dict["heatmap_amax"]
        self.layer_names = state_dict["layer_names"]
        # written before the columns carried their layers: every column had the layers of the last reading
        self._heatmap_layers = state_dict.get("heatmap_layers") or [list(self.layer_names) for _ in self._heatmap_steps]
        self._logs = state_dict["logs"]
        self._tail_step = state_dict.get("tail_step")
