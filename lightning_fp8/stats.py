"""FP8 statistics: one device snapshot -> one cross-rank reduction -> one host copy -> named metrics.

:class:`FP8Stats` reads the FP8 state tables of a model (or of every model a precision plugin set up),
plus the plugin's loss scale and skipped-step count:

1. **snapshot**: each state table's scales, amax histories, counters and counter epochs, concatenated
   into one float64 device tensor (a constant number of operations per table, whatever the number of
   layers);
2. **reduce**: under ``torch.distributed``, one ``all_gather`` and a per-entry max (amax), min (scale) or
   sum (counters) (:func:`lightning_fp8.distributed.reduce_statistics`); every rank must read together;
3. **copy**: one device-to-host transfer;
4. **metrics**: plain floats with stable names (below), with the overflow and underflow fractions of the
   interval since the previous reading.

Nothing here changes the numerics or logs anything: :class:`~lightning_fp8.FP8StatsCallback` formats
and logs these metrics for the Trainer; a Fabric loop calls :meth:`FP8Stats.metrics` itself::

    stats = FP8Stats(plugin)                  # the FP8Precision given to Fabric(plugins=[...])
    for step, batch in enumerate(loader):
        ...
        if step % 50 == 0:                    # on every rank: the reading is a collective
            fabric.log_dict(stats.metrics(), step=step)

Metric names::

    fp8/<layer>/<tensor>/amax            most recent amax            (tensor: input, weight, grad_output)
    fp8/<layer>/<tensor>/scale           scale of the most recent cast (rowwise: smallest row scale)
    fp8/<layer>/<tensor>/overflow_frac   saturated or non-finite elements / elements cast, this interval
    fp8/<layer>/<tensor>/underflow_frac  non-zero elements flushed to zero / non-zero elements, this interval
    fp8/<layer>/<tensor>/block_amax_median  rowwise, blockwise, mxfp8: the median amax of the rows / blocks cast
                                         this interval, as the power of two at the bottom of its histogram bin
                                         (the largest is ``amax``; FP8StatsCallback sends the histogram since
                                         the start to TensorBoard / W&B as ``fp8/<layer>/<tensor>/block_amax_log2``)
    fp8/loss_scale                       current loss scale (1 when gradients are not scaled; absent
                                         without a loss scaler)
    fp8/skipped_steps                    optimizer steps skipped for non-finite gradients, since the start
    fp8/skipped_steps_interval           ... since the previous reading
    fp8/worst/overflow_frac              largest overflow_frac of any layer and tensor
    fp8/worst/overflow_layer             index of that layer in ``FP8Stats.layer_names``
    fp8/worst/underflow_frac             largest underflow_frac
    fp8/worst/underflow_layer            index of that layer
    fp8/scale_min, fp8/scale_max         smallest and largest scale of any layer and tensor

The ``*_frac`` metrics of a layer that cast nothing in the interval are left out. With several models
(Fabric) each layer name starts with its model's class name (or index, if class names repeat).
Under DDP the values are the reduced ones: amax the max over ranks, scale the min, counts (and the block
amax histograms) the sum.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fp8.convert import unmatched_pattern_hint
from lightning_fp8.distributed import REDUCE_MAX, REDUCE_MIN, REDUCE_SUM, reduce_statistics
from lightning_fp8.quantize import AMAX_BIN_LOW, N_AMAX_BINS
from lightning_fp8.recipe import ROLES
from lightning_fp8.state import NONZERO, OVERFLOW, SEEN, UNDERFLOW, FP8StateTable, fp8_layers

_N_ROLES = len(ROLES)
_N_COUNTS = 4
#: How the conversion report's ``skipped`` reason of a layer switched by ``FP8FallbackCallback`` starts.
SWITCHED_BY_FALLBACK = "switched to high precision by FP8FallbackCallback"


@dataclass
class LayerReading:
    """One layer's values in a reading (plain floats, per role: input, weight, grad_output)."""

    recipe: str
    scale: list[float]
    history: list[list[float]]
    counts: list[list[float]]  #: seen, nonzero, overflow, underflow (cumulative)
    counts_epoch: float
    #: per role, the cumulative histogram of the row / block amaxes (empty for per-tensor recipes): see
    #: :func:`lightning_fp8.quantize.amax_bins` for the bins
    amax_bins: list[list[float]] = dataclasses.field(default_factory=list)

    @property
    def amax(self) -> list[float]:
        """The most recent amax of each role."""
        return [h[0] for h in self.history]


def amax_bin_edges() -> list[float]:
    """The lower edge of each bin of an amax histogram (:func:`lightning_fp8.quantize.amax_bins`): 0, the powers of
    two ``2**AMAX_BIN_LOW`` .. ``2**AMAX_BIN_HIGH``, and ``inf`` for the non-finite bin."""
    return [0.0] + [2.0**e for e in range(AMAX_BIN_LOW, AMAX_BIN_LOW + N_AMAX_BINS - 2)] + [math.inf]


def block_amax_median(histogram: Sequence[float]) -> float | None:
    """The lower edge of the bin holding the median of an amax histogram (``None`` for an empty one)."""
    total = sum(histogram)
    if total <= 0:
        return None
    running = 0.0
    for edge, count in zip(amax_bin_edges(), histogram):
        running += count
        if running >= total / 2:
            return edge
    return math.inf


@dataclass
class FP8Reading:
    """What one :meth:`FP8Stats.read` returned: host values, already reduced across ranks."""

    layers: dict[str, LayerReading]
    loss_scale: float  #: NaN without a loss scaler
    skipped_steps: float


@dataclass
class _Block:
    table: FP8StateTable
    names: list[tuple[int, str]]  # (row, full name) of the rows to report


def _plausible_interval(now: list[list[float]], before: list[list[float]]) -> bool:
    """Whether ``now - before`` can be the counts of one interval: no counter went back, and no more overflows than
    elements seen or underflows than non-zero elements. (Counters set back by loading an older state in place may
    have grown past the old baseline by the next reading; the second test catches most of those.)"""
    for role_now, role_before in zip(now, before):
        delta = [a - b for a, b in zip(role_now, role_before)]
        if min(delta) < 0 or delta[OVERFLOW] > delta[SEEN] or delta[UNDERFLOW] > delta[NONZERO]:
            return False
    return True


class FP8Stats:
    """FP8 statistics of a model or of a precision plugin's models (see the module docstring).

    Args:
        source: an ``nn.Module``, a list of modules, or an ``FP8Precision`` plugin (Trainer or Fabric), which
            also gives the loss scale and the skipped-step count.
        include: glob patterns of layer names to report (default: all FP8 layers).
        exclude: glob patterns of layer names not to report.

    Raises:
        ValueError: at the first reading, for an ``include`` or ``exclude`` pattern that matches no FP8 layer
            (see :meth:`check_patterns`).
    """

    def __init__(self, source: Any, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None) -> None:
        self.source = source
        self.include = list(include) if include is not None else ["*"]
        self.exclude = list(exclude or [])
        #: Names of the reported layers, in metric order (``fp8/worst/*_layer`` index into it).
        self.layer_names: list[str] = []
        self.fetches = 0  #: device-to-host copies made (one per reading)
        self._kinds: tuple[tuple[Any, ...], Tensor] | None = None
        self._labels: dict[int, str] = {}
        self._patterns_checked = False
        self.reset()

    def reset(self) -> None:
        """Forget the interval baseline and the totals."""
        self.last_counts: dict[str, list[list[float]]] = {}
        self.last_epoch: dict[str, float] = {}
        self.last_bins: dict[str, list[list[float]]] = {}
        self.total_counts: dict[str, list[list[float]]] = {}
        self.last_skipped = 0.0
        self.has_baseline = False
        self._forget_carried()

    def _forget_carried(self) -> None:
        #: Per layer, the counts (and block amax histograms) that a checkpoint's reading had not reported yet (see
        #: :meth:`state_dict`): part of the next interval.
        self.carried_counts: dict[str, list[list[float]]] = {}
        self.carried_bins: dict[str, list[list[float]]] = {}

    # ------------------------------------------------------------------ sources
    def _models(self) -> list[nn.Module]:
        source = self.source
        if isinstance(source, nn.Module):
            return [source]
        if isinstance(source, (list, tuple)):
            return list(source)
        return list(getattr(source, "fp8_models", []))

    def _plugin_value(self, name: str) -> Tensor | None:
        return None if isinstance(self.source, (nn.Module, list, tuple)) else getattr(self.source, name, None)

    def _prefixes(self, models: Sequence[nn.Module]) -> list[str]:
        """The name prefix of each model: none for a single model; with several, the class name (or the model's
        index, if class names repeat). A model keeps its prefix once it has one, even if more models come later
        (metric names, baselines and totals must not change under a running reading)."""
        if len(models) == 1 and not self._labels:
            self._labels[id(models[0])] = ""
            return [""]
        names = [type(m).__name__ for m in models]
        unique = len(set(names)) == len(names)
        prefixes = []
        for i, (name, model) in enumerate(zip(names, models)):
            if id(model) not in self._labels:
                self._labels[id(model)] = (name if unique else str(i)) + "." if (self._labels or len(models) > 1) else ""
            prefixes.append(self._labels[id(model)])
        return prefixes

    def available_layer_names(self) -> list[str]:
        """Names of every FP8 layer of the source, as the metric names spell them, before ``include`` / ``exclude``."""
        models = self._models()
        return [
            prefix + (name or type(module).__name__)
            for prefix, model in zip(self._prefixes(models), models)
            for name, module in fp8_layers(model)
        ]

    def check_patterns(self, kept: dict[str, str] | None = None, owner: str | None = None) -> None:
        """Raise if an ``include`` or ``exclude`` pattern matches no FP8 layer of the source (a typo must not
        silently report other layers than meant), naming the closest layer names. ``kept``: layers the plugin keeps
        in high precision, with the reason (an ``include`` pattern naming one is explained; an ``exclude`` pattern
        naming one is redundant, not an error). Nothing is checked while the source has no FP8 layer yet.

        Called by the first :meth:`read` (with no ``kept``) and by ``FP8StatsCallback`` at the start of fit.
        """
        names = self.available_layer_names()
        if not names:
            return
        self._patterns_checked = True
        kept = kept or {}
        problems = []
        for field, patterns in (("include", self.include), ("exclude", self.exclude)):
            for pattern in patterns:
                if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                    continue
                high = [name for name in kept if fnmatch.fnmatchcase(name, pattern)]
                if high and field == "exclude":
                    continue  # redundant with the plugin's own exclusion: that layer is not reported anyway
                if high and all(kept[name].startswith(SWITCHED_BY_FALLBACK) for name in high):
                    continue  # it named an FP8 layer until an FP8FallbackCallback switched it (a resumed run)
                if high:
                    hint = "; ".join(f"{name!r} is not an FP8 layer ({kept[name]})" for name in high[:3])
                else:
                    hint = unmatched_pattern_hint(pattern, names, what="FP8 layer")
                problems.append(f"{field} pattern {pattern!r} matches no FP8 layer ({hint})")
        if problems:
            owner = owner or f"FP8Stats(include={self.include!r}, exclude={self.exclude!r})"
            raise ValueError(
                f"{owner}: " + "; ".join(problems) + ". Patterns are fnmatch globs on the FP8 layer names of the "
                "metrics (fp8/<layer>/...); a pattern that matches nothing is an error, so that a typo cannot "
                "silently report other layers than meant."
            )

    def _blocks(self) -> list[_Block]:
        blocks: dict[int, _Block] = {}
        models = self._models()
        for prefix, model in zip(self._prefixes(models), models):
            for name, module in fp8_layers(model):
                full = prefix + (name or type(module).__name__)
                if not any(fnmatch.fnmatchcase(full, p) for p in self.include):
                    continue
                if any(fnmatch.fnmatchcase(full, p) for p in self.exclude):
                    continue
                ref = module.fp8_state
                blocks.setdefault(id(ref.table), _Block(ref.table, [])).names.append((ref.index, full))
        return list(blocks.values())

    # ------------------------------------------------------------------ device side
    def snapshot(self, blocks: list[_Block] | None = None) -> Tensor:
        """Everything in one float64 tensor on the device (no transfer, no sync)."""
        blocks = self._blocks() if blocks is None else blocks
        device = blocks[0].table.device
        parts: list[Tensor] = []
        for block in blocks:
            t = block.table
            for tensor in (t.scale, t.amax_history, t.counts, t.counts_epoch, t.amax_bins):
                parts.append(tensor.reshape(-1).to(torch.float64))
        for name in ("loss_scale", "skipped_steps"):
            value = self._plugin_value(name)
            value = torch.full((1,), math.nan) if value is None else value.reshape(1)
            parts.append(value.to(device=device, dtype=torch.float64))
        return torch.cat(parts)

    def _reduction_kinds(self, blocks: list[_Block], device: torch.device) -> Tensor:
        key = tuple((id(b.table), b.table.num_layers, b.table.recipe.amax_history_len, b.table.amax_bins.numel()) for b in blocks)
        key += (device,)
        if self._kinds is None or self._kinds[0] != key:
            kinds: list[int] = []
            for block in blocks:
                t = block.table
                kinds += [REDUCE_MIN] * t.scale.numel() + [REDUCE_MAX] * t.amax_history.numel()
                kinds += [REDUCE_SUM] * t.counts.numel() + [REDUCE_MAX] * t.counts_epoch.numel()
                kinds += [REDUCE_SUM] * t.amax_bins.numel()
            kinds += [REDUCE_MAX, REDUCE_MAX]  # loss scale and skipped steps are the same on every rank
            self._kinds = (key, torch.tensor(kinds, dtype=torch.int8, device=device))
        return self._kinds[1]

    # ------------------------------------------------------------------ host side
    def read(self) -> FP8Reading | None:
        """Snapshot, reduce across ranks, copy to the host once. ``None`` if there is no FP8 layer to report."""
        if not self._patterns_checked:
            self.check_patterns()
        blocks = self._blocks()
        if not blocks:
            return None
        flat = self.snapshot(blocks)
        flat = reduce_statistics(flat, self._reduction_kinds(blocks, flat.device))
        self.fetches += 1
        values = flat.to("cpu").tolist()
        layers: dict[str, LayerReading] = {}
        pos = 0
        for block in blocks:
            t = block.table
            n, length = t.num_layers, t.recipe.amax_history_len
            scale, pos = values[pos : pos + n * _N_ROLES], pos + n * _N_ROLES
            history, pos = values[pos : pos + n * _N_ROLES * length], pos + n * _N_ROLES * length
            counts, pos = values[pos : pos + n * _N_ROLES * _N_COUNTS], pos + n * _N_ROLES * _N_COUNTS
            epochs, pos = values[pos : pos + n], pos + n
            nbins = t.role_amax_bins[0].shape[1]
            bins, pos = values[pos : pos + n * _N_ROLES * nbins], pos + n * _N_ROLES * nbins
            for row, name in sorted(block.names, key=lambda rn: rn[0]):
                layers[name] = LayerReading(
                    recipe=t.recipe.name,
                    scale=scale[row * _N_ROLES : (row + 1) * _N_ROLES],
                    history=[
                        history[(row * _N_ROLES + r) * length : (row * _N_ROLES + r + 1) * length] for r in range(_N_ROLES)
                    ],
                    counts=[
                        counts[(row * _N_ROLES + r) * _N_COUNTS : (row * _N_ROLES + r + 1) * _N_COUNTS]
                        for r in range(_N_ROLES)
                    ],
                    counts_epoch=epochs[row],
                    amax_bins=[
                        bins[(row * _N_ROLES + r) * nbins : (row * _N_ROLES + r + 1) * nbins] for r in range(_N_ROLES)
                    ]
                    if nbins
                    else [],
                )
        self.layer_names = list(layers)
        return FP8Reading(layers, loss_scale=values[pos], skipped_steps=values[pos + 1])

    def take_baseline(self, reading: FP8Reading | None = None) -> None:
        """Start the interval from now (reads the state unless ``reading`` is given)."""
        reading = self.read() if reading is None else reading
        if reading is None:
            return
        self.last_counts = {name: layer.counts for name, layer in reading.layers.items()}
        self.last_epoch = {name: layer.counts_epoch for name, layer in reading.layers.items()}
        self.last_bins = {name: layer.amax_bins for name, layer in reading.layers.items() if layer.amax_bins}
        self.last_skipped = reading.skipped_steps
        self.has_baseline = True
        self._forget_carried()

    def metrics(self, reading: FP8Reading | None = None) -> dict[str, float]:
        """The named metrics (module docstring) of ``reading`` (or of a new reading); the interval fractions are
        since the previous call (or the baseline), and the totals are updated."""
        reading = self.read() if reading is None else reading
        if reading is None:
            return {}
        metrics: dict[str, float] = {}
        worst_over = worst_under = (-1.0, -1)
        scales: list[float] = []
        for index, (name, layer) in enumerate(reading.layers.items()):
            interval = self._interval(name, layer)
            counts = interval[0] if interval is not None else [[0.0] * _N_COUNTS for _ in ROLES]
            total = self.total_counts.setdefault(name, [[0.0] * _N_COUNTS for _ in ROLES])
            for r, role in enumerate(ROLES):
                prefix = f"fp8/{name}/{role}"
                metrics[f"{prefix}/amax"] = layer.history[r][0]
                metrics[f"{prefix}/scale"] = layer.scale[r]
                scales.append(layer.scale[r])
                delta = counts[r]
                total[r] = [t + d for t, d in zip(total[r], delta)]
                if delta[SEEN] > 0:
                    over = delta[OVERFLOW] / delta[SEEN]
                    metrics[f"{prefix}/overflow_frac"] = over
                    if over > worst_over[0]:
                        worst_over = (over, index)
                if delta[NONZERO] > 0:
                    under = delta[UNDERFLOW] / delta[NONZERO]
                    metrics[f"{prefix}/underflow_frac"] = under
                    if under > worst_under[0]:
                        worst_under = (under, index)
            if interval is not None and interval[1] is not None:
                for r, role in enumerate(ROLES):
                    median = block_amax_median(interval[1][r])
                    if median is not None:
                        metrics[f"fp8/{name}/{role}/block_amax_median"] = median
            if layer.amax_bins:
                self.last_bins[name] = layer.amax_bins
            self.last_counts[name] = layer.counts
            self.last_epoch[name] = layer.counts_epoch
        self._forget_carried()
        if not math.isnan(reading.loss_scale):
            metrics["fp8/loss_scale"] = reading.loss_scale
        skipped = 0.0 if math.isnan(reading.skipped_steps) else reading.skipped_steps
        metrics["fp8/skipped_steps"] = skipped
        metrics["fp8/skipped_steps_interval"] = skipped - self.last_skipped
        self.last_skipped = skipped
        self.has_baseline = True
        if worst_over[1] >= 0:
            metrics["fp8/worst/overflow_frac"], metrics["fp8/worst/overflow_layer"] = worst_over[0], float(worst_over[1])
        if worst_under[1] >= 0:
            metrics["fp8/worst/underflow_frac"] = worst_under[0]
            metrics["fp8/worst/underflow_layer"] = float(worst_under[1])
        finite = [s for s in scales if math.isfinite(s)]
        if finite:
            metrics["fp8/scale_min"], metrics["fp8/scale_max"] = min(finite), max(finite)
        return metrics

    def _interval(self, name: str, layer: LayerReading) -> tuple[list[list[float]], list[list[float]] | None] | None:
        """The counts of ``layer`` since the baseline, per role, and its block amax histograms since then (``None``
        for a table without them); ``None`` where the counters were set back (an older state loaded in place: a new
        baseline, no interval). Where the counters restarted from zero since the baseline (a multi-rank resume),
        the interval is everything since the restart. What a checkpoint's reading had not reported yet
        (:meth:`state_dict`) is added."""
        zeros = [[0.0] * _N_COUNTS for _ in ROLES]
        last = self.last_counts.get(name, zeros)
        restarted = self.last_epoch.get(name, layer.counts_epoch) != layer.counts_epoch
        if restarted:
            last = zeros
        elif not _plausible_interval(layer.counts, last):
            return None
        counts = [[now - before for now, before in zip(layer.counts[r], last[r])] for r in range(_N_ROLES)]
        bins: list[list[float]] | None = None
        if layer.amax_bins:
            before = self.last_bins.get(name)
            bins = [
                list(now) if restarted or before is None else [a - b for a, b in zip(now, before[r])]
                for r, now in enumerate(layer.amax_bins)
            ]
        if name in self.carried_counts:
            counts = _plus(counts, self.carried_counts[name])
            bins = _plus(bins, self.carried_bins.get(name)) if bins is not None else None
        return counts, bins

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The interval baseline and the totals (plain values), and the counts of the interval not read yet.

        Takes a reading (a collective under ``torch.distributed``: call it on every rank, as Lightning's
        checkpointing and Fabric's ``save`` do), leaving this object's baseline and totals as they are (it counts in
        ``fetches``). The saved baseline is that reading, and its counts since this object's baseline are saved too
        (``carried_counts``, ``carried_bins``): the first
        interval after a resume is the counts since the reading plus them, whether the resumed counters continue
        from the checkpoint's (one rank saved and one loads) or restart from zero (more than one rank; see
        ``docs/checkpoints.md``). So the steps between the last reading and the checkpoint are lost neither from
        the totals nor from the fractions logged next, after any chain of checkpoints and resumes.
        """
        state: dict[str, Any] = {
            "last_counts": dict(self.last_counts),
            "last_epoch": dict(self.last_epoch),
            "total_counts": self.total_counts,
            "last_skipped": self.last_skipped,
            "has_baseline": self.has_baseline,
            "last_bins": dict(self.last_bins),
            "carried_counts": {},
            "carried_bins": {},
        }
        reading = self.read() if self.source is not None else None
        if reading is None:
            return state
        for name, layer in reading.layers.items():
            interval = self._interval(name, layer)
            if interval is not None:
                state["carried_counts"][name] = interval[0]
                if interval[1] is not None:
                    state["carried_bins"][name] = interval[1]
            state["last_counts"][name], state["last_epoch"][name] = layer.counts, layer.counts_epoch
            if layer.amax_bins:
                state["last_bins"][name] = layer.amax_bins
        state["has_baseline"] = True
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.last_counts = state["last_counts"]
        self.last_epoch = state.get("last_epoch", {})
        self.total_counts = state["total_counts"]
        self.last_skipped = state["last_skipped"]
        self.has_baseline = state.get("has_baseline", bool(self.last_counts))
        self.last_bins = state.get("last_bins", {})
        self.carried_counts = state.get("carried_counts", {})
        self.carried_bins = state.get("carried_bins", {})


def _plus(a: list[list[float]], b: list[list[float]] | None) -> list[list[float]]:
    """``a + b`` element by element (``a`` where ``b`` is ``None``)."""
    if b is None:
        return a
    return [[x + y for x, y in zip(row_a, row_b)] for row_a, row_b in zip(a, b)]
