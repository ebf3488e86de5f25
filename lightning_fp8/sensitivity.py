"""Which layers should stay in high precision? A per-layer FP8 sensitivity report on real batches.

:func:`sensitivity_report` measures, for every ``nn.Linear`` layer of a model and each of its three GEMMs, how far
the FP8 result is from the exact one, ranks the layers worst first and writes the ``exclude`` list that keeps the
worst ones in high precision; :class:`FP8SensitivityCallback` runs it from a ``Trainer`` on the first training
batches. Nothing of the user's model changes: the measurement runs on a deep copy.

What is measured, per layer (``y = x Wᵀ + b``; ``g`` the gradient of the loss with respect to ``y``)::

    output       y            FP8 forward GEMM          vs  float64  x Wᵀ + b
    grad_input   g W          FP8 grad_input GEMM       vs  float64  g W
    grad_weight  gᵀ x         FP8 grad_weight GEMM      vs  float64  gᵀ x

each as a signal-to-quantisation-noise ratio in dB::

    SQNR(ŷ, y) = 10 log10( Σ y² / Σ (y - ŷ)² )

computed by ``torchmetrics.functional.audio.signal_noise_ratio`` (SNR in dB with ``zero_mean=False``: exactly
this formula, along the last dimension). torchmetrics adds its ``eps`` (the float64 machine epsilon) to both sums,
an absolute term that would bias the SQNR of small tensors (gradients) toward 0 dB; the SQNR does not change when
both tensors are multiplied by the same number, so each row is first divided by its own ``max |y|``, after which the
``eps`` caps the measure far above anything FP8 or bf16 reaches. Rows whose reference is all zeros carry no signal
and are left out; a non-finite FP8 result counts as minus infinity.

Two views of the same error:

* **per tensor**: the SQNR of the whole tensor (one value per call, averaged over the calls);
* **per token**: the output viewed as ``(tokens, out_features)`` (every position of every sequence; every sample of
  a 2-D batch), the SQNR of each token's row, averaged over all tokens of all calls (the same for ``grad_input``).

Why the per-token view: the signal energy of a tensor is dominated by its largest rows. Language models develop
*massive activations*, a few tokens whose activations are orders of magnitude above the rest. One scale per tensor
is then set by those tokens, and every other token is cast with a scale far too small for it: its values fall
into FP8's subnormals or flush to zero, and its output is mostly noise. The per-tensor SQNR barely notices (the
ruined tokens hold a negligible share of the energy), while the mean per-token SQNR, in which every token counts
once, drops to a few dB. This is the failure that matters in practice; a few large *channels* are absorbed by
E4M3's range and do not show.

Why the error of a layer is measured on the high-precision model's activations: the report runs the copy of the
model once in its own precision (float32 parameters: float32, no autocast), records each layer's input and, with
a loss, its output gradient, and evaluates every layer in FP8 (and in the autocast dtype, the baseline) on exactly
those tensors, compared with the same layer in float64. The error of a layer is then its own: it does not
compound the errors of the layers before it, so a sensitive early layer does not make every later one look bad,
and one forward and backward per batch measures all layers at once (converting one layer at a time would give the
same numbers at one model pass per layer). The optional loss change (``loss_delta=True``) is the one
whole-model measure: the loss with only that layer in FP8, minus the loss with no layer in FP8, both under
autocast.

The ranking **score** of a layer is the worst (lowest) of its per-token output SQNR, per-token grad_input SQNR and
grad_weight SQNR (the gradient terms only when a loss is given). ``baseline_score_db`` is the same score of the
layer computed in the autocast dtype alone (bf16 by default): the floor that high precision reaches, against which
to read the FP8 score. The overflow and underflow fractions are those of the FP8 casts of the layer's input,
weight and output gradient: saturated or non-finite elements per element cast, and non-zero elements flushed to
zero per non-zero element (as :class:`~lightning_fp8.FP8StatsCallback` reports them).

How the names map to ``FP8Precision(exclude=...)``: the names are fully-qualified module names within the model
passed in, matched by the plugin against the names within the module it converts. For a ``Trainer`` that is the
``LightningModule`` itself: run the report on the LightningModule (the callback does) and paste the names as they
are. A report run on an inner module (say ``lit.net``) names ``blocks.0.fc``, which the plugin knows as
``net.blocks.0.fc``: pass ``prefix="net"`` to :meth:`SensitivityReport.exclude` / :meth:`SensitivityReport.save`.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import yaml
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torchmetrics.functional.audio import signal_noise_ratio
from typing_extensions import override

from lightning_fp8.calibration import first_training_batches, muted_logging
from lightning_fp8.convert import _device_of, _skip_reason, convert_from_fp8, convert_to_fp8, exact_pattern
from lightning_fp8.recipe import FP8Recipe, resolve_recipe
from lightning_fp8.region import fp8_autocast
from lightning_fp8.state import COUNT_FIELDS, roll_amax_history

log = logging.getLogger(__name__)

#: The threshold of :meth:`SensitivityReport.exclude` when neither a threshold nor a count is given (dB): well
#: below what ordinary layers reach with per-tensor scaling, well above a layer that loses its ordinary tokens.
DEFAULT_THRESHOLD_DB = 20.0

#: The files :meth:`SensitivityReport.save` writes.
MARKDOWN_FILE = "sensitivity.md"
PLOT_FILE = "sensitivity.png"
EXCLUDE_FILE = "exclude.yaml"

_TENSORS = ("input", "weight", "grad_output")
_SEEN, _NONZERO, _OVERFLOW, _UNDERFLOW = (COUNT_FIELDS.index(f) for f in ("seen", "nonzero", "overflow", "underflow"))


# --------------------------------------------------------------------------------------------- the measures
def sqnr_db(estimate: Tensor, reference: Tensor, per_row: bool = False) -> Tensor:
    """SQNR in dB of ``estimate`` against ``reference``, in float64: a 0-d tensor for the whole tensor (NaN if the
    reference is all zeros), or with ``per_row=True`` one value per row of the tensors viewed as ``(-1, last dim)``
    (rows with an all-zero reference left out). A non-finite estimate gives minus infinity. See the module docstring
    for the formula and the normalisation."""
    values = _sqnr_values(estimate, reference, per_row)
    if per_row:
        return values
    return values[0] if values.numel() else torch.tensor(math.nan, dtype=torch.float64)


def _sqnr_values(estimate: Tensor, reference: Tensor, per_row: bool) -> Tensor:
    """:func:`sqnr_db` as a 1-D tensor: one value per row (``per_row``) or at most one for the whole tensor."""
    ref = reference.detach().to(torch.float64)
    est = estimate.detach().to(torch.float64)
    shape = (-1, ref.shape[-1]) if per_row and ref.dim() > 0 else (1, -1)
    ref, est = ref.reshape(shape), est.reshape(shape)
    norm = ref.abs().amax(dim=-1, keepdim=True)
    keep = norm.squeeze(-1) > 0
    ref, est, norm = ref[keep], est[keep], norm[keep]
    snr = signal_noise_ratio(est / norm, ref / norm, zero_mean=False)
    finite = torch.isfinite(est).all(dim=-1)
    return torch.where(finite, snr, torch.full_like(snr, -math.inf))


class _Mean:
    """Running mean of float64 values (host floats at the end only)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def add(self, values: Tensor) -> None:
        values = values.reshape(-1)
        if values.numel():
            self.total += float(values.sum())
            self.count += values.numel()

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class LayerSensitivity:
    """The measures of one layer (SQNRs in dB; ``None`` where not measured). See the module docstring.

    Attributes:
        name: fully-qualified name of the layer within the model the report was run on.
        in_features: the layer's ``in_features``.
        out_features: the layer's ``out_features``.
        calls: forward calls measured (a layer may run more than once per batch).
        output_token_sqnr_db: mean over tokens of the per-token SQNR of the FP8 output.
        output_sqnr_db: SQNR of the FP8 output as one tensor (mean over calls).
        grad_input_token_sqnr_db: mean over tokens of the per-token SQNR of the FP8 grad_input (with a loss).
        grad_input_sqnr_db: SQNR of the FP8 grad_input as one tensor (with a loss).
        grad_weight_sqnr_db: SQNR of the FP8 grad_weight (with a loss).
        baseline: the same SQNRs for the layer computed in the autocast dtype alone, without FP8, keyed by the
            names of the attributes above (``{"output_token_sqnr_db": ..., ...}``).
        overflow: ``{"input", "weight", "grad_output"}`` -> fraction of elements saturated or non-finite in the
            FP8 cast (``grad_output`` only with a loss).
        underflow: the same keys -> fraction of non-zero elements flushed to zero.
        loss_delta: mean over batches of (loss with only this layer in FP8 - loss with no layer in FP8), with
            ``loss_delta=True``.
    """

    name: str
    in_features: int
    out_features: int
    calls: int = 0
    output_token_sqnr_db: float | None = None
    output_sqnr_db: float | None = None
    grad_input_token_sqnr_db: float | None = None
    grad_input_sqnr_db: float | None = None
    grad_weight_sqnr_db: float | None = None
    baseline: dict[str, float | None] = field(default_factory=dict)
    overflow: dict[str, float] = field(default_factory=dict)
    underflow: dict[str, float] = field(default_factory=dict)
    loss_delta: float | None = None

    #: The measures that enter the score (the worst of them).
    SCORED = ("output_token_sqnr_db", "grad_input_token_sqnr_db", "grad_weight_sqnr_db")

    @staticmethod
    def _worst(values: Iterable[float | None]) -> float:
        present = [v for v in values if v is not None]
        if not present:
            return math.nan
        if any(math.isnan(v) for v in present):
            return -math.inf
        return min(present)

    @property
    def score_db(self) -> float:
        """The ranking score: the worst of the per-token output SQNR, the per-token grad_input SQNR and the
        grad_weight SQNR (those measured)."""
        return self._worst(getattr(self, name) for name in self.SCORED)

    @property
    def baseline_score_db(self) -> float:
        """The same score for the layer in the autocast dtype without FP8 (bf16 by default): the floor of high
        precision."""
        return self._worst(self.baseline.get(name) for name in self.SCORED)


@dataclass
class SensitivityReport:
    """What :func:`sensitivity_report` measured: the layers worst first (lowest ``score_db``).

    Attributes:
        layers: one :class:`LayerSensitivity` per measured layer, worst first.
        recipe: the FP8 recipe measured.
        compute_dtype: the autocast dtype of the FP8 and baseline computations (as a string, ``"bfloat16"``).
        num_batches: batches measured.
        gradients: whether the backward GEMMs were measured (a loss was given).
        skipped: ``{name: reason}`` for ``nn.Linear`` layers that would not be converted to FP8 (not measured).
        prefix: default prefix for :meth:`exclude` (set by the callback: empty for a LightningModule).
    """

    layers: list[LayerSensitivity]
    recipe: FP8Recipe
    compute_dtype: str = "bfloat16"
    num_batches: int = 0
    gradients: bool = False
    skipped: dict[str, str] = field(default_factory=dict)
    prefix: str = ""

    def layer(self, name: str) -> LayerSensitivity:
        """The measures of the layer named ``name``."""
        for entry in self.layers:
            if entry.name == name:
                return entry
        raise KeyError(f"no measured layer named {name!r}; measured: {[e.name for e in self.layers]}")

    @property
    def names(self) -> list[str]:
        """The measured layers' names, worst first."""
        return [entry.name for entry in self.layers]

    @property
    def _baseline_name(self) -> str:
        return {"bfloat16": "bf16", "float16": "fp16"}.get(self.compute_dtype, self.compute_dtype)

    def exclude(self, threshold_db: float | None = None, top: int | None = None, prefix: str | None = None) -> list[str]:
        """The names to paste into ``FP8Precision(exclude=...)`` (or ``convert_to_fp8(exclude=...)``), worst first.

        Args:
            threshold_db: keep in high precision every layer whose score is below this many dB.
            top: keep the ``top`` worst layers in high precision instead (``0``: none).
            prefix: prepended with a dot to every name (``prefix="net"``: ``net.blocks.0.fc``), for a report run
                on an inner module of the module the plugin converts (see the module docstring). ``None``: the
                report's own ``prefix``.

        Without ``threshold_db`` and ``top`` the threshold is :data:`DEFAULT_THRESHOLD_DB`. Each name is an exact
        ``fnmatch`` pattern for its layer (glob characters in a name are escaped).

        Raises:
            ValueError: if both ``threshold_db`` and ``top`` are given, or either is invalid.
        """
        if threshold_db is not None and top is not None:
            raise ValueError(
                f"exclude(threshold_db={threshold_db!r}, top={top!r}): give a threshold in dB or a number of layers, "
                "not both"
            )
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or top < 0:
                raise ValueError(f"exclude(top={top!r}): top must be an int >= 0 (the number of worst layers to keep)")
            chosen = self.layers[:top]
        else:
            threshold = DEFAULT_THRESHOLD_DB if threshold_db is None else threshold_db
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
                raise ValueError(f"exclude(threshold_db={threshold_db!r}): the threshold must be a number of dB")
            chosen = [e for e in self.layers if not e.score_db >= threshold]  # NaN scores: measured nothing, keep out
        prefix = self.prefix if prefix is None else prefix
        prefix = prefix.rstrip(".") + "." if prefix else ""
        return [exact_pattern(prefix + entry.name) for entry in chosen]

    def exclude_yaml(self, threshold_db: float | None = None, top: int | None = None, prefix: str | None = None) -> str:
        """:meth:`exclude` as a yaml snippet to paste under ``FP8Precision``'s ``init_args`` (with a comment saying
        where it goes and which rule chose the layers)."""
        names = self.exclude(threshold_db, top, prefix)
        rule = f"the {top} worst layer(s)" if top is not None else (
            f"layers whose score is below {DEFAULT_THRESHOLD_DB if threshold_db is None else threshold_db} dB"
        )
        head = (
            f"# FP8 sensitivity report ({self.recipe.name}, {self.num_batches} batch(es)): {rule} stay in high precision.\n"
            "# Paste under the plugin's init_args, e.g.\n"
            "#   trainer:\n"
            "#     plugins:\n"
            "#       - class_path: lightning_fp8.FP8Precision\n"
            "#         init_args:\n"
            "#           <here>\n"
        )
        return head + yaml.safe_dump({"exclude": names}, default_flow_style=False, sort_keys=False)

    def to_markdown(self) -> str:
        """The table, worst layer first, with a header line saying what was measured and a footer with the skipped
        layers and the exclude list under :data:`DEFAULT_THRESHOLD_DB`."""
        base = self._baseline_name
        lines = [
            f"FP8 sensitivity: recipe `{self.recipe.name}` (fp8_format `{self.recipe.fp8_format}`), autocast "
            f"{self.compute_dtype}, {self.num_batches} batch(es), {len(self.layers)} layer(s); "
            + ("forward and backward GEMMs." if self.gradients else "forward GEMM only (no loss given).")
            + " SQNR in dB against float64 on the high-precision model's activations, higher is better; score = the "
            "worst of the per-token output, per-token grad_input and grad_weight SQNRs. Worst first.",
            "",
            f"| rank | layer | score | {base} score | output/token | output | grad_input/token | grad_weight "
            "| overflow in/w/grad | underflow in/w/grad | Δloss |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for rank, e in enumerate(self.layers, start=1):
            lines.append(
                f"| {rank} | `{e.name}` | {_db(e.score_db)} | {_db(e.baseline_score_db)} | {_db(e.output_token_sqnr_db)} "
                f"| {_db(e.output_sqnr_db)} | {_db(e.grad_input_token_sqnr_db)} | {_db(e.grad_weight_sqnr_db)} "
                f"| {_fractions(e.overflow)} | {_fractions(e.underflow)} "
                f"| {'–' if e.loss_delta is None else f'{e.loss_delta:+.3g}'} |"
            )
        if self.skipped:
            lines += ["", "Not measured (these layers would not run in FP8):", ""]
            lines += [f"- `{name or '<root>'}`: {why}" for name, why in self.skipped.items()]
        names = self.exclude()
        lines += [
            "",
            f"Layers with a score below {DEFAULT_THRESHOLD_DB:g} dB: "
            + (f"`exclude: {names}`" if names else "none (every layer can run in FP8)."),
        ]
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.to_markdown()

    def plot(self, path: str | os.PathLike, threshold_db: float | None = None, show_threshold: bool = True) -> None:
        """A bar chart of the per-layer score (worst at the top), the baseline score marked and the exclude
        threshold (default :data:`DEFAULT_THRESHOLD_DB`) drawn, to ``path`` (PNG)."""
        # A Figure with the Agg canvas, not pyplot: the caller's matplotlib backend (a notebook's) is left alone.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        n = len(self.layers)
        fig = Figure(figsize=(9, 1.5 + 0.3 * n))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ys = list(range(n))[::-1]
        scores = [_plottable(e.score_db) for e in self.layers]
        ax.barh(ys, scores, color="tab:red", label=f"FP8 {self.recipe.name}")
        ax.scatter([_plottable(e.baseline_score_db) for e in self.layers], ys, color="black", marker="|", s=200,
                   label=f"{self._baseline_name} (no FP8)", zorder=3)
        if show_threshold:
            threshold = DEFAULT_THRESHOLD_DB if threshold_db is None else threshold_db
            ax.axvline(threshold, color="gray", linestyle="--", linewidth=1, label="exclude threshold")
        ax.set_yticks(ys)
        ax.set_yticklabels([e.name for e in self.layers])
        ax.set_xlabel("score (dB): the worst SQNR of the layer's GEMMs, higher is better")
        ax.set_title(f"FP8 sensitivity per layer ({self.recipe.name}, {self.num_batches} batch(es))")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)

    def save(
        self, folder: str | os.PathLike, threshold_db: float | None = None, top: int | None = None, prefix: str | None = None
    ) -> dict[str, Path]:
        """Write the table (``sensitivity.md``), the bar chart (``sensitivity.png``) and the exclude snippet
        (``exclude.yaml``, from :meth:`exclude_yaml` with these arguments) to ``folder``; returns their paths."""
        self.exclude(threshold_db, top, prefix)  # validate before writing anything
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {"markdown": folder / MARKDOWN_FILE, "plot": folder / PLOT_FILE, "exclude": folder / EXCLUDE_FILE}
        paths["markdown"].write_text(self.to_markdown())
        self.plot(paths["plot"], threshold_db, show_threshold=top is None)
        paths["exclude"].write_text(self.exclude_yaml(threshold_db, top, prefix))
        return paths


def _db(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.1f}"


def _plottable(value: float) -> float:
    return 0.0 if not math.isfinite(value) else value


def _fractions(values: Mapping[str, float]) -> str:
    def pct(v: float | None) -> str:
        if v is None:
            return "–"
        return "0" if v == 0 else f"{100 * v:.3g}%"

    return " / ".join(pct(values.get(t)) for t in _TENSORS)


# --------------------------------------------------------------------------------------------- running a batch
def call_model(model: nn.Module, batch: Any) -> Any:
    """How the report feeds a batch to the model: ``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple
    or a list, ``model(batch)`` for anything else (a tensor)."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _linear_layers(model: nn.Module, skip_unaligned: bool) -> tuple[dict[str, nn.Linear], dict[str, str]]:
    """The ``nn.Linear`` layers ``convert_to_fp8`` would convert (by name), and the reasons of the others."""
    parents: dict[str, nn.Module] = {}
    for name, child in model.named_modules():
        for child_name, _ in child.named_children():
            parents[f"{name}.{child_name}" if name else child_name] = child
    layers: dict[str, nn.Linear] = {}
    skipped: dict[str, str] = {}
    for name, child in model.named_modules():
        if isinstance(child, nn.Linear):
            reason = _skip_reason(name, child, parents.get(name), (), skip_unaligned)
            if reason is None:
                layers[name] = child
            else:
                skipped[name] = reason
    return layers, skipped


class _LayerProbe:
    """One layer's FP8 twin (an FP8Linear sharing the layer's Parameters, in training mode so that its casts are
    counted) and the running measures."""

    def __init__(self, name: str, layer: nn.Linear, recipe: FP8Recipe, skip_unaligned: bool) -> None:
        self.name, self.layer = name, layer
        twin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        twin.weight = layer.weight
        twin.bias = layer.bias
        convert_to_fp8(twin, recipe, skip_unaligned=skip_unaligned, log_summary=False)
        self.twin = twin.train()
        self.calls = 0
        self.fp8 = {key: _Mean() for key in _MEASURES}
        self.baseline = {key: _Mean() for key in _MEASURES}
        self.loss_delta = _Mean()

    def measure(self, x: Tensor, grad_output: Tensor | None, compute_dtype: torch.dtype) -> None:
        layer, twin = self.layer, self.twin
        self.calls += 1
        x = x.detach()
        weight, bias = layer.weight, layer.bias
        x64, w64 = x.to(torch.float64), weight.detach().to(torch.float64)
        ref = F.linear(x64, w64, None if bias is None else bias.detach().to(torch.float64))
        device_type = x.device.type
        need_grad = grad_output is not None
        for kind, fp8 in (("fp8", True), ("baseline", False)):
            with torch.enable_grad():
                xi = x.clone().requires_grad_(need_grad)
                # deferred: the twin's history rolls once per batch (roll()), as training rolls once per step for
                # every call of a layer that runs more than once per forward
                with torch.autocast(device_type, dtype=compute_dtype), fp8_autocast(enabled=fp8, defer_amax_history_roll=True):
                    out = twin(xi) if fp8 else F.linear(xi, weight, bias)
                grads = None
                if need_grad:
                    grads = torch.autograd.grad(out, (xi, weight), grad_output.to(out.dtype))
            sums = self.fp8 if kind == "fp8" else self.baseline
            sums["output_token_sqnr_db"].add(_sqnr_values(out, ref, True))
            sums["output_sqnr_db"].add(_sqnr_values(out, ref, False))
            if grads is not None:
                g64 = grad_output.detach().to(torch.float64)
                ref_gi = g64 @ w64
                ref_gw = g64.reshape(-1, g64.shape[-1]).t() @ x64.reshape(-1, x64.shape[-1])
                sums["grad_input_token_sqnr_db"].add(_sqnr_values(grads[0], ref_gi, True))
                sums["grad_input_sqnr_db"].add(_sqnr_values(grads[0], ref_gi, False))
                sums["grad_weight_sqnr_db"].add(_sqnr_values(grads[1], ref_gw, False))

    def result(self, gradients: bool) -> LayerSensitivity:
        layer = self.layer
        counts = self.twin.fp8_counts.to(torch.float64).cpu()
        overflow: dict[str, float] = {}
        underflow: dict[str, float] = {}
        for role, tensor in enumerate(_TENSORS):
            seen, nonzero = counts[role, _SEEN].item(), counts[role, _NONZERO].item()
            if tensor == "grad_output" and not gradients:
                continue
            overflow[tensor] = counts[role, _OVERFLOW].item() / seen if seen else 0.0
            underflow[tensor] = counts[role, _UNDERFLOW].item() / nonzero if nonzero else 0.0
        return LayerSensitivity(
            name=self.name,
            in_features=layer.in_features,
            out_features=layer.out_features,
            calls=self.calls,
            **{key: mean.value for key, mean in self.fp8.items()},
            baseline={key: mean.value for key, mean in self.baseline.items()},
            overflow=overflow,
            underflow=underflow,
            loss_delta=self.loss_delta.value,
        )


_MEASURES = (
    "output_token_sqnr_db",
    "output_sqnr_db",
    "grad_input_token_sqnr_db",
    "grad_input_sqnr_db",
    "grad_weight_sqnr_db",
)


def _loss_of(result: Any) -> Tensor:
    loss = result["loss"] if isinstance(result, Mapping) else result
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(
            f"the loss must be a one-element tensor (or a mapping with a 'loss' tensor), got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
        )
    return loss.reshape(())


def sensitivity_report(
    model: nn.Module,
    batches: Iterable[Any],
    recipe: FP8Recipe | str | None = "tensorwise",
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    *,
    step_fn: Callable[[nn.Module, Any], Any] | None = None,
    num_batches: int | None = None,
    loss_delta: bool = False,
    compute_dtype: torch.dtype = torch.bfloat16,
    skip_unaligned: bool = True,
) -> SensitivityReport:
    """Measure how much FP8 costs each ``nn.Linear`` layer of ``model`` on real batches, worst layer first.

    See the module docstring for what is measured, why per token, and why on the high-precision activations. The
    model is not changed: a deep copy is measured (its FP8 layers, if any, turned back into ``nn.Linear``), in
    ``eval()`` mode (dropout off, so every computation sees the same activations), every Parameter with gradients
    when a loss is given (so the three GEMMs of every layer are measured, frozen or not). The batches are moved to
    the model's device. No optimizer step is taken; the random number generators are restored afterwards.

    Args:
        model: the model (an ``nn.Module`` or a ``LightningModule``), FP8 or not; left untouched.
        batches: an iterable of model inputs: each is passed as ``model(**batch)`` if it is a mapping,
            ``model(*batch)`` if it is a tuple or list, else ``model(batch)``. A few batches are enough.
        recipe: the FP8 recipe to measure (an :class:`~lightning_fp8.FP8Recipe` or a name; default
            ``"tensorwise"``). ``delayed`` runs the batches in order, each layer's scales from the earlier ones.
        loss_fn: ``loss_fn(output, batch) -> loss`` (a one-element tensor): with it the backward GEMMs
            (grad_input, grad_weight) are measured too.
        step_fn: instead of ``model(batch)`` and ``loss_fn``: ``step_fn(model_copy, batch) -> loss`` (or a mapping
            with a ``"loss"``) runs the model itself, e.g. a LightningModule's ``training_step``.
        num_batches: measure at most this many batches of ``batches`` (default: all of them).
        loss_delta: also measure, per layer, the change of the loss when only that layer runs in FP8 (one more
            forward per layer and batch; needs ``loss_fn`` or ``step_fn``).
        compute_dtype: the autocast dtype the FP8 layers compute around (the plugin's ``compute_dtype``), and the
            baseline's.
        skip_unaligned: as for :func:`~lightning_fp8.convert_to_fp8`: layers it would keep in high precision are
            listed in ``skipped``, not measured.

    Returns:
        a :class:`SensitivityReport`.

    Raises:
        ValueError: if ``batches`` yields nothing, the model has no ``nn.Linear`` layer (or none that would run in
            FP8), both ``loss_fn`` and ``step_fn`` are given, ``loss_delta`` is asked without a loss, or an
            argument is invalid.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    recipe = resolve_recipe(recipe)
    if loss_fn is not None and step_fn is not None:
        raise ValueError("give loss_fn (with model(batch)) or step_fn (which runs the model itself), not both")
    if loss_delta and loss_fn is None and step_fn is None:
        raise ValueError("loss_delta=True needs a loss: pass loss_fn or step_fn")
    if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1):
        raise ValueError(f"num_batches must be an int >= 1 or None, got {num_batches!r}")
    if compute_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"compute_dtype={compute_dtype} is not valid; choose one of [torch.bfloat16, torch.float16]")
    if isinstance(batches, (Tensor, Mapping)):
        raise ValueError(
            "batches must be an iterable of batches (e.g. a list of tensors or a DataLoader), not a single "
            f"{type(batches).__name__}: wrap one batch in a list"
        )
    gradients = loss_fn is not None or step_fn is not None

    work = copy.deepcopy(model)
    convert_from_fp8(work)
    layers, skipped = _linear_layers(work, skip_unaligned)
    if not layers:
        if skipped:
            reasons = "; ".join(f"{name or '<root>'}: {why}" for name, why in skipped.items())
            raise ValueError(f"the model has no nn.Linear layer that would run in FP8 ({reasons})")
        raise ValueError(f"the model ({type(model).__name__}) has no nn.Linear layer: there is nothing to measure")
    work.eval()
    if gradients:
        for parameter in work.parameters():
            parameter.requires_grad_(True)
    device = _device_of(work)
    probes = {name: _LayerProbe(name, layer, recipe, skip_unaligned) for name, layer in layers.items()}

    def run(batch: Any) -> Tensor | None:
        if step_fn is not None:
            return _loss_of(step_fn(work, batch))
        output = call_model(work, batch)
        return None if loss_fn is None else _loss_of(loss_fn(output, batch))

    captures: list[tuple[_LayerProbe, Tensor, Tensor]] = []
    capturing = [True]

    def hook(probe: _LayerProbe) -> Callable[..., None]:
        def capture(module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> None:
            if capturing[0]:
                x = args[0] if args else kwargs["input"]
                captures.append((probe, x.detach(), output))

        return capture

    handles = [layers[name].register_forward_hook(hook(probe), with_kwargs=True) for name, probe in probes.items()]
    devices = [device] if device.type == "cuda" else []
    measured = 0
    try:
        with torch.random.fork_rng(devices=devices):
            for batch in batches:
                if num_batches is not None and measured >= num_batches:
                    break
                batch = move_data_to_device(batch, device)
                captures.clear()
                with torch.set_grad_enabled(gradients):
                    loss = run(batch)
                grads: list[Tensor | None] = [None] * len(captures)
                if loss is not None:
                    wanted = [i for i, (_, _, out) in enumerate(captures) if out.requires_grad]
                    found = torch.autograd.grad(loss, [captures[i][2] for i in wanted], allow_unused=True)
                    for i, g in zip(wanted, found):
                        grads[i] = g
                for (probe, x, _), g in zip(captures, grads):
                    probe.measure(x, g, compute_dtype)
                for probe in probes.values():
                    roll_amax_history(probe.twin)
                captures.clear()
                if loss_delta:
                    capturing[0] = False
                    _measure_loss_delta(work, probes, batch, run, recipe, compute_dtype, device)
                    capturing[0] = True
                measured += 1
    finally:
        for handle in handles:
            handle.remove()
    if measured == 0:
        raise ValueError("batches is empty: the report needs at least one batch")
    results = [probe.result(gradients) for probe in probes.values()]
    never_called = [r.name for r in results if r.calls == 0]
    if never_called:
        log.warning("FP8 sensitivity: layer(s) %s never ran on these batches and are not ranked", never_called)
    results = [r for r in results if r.calls]
    order = sorted(range(len(results)), key=lambda i: (_sort_key(results[i].score_db), i))
    return SensitivityReport(
        layers=[results[i] for i in order],
        recipe=recipe,
        compute_dtype=str(compute_dtype).removeprefix("torch."),
        num_batches=measured,
        gradients=gradients,
        skipped=skipped,
    )


def _sort_key(score: float) -> float:
    return -math.inf if math.isnan(score) else score


def _measure_loss_delta(
    work: nn.Module,
    probes: dict[str, _LayerProbe],
    batch: Any,
    run: Callable[[Any], Tensor | None],
    recipe: FP8Recipe,
    compute_dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The loss with only each layer in FP8 minus the loss with none, under autocast, same random state."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())

    def loss_now() -> float:
        torch.manual_seed(seed)
        with torch.no_grad(), torch.autocast(device.type, dtype=compute_dtype), fp8_autocast():
            loss = run(batch)
        assert loss is not None
        return float(loss)

    base = loss_now()
    for probe in probes.values():
        convert_to_fp8(probe.layer, recipe, skip_unaligned=False, log_summary=False)
        try:
            value = loss_now()
        finally:
            convert_from_fp8(probe.layer)
        probe.loss_delta.add(torch.tensor([value - base], dtype=torch.float64))


# --------------------------------------------------------------------------------------------- the callback
class FP8SensitivityCallback(Callback):
    """Run :func:`sensitivity_report` on the first training batches, before the first training step.

    At ``on_train_start`` (the model is on its device, converted by ``FP8Precision`` if the plugin is active: the
    report measures a copy turned back into ``nn.Linear``, so the layers the plugin excluded are measured too), rank
    0 takes the first ``num_batches`` batches of a pass over ``trainer.train_dataloader`` (the random state is
    restored, so the training's data order and dropout masks do not change; with a shuffling sampler the pass draws
    its own order), moves them to the device through the LightningModule's batch-transfer hooks and measures the LightningModule: by default through its ``training_step`` (its ``self.log``
    calls are ignored), which gives the loss and so the backward GEMMs. It logs the table, writes ``sensitivity.md``,
    ``sensitivity.png`` and ``exclude.yaml`` to ``<trainer.log_dir>/<folder>`` and keeps the report in
    ``report`` (``None`` on other ranks). The names are the LightningModule's, exactly what
    ``FP8Precision(exclude=...)`` matches.

    Args:
        num_batches: training batches to measure (default 4).
        recipe: the recipe to measure; ``None`` (default): the ``FP8Precision`` plugin's recipe, else
            ``"tensorwise"``.
        input_fn: ``input_fn(batch) -> model input`` (passed as :func:`sensitivity_report` passes batches): measure
            ``pl_module(input)`` instead of ``training_step`` (needed for manual optimization, whose
            ``training_step`` steps optimizers).
        loss_fn: with ``input_fn``: ``loss_fn(output, batch) -> loss``, to measure the backward GEMMs too.
        loss_delta: also measure the loss change per layer (see :func:`sensitivity_report`).
        threshold_db: the threshold of the written ``exclude.yaml`` (default :data:`DEFAULT_THRESHOLD_DB`).
        top: write the ``top`` worst layers to ``exclude.yaml`` instead of a threshold.
        folder: the subfolder of ``trainer.log_dir`` the files go to (default ``"fp8_sensitivity"``).
    """

    def __init__(
        self,
        num_batches: int = 4,
        recipe: str | None = None,
        input_fn: Callable[[Any], Any] | None = None,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        loss_delta: bool = False,
        threshold_db: float | None = None,
        top: int | None = None,
        folder: str = "fp8_sensitivity",
    ) -> None:
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
            raise ValueError(f"num_batches must be an int >= 1, got {num_batches!r}")
        if recipe is not None:
            resolve_recipe(recipe)
        if loss_fn is not None and input_fn is None:
            raise ValueError("loss_fn needs input_fn (without them the LightningModule's training_step gives the loss)")
        if loss_delta and input_fn is not None and loss_fn is None:
            raise ValueError("loss_delta=True with input_fn needs loss_fn (the loss to compare)")
        if threshold_db is not None and top is not None:
            raise ValueError("give threshold_db or top, not both")
        self.num_batches = num_batches
        self.recipe = recipe
        self.input_fn = input_fn
        self.loss_fn = loss_fn
        self.loss_delta = loss_delta
        self.threshold_db = threshold_db
        self.top = top
        self.folder = folder
        #: The report (rank 0, after the start of training).
        self.report: SensitivityReport | None = None
        #: The files written: ``{"markdown", "plot", "exclude"}`` -> path.
        self.paths: dict[str, Path] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.input_fn is None and not pl_module.automatic_optimization:
            raise ValueError(
                "FP8SensitivityCallback measures through training_step, which steps the optimizers itself under manual "
                "optimization: pass input_fn (and loss_fn) to measure pl_module(input_fn(batch)) instead"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_dir = trainer.log_dir  # a collective: every rank asks
        if not trainer.is_global_zero:
            return
        from lightning_fp8.fabric import FP8PrecisionBase

        plugin = trainer.precision_plugin
        recipe: FP8Recipe | str = self.recipe or "tensorwise"
        compute_dtype = torch.bfloat16
        skip_unaligned = True
        if isinstance(plugin, FP8PrecisionBase):
            recipe = self.recipe or plugin.recipe
            compute_dtype = plugin.compute_dtype
            skip_unaligned = plugin.skip_unaligned  # the layers the plugin runs in FP8 are the ones measured
        if trainer.train_dataloader is None:
            raise ValueError("FP8SensitivityCallback: the trainer has no training dataloader")
        # an extra pass that shifts neither the training's random state nor a loader's own generator (data order)
        with first_training_batches(trainer, self.num_batches) as first:
            batches = list(first)
        input_fn, loss_fn = self.input_fn, self.loss_fn
        common: dict[str, Any] = {
            "compute_dtype": compute_dtype, "loss_delta": self.loss_delta, "skip_unaligned": skip_unaligned
        }
        if input_fn is not None and loss_fn is None:
            self.report = sensitivity_report(pl_module, [input_fn(b) for b in batches], recipe, **common)
        elif input_fn is not None and loss_fn is not None:

            def step(module: nn.Module, batch: Any) -> Any:
                return loss_fn(call_model(module, input_fn(batch)), batch)

            self.report = sensitivity_report(pl_module, batches, recipe, step_fn=step, **common)
        else:
            self.report = sensitivity_report(pl_module, batches, recipe, step_fn=_training_step(trainer), **common)
        rank_zero_info(self.report.to_markdown())
        folder = os.path.join(log_dir or trainer.default_root_dir, self.folder)
        self.paths = self.report.save(folder, self.threshold_db, self.top)
        rank_zero_info(f"FP8 sensitivity report saved to {folder}")


def _training_step(trainer: pl.Trainer) -> Callable[[nn.Module, Any], Any]:
    """``step_fn`` that runs the copy's ``training_step`` (its logging ignored, its ``trainer`` the real one)."""

    def step(module: nn.Module, batch: Any) -> Any:
        if getattr(module, "_trainer", None) is None and isinstance(module, pl.LightningModule):
            module._trainer = trainer
        with muted_logging(module):
            return module.training_step(batch, 0)  # type: ignore[operator]

    return step
