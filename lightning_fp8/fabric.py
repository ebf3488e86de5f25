"""``FP8Precision`` for Lightning Fabric, and the logic it shares with the Trainer plugin.

:class:`FP8PrecisionBase` holds everything the two plugins share, with the method names both Lightning
APIs use in the same way (``convert_module``, the init contexts, ``forward_context``, ``convert_input``,
``state_dict``, ``load_state_dict``). The Fabric class adds Fabric's hooks (``backward``,
``optimizer_step``, ``unscale_gradients``, and Fabric's cast of forward arguments); the Trainer class
(:mod:`lightning_fp8.precision`) adds the Trainer's, the way Lightning's own Transformer Engine plugins
are split.

What the plugin owns:

* **Conversion.** ``convert_module`` turns the eligible ``nn.Linear`` layers into
  :class:`~lightning_fp8.FP8Linear` in place (idempotent; DDP ignores the returned module) and binds
  their FP8 state into one table per recipe. If no layer can run in FP8 it raises instead of silently
  training in high precision; so does an ``exclude`` pattern that matches no layer of any of the
  models (checked when the models are known: Trainer at setup, Fabric at the first forward).
  Every model set up with the plugin is tracked (Fabric may set up
  several: a generator and a discriminator). Rank 0 logs one line per model with the recipe, the
  converted/skipped layers (with reasons), the GEMM path and the device.
* **Layers kept in high precision by name** (``high_precision_layers``, next to ``exclude``):
  :meth:`~FP8PrecisionBase.keep_in_high_precision` switches an FP8 layer back to its high-precision type (same
  Parameters) and remembers it; ``convert_module`` then keeps it in high precision, exactly as an ``exclude`` pattern
  would, for every later conversion (``trainer.validate`` / ``test`` / ``predict`` convert the model again), and the
  checkpoint state carries the names, so that a resumed run or an evaluation from a checkpoint keeps them too.
  :class:`~lightning_fp8.FP8FallbackCallback` uses it.
* **The autocast region.** Every forward runs inside ``torch.autocast(compute_dtype)`` plus the FP8
  region (deferred rolling). With ``fp8_eval=False`` layers in eval mode compute in ``compute_dtype``.
* **Loss scaling** (:mod:`lightning_fp8.loss_scaling`): by default ``"skip_nonfinite"`` for bfloat16
  (true gradients, non-finite steps skipped and counted) and ``"dynamic"`` for float16.
* **Once per optimizer step, for the state tables of the models that optimizer updates:** when the loss
  scale changed, the ``grad_output`` amaxes recorded under the old scale are rescaled to the new one
  (every table); under DDP the pending amaxes are MAX-reduced across ranks in one collective; then the
  amax histories roll. A constant number of tensor operations per state table, whatever the depth.
* **Checkpoint state.** ``state_dict`` holds the loss-scaler state, the skipped-step count, the FP8
  state of every model (in set-up order) and the layers kept in high precision, as tensors and plain values
  only (``weights_only=True`` loads it). The model ``state_dict`` is untouched: it keeps the keys and dtypes
  of the plain model. On resume with more than one rank the element counters restart from zero on every
  rank (a checkpoint holds the saving rank's counters); :class:`~lightning_fp8.stats.FP8Stats` takes a new
  baseline from them.

Synchronisations: the FP8 layers and the bookkeeping never read a device value on the host. With
an optimizer that accepts the scaler's tensors (``_step_supports_amp_scaling``, e.g.
``torch.optim.AdamW(fused=True)``), a step performs no device-to-host synchronisation; with any
other optimizer, ``GradScaler.step`` reads the inf-check flag once.

Why ``HalfPrecision`` among the base classes: Lightning's throughput utilities (``ThroughputMonitor``,
MFU) choose the peak FLOPs from the plugin's class, and read ``_desired_input_dtype`` only for
``HalfPrecision`` (Trainer and Fabric). This plugin sets it to ``torch.int8`` where the native FP8 GEMM
runs (Lightning's FLOPs table keeps FP8 peaks under ``int8``, as it does for its Transformer Engine
plugin) and to the compute dtype otherwise. Every method ``HalfPrecision`` defines is overridden here;
nothing of it is inherited.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import weakref
from collections.abc import MutableMapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision.half import HalfPrecision
from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import Optimizable
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_fp8 import gemm
from lightning_fp8.convert import ConversionReport, check_exclude, convert_from_fp8, convert_to_fp8, exact_pattern
from lightning_fp8.distributed import (
    FP8ShardedWeight,
    _gathered_weights_epoch,
    _local,
    all_reduce_pending_amax,
    fp8_all_gather_shard,
    gathered_weight,
    enable_fp8_all_gather,
    gathers_fp8,
    precompute_fp8_weight_scales,
    reshard_fsdp_modules,
    tied_parameters,
    world_size,
)
from lightning_fp8.loss_scaling import LossScaler, LossScalingMode, resolve_loss_scaling
from lightning_fp8.module import FP8Module
from lightning_fp8.recipe import FP8Recipe, RecipeName
from lightning_fp8.region import fp8_region
from lightning_fp8.state import (
    FP8StateTable, fp8_layers, fp8_state_dict, load_fp8_state_dict, state_tables, without_orig_mod,
)
from lightning_fp8.stats import FP8Stats

log = logging.getLogger(__name__)

COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
PLUGIN_STATE_VERSION = 2

#: Every plugin created, newest last (weak references): :func:`plugin_of` finds the one that set up a model.
_PLUGINS: list[weakref.ReferenceType[FP8PrecisionBase]] = []


def plugin_of(model: nn.Module) -> FP8PrecisionBase | None:
    """The most recently created FP8 plugin that set up ``model``'s FP8 layers, if any (:func:`lightning_fp8.calibrate`
    takes its autocast region and loss scale from it)."""
    tables = {id(table) for table in state_tables(model)}
    for ref in reversed(_PLUGINS):
        plugin = ref()
        if plugin is not None and any(id(table) in tables for table in plugin._tables):
            return plugin
    return None


def _model_class(model: nn.Module | str) -> str:
    """The model's class name as checkpoints record it, without the ``FSDP`` prefix of the class FSDP2's ``fully_shard``
    gives a module it shards (``FSDPGPT`` for ``GPT``): a checkpoint of a sharded run resumes unsharded and back."""
    name = model if isinstance(model, str) else type(model).__qualname__
    if isinstance(model, str) or isinstance(model, FSDPModule):
        name = name[4:] if name.startswith("FSDP") and len(name) > 4 else name
    return name


def prepare_for_sharding(
    module: nn.Module, plugin: FP8PrecisionBase | None = None, *, fp8_all_gather: bool = True
) -> list[str]:
    """Make ``module`` ready to be sharded with FSDP2 / tensor parallelism under an FP8 plugin: convert its layers to FP8
    with the plugin's settings, and give the FP8 layers whose recipe gathers in FP8 (``tensorwise``, ``delayed``) a
    weight that FSDP2 all-gathers in FP8 (:class:`~lightning_fp8.distributed.FP8ShardedWeight`). Returns the names of
    those layers (``[]`` with ``fp8_all_gather=False``: FSDP2 then gathers every weight in the parameter dtype, or
    ``MixedPrecisionPolicy.param_dtype``, and each layer casts the gathered weight).

    Call it before ``fully_shard`` / ``parallelize_module``, and before creating the optimizer:

    * Trainer with ``ModelParallelStrategy``: first thing in ``LightningModule.configure_model`` (Lightning calls
      ``configure_model`` before the plugin's ``convert_module``, which then finds the layers converted and only checks
      them);
    * Fabric with ``ModelParallelStrategy``: first thing in the ``parallelize_fn`` (Fabric converted the model already).

    Idempotent. ``plugin``: the FP8 plugin; by default the Trainer's (``module.trainer.precision_plugin``) or the one
    that converted ``module`` (Fabric).

    Raises:
        ValueError: if no FP8 plugin is given or found, or if ``module`` is sharded already.
    """
    if plugin is None:
        trainer = getattr(module, "_trainer", None)
        plugin = getattr(trainer, "precision_plugin", None) if trainer is not None else None
        if not isinstance(plugin, FP8PrecisionBase):
            plugin = plugin_of(module)
    if not isinstance(plugin, FP8PrecisionBase):
        raise ValueError(
            "prepare_for_sharding found no FP8 plugin for this model: call it inside configure_model of a LightningModule "
            "attached to a Trainer with plugins=[FP8Precision()], or pass plugin=<the FP8Precision>."
        )
    plugin.convert_module(module)
    if not fp8_all_gather:
        plugin._fp8_all_gather_declined = True
        return []
    names = enable_fp8_all_gather(module)
    plugin._own_gather_layers(module)  # before any gather: FSDP2's unshard() may gather ahead of the first forward
    return names


class FP8PrecisionBase(Precision):
    """The logic of both FP8 plugins (see the module docstring). Use :class:`FP8Precision` (Fabric) or
    :class:`lightning_fp8.FP8Precision` (Trainer).

    All arguments are keyword-only and plainly typed so LightningCLI yaml can express them.

    Args:
        recipe: ``"tensorwise"`` (current scaling, default), ``"delayed"`` (amax history, Transformer
            Engine semantics) or ``"rowwise"`` (per-row power-of-two scales). See :mod:`lightning_fp8.recipe`.
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``; ``None`` (default): the
            recipe's default (``hybrid``; ``e4m3`` for ``rowwise``, its only format).
        amax_history_len: length of each tensor's amax ring buffer (default 16).
        amax_compute_algo: ``"max"`` or ``"most_recent"``; ``delayed`` only (``None``: ``"max"``).
        margin: ``delayed`` scales are divided by ``2**margin``; ``delayed`` only.
        power_of_2_scale: round every scale down to a power of two (``None``: only for ``rowwise``).
        compute_dtype: dtype of ``torch.autocast`` around the forward: ``torch.bfloat16`` (default) or
            ``torch.float16``. Parameters and optimizer state stay in their own dtype (float32).
        exclude: glob patterns (``fnmatch``) of fully-qualified names of layers kept in high precision (e.g.
            ``["lm_head"]``, ``["*.router"]``, ``["blocks.0.*"]``); each pattern is matched against the layers' own
            names (``"blocks.0"`` names a block, not its layers). A pattern that matches no layer of any model set up
            with the plugin raises a ``ValueError`` naming the closest layer names: Trainer at setup, Fabric at the
            first forward (across every model set up by then, so a pattern may name a layer of one model only).
        skip_unaligned: keep layers whose features are not multiples of 16 in high precision (default).
        fp8_eval: run validation, test and predict in FP8 too (default ``True``: the model is evaluated
            with the numerics it is trained with, so validation and training losses are comparable).
            With ``False``, layers in eval mode compute in ``compute_dtype`` only.
        loss_scaling: ``"auto"`` (default: ``"dynamic"`` for float16, ``"skip_nonfinite"`` for bfloat16),
            ``"dynamic"`` (or ``True``), ``"skip_nonfinite"`` or ``"off"`` (or ``False``); see
            :mod:`lightning_fp8.loss_scaling`.
        init_scale: ``GradScaler`` setting for ``"dynamic"``: the initial loss scale (default ``2**16``).
        growth_factor: ``GradScaler`` setting for ``"dynamic"``: the scale is multiplied by this after
            ``growth_interval`` consecutive steps with finite gradients (default ``2.0``).
        backoff_factor: ``GradScaler`` setting for ``"dynamic"``: the scale is multiplied by this when a step
            is skipped for non-finite gradients (default ``0.5``).
        growth_interval: ``GradScaler`` setting for ``"dynamic"``: consecutive clean steps before the scale
            grows (default ``2000``).
        calibration_batches: Trainer only, ``delayed`` only: before the first training step, run the first
            ``calibration_batches`` batches of the training dataloader through ``training_step`` in FP8, with a
            backward and no optimizer step, to fill the amax histories with measured amaxes (see
            :mod:`lightning_fp8.calibration`). Skipped when the histories already hold amaxes (a resume from a
            checkpoint). Default ``0``: no calibration. Fabric has no training loop to hook into: there, call
            :func:`lightning_fp8.calibrate` before the loop; a value > 0 on Fabric's plugin is an error.
        statistics_every_n_steps: count on one training step in this many (default ``1``: every step). The counts
            (nonzero, overflow and underflow elements of every cast, and the histograms of slice and block amaxes,
            which :class:`~lightning_fp8.FP8StatsCallback` turns into its fractions) cost passes over the tensors;
            the amaxes and scales, which the scaling needs, are recorded on every step whatever this says. On the
            other steps the casts skip the counting (``quantize(counters=False)``): the counters are then sums over
            the counting steps, the fractions are those of the counting steps, and a logging interval without one
            logs no fractions. A step is an optimizer step (all micro-batches of an accumulation window count or
            none); the first step counts. The steps are counted per state table (one per model and recipe), on the
            first optimizer that steps it: two models whose optimizers take turns (a GAN's generator and
            discriminator) each count on their own steps 0, n, 2n, ...; optimizers taking turns over parts of one
            model make one step per round. Compiled, the counting steps and the others run two graphs (two
            compiles instead of one during warm-up; evaluation graphs are not affected).

    Attributes:
        high_precision_layers: ``{fully-qualified layer name: reason}`` of the layers kept in high precision by name
            (:meth:`keep_in_high_precision`), next to ``exclude``; saved in and restored from checkpoints.

    Raises:
        ValueError: for any invalid value, naming the field and the valid values.
    """

    #: Parameters, gradients and optimizer state stay float32; FP8 applies to GEMM operands only.
    #: ``"32-true"`` makes Lightning's model summary report the real parameter memory.
    precision: Literal["32-true"] = "32-true"  # type: ignore[assignment]

    def __init__(
        self,
        *,
        recipe: RecipeName = "tensorwise",
        fp8_format: Literal["hybrid", "e4m3"] | None = None,
        amax_history_len: int = 16,
        amax_compute_algo: Literal["max", "most_recent"] | None = None,
        margin: int = 0,
        power_of_2_scale: bool | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        exclude: list[str] | None = None,
        skip_unaligned: bool = True,
        fp8_eval: bool = True,
        loss_scaling: LossScalingMode | bool = "auto",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        calibration_batches: int = 0,
        statistics_every_n_steps: int = 1,
    ) -> None:
        self.recipe = FP8Recipe(
            name=recipe,
            fp8_format=fp8_format,
            amax_history_len=amax_history_len,
            amax_compute_algo=amax_compute_algo,
            margin=margin,
            power_of_2_scale=power_of_2_scale,
        )
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={compute_dtype} is not valid; choose one of {list(COMPUTE_DTYPES)}")
        if exclude is None:
            exclude = []
        if isinstance(exclude, str) or not all(isinstance(p, str) for p in exclude):
            raise ValueError(f"exclude must be a list of glob patterns (strings), got {exclude!r}")
        if not (isinstance(init_scale, (int, float)) and init_scale > 0):
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1):
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not (isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1):
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self.calibration_batches = self._check_calibration_batches(calibration_batches)
        if (
            isinstance(statistics_every_n_steps, bool)
            or not isinstance(statistics_every_n_steps, int)
            or statistics_every_n_steps < 1
        ):
            raise ValueError(f"statistics_every_n_steps must be an int >= 1, got {statistics_every_n_steps!r}")
        self.statistics_every_n_steps = statistics_every_n_steps
        self._stepped_tables: set[int] = set()  # tables whose step count moved since the last training forward
        #: per table, the optimizer whose steps are its steps of statistics_every_n_steps (see _advance_statistics_steps)
        self._statistics_clocks: weakref.WeakKeyDictionary[FP8StateTable, weakref.ref[Any]] = weakref.WeakKeyDictionary()
        self.compute_dtype = compute_dtype
        self.exclude = list(exclude)
        self.skip_unaligned = bool(skip_unaligned)
        self.fp8_eval = bool(fp8_eval)
        self.loss_scaling = resolve_loss_scaling(loss_scaling, compute_dtype)
        self.loss_scaler = LossScaler(
            self.loss_scaling,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
        #: The models set up with this plugin, in set-up order.
        self.fp8_models: list[nn.Module] = []
        #: One conversion report per model.
        self.reports: list[ConversionReport] = []
        self._tables: list[FP8StateTable] = []
        self._param_owner: dict[int, int] = {}
        self._optimizer_tables: weakref.WeakKeyDictionary[Any, tuple[int, list[FP8StateTable]]] = weakref.WeakKeyDictionary()
        #: checkpoint states (and their tables' statistics_every_n_steps step counts) waiting for their model
        self._pending_states: list[tuple[dict[str, Any], list[int] | None]] = []
        self._restore_counters = True
        self._load_ratio: float | None = None
        self._plain_models: list[tuple[nn.Module, ConversionReport]] = []
        self._announced = 0
        self._announced_plain = 0
        self._exclude_checked = 0
        self.high_precision_layers: dict[str, str] = {}
        self._switch_pending = False  # names in high_precision_layers whose FP8 layers are not switched yet
        self._warned_unprepared = False
        self._warned_retained_graph = False
        self._fp8_all_gather_declined = False  # prepare_for_sharding(fp8_all_gather=False): no warning
        self._gather_layers: list[nn.Module] | None = None  # layers whose weights FSDP2 gathers in FP8 (lazily)
        self._gather_set: set[int] = set()  # their id()s
        self._gather_scales_stale = True  # an optimizer step, a set-up or a restore since the last precompute
        _PLUGINS[:] = [ref for ref in _PLUGINS if ref() is not None]
        _PLUGINS.append(weakref.ref(self))

    #: Whether this class runs ``calibration_batches`` itself (the Trainer plugin does; Fabric has no loop to hook).
    _calibrates_before_training = False

    def _check_calibration_batches(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"calibration_batches must be an int >= 0, got {value!r}")
        if value and self.recipe.name != "delayed":
            raise ValueError(
                f"calibration_batches={value!r} has no effect with recipe={self.recipe.name!r}: only recipe='delayed' "
                "takes its scales from the amax history that calibration fills; remove it or use recipe='delayed'"
            )
        if value and not self._calibrates_before_training:
            raise ValueError(
                f"calibration_batches={value!r} applies to the Trainer plugin (lightning_fp8.FP8Precision) only: Fabric "
                "has no training loop to hook into. Call lightning_fp8.calibrate(model, batches, loss_fn) after "
                "fabric.setup and before the loop."
            )
        return value

    # ------------------------------------------------------------------ what Lightning reads
    @property
    def _desired_input_dtype(self) -> torch.dtype:  # type: ignore[override]
        """For Lightning's FLOPs table: ``torch.int8`` (its FP8 peak entry) on the native FP8 path, else the compute
        dtype. Before a model is set up the device is the current CUDA device, if any (Lightning asks at setup)."""
        if self.fp8_models:
            device = self._device()
        else:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return torch.int8 if gemm.gemm_path(device, self.recipe.name) == "native" else self.compute_dtype

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The ``torch.amp.GradScaler`` (``None`` with ``loss_scaling="off"``), created with the plugin."""
        return self.loss_scaler.scaler

    @property
    def loss_scale(self) -> Tensor | None:
        """Current loss scale on the device (1 with ``"skip_nonfinite"``, ``None`` with ``"off"``)."""
        return self.loss_scaler.scale_tensor

    @property
    def skipped_steps(self) -> Tensor:
        """Cumulative number of optimizer steps skipped for non-finite gradients, on the device."""
        return self.loss_scaler.skipped_steps

    @property
    def report(self) -> ConversionReport | None:
        """The conversion report of the most recently set-up model."""
        return self.reports[-1] if self.reports else None

    @property
    def state_tables(self) -> list[FP8StateTable]:
        """The FP8 state tables of all set-up models."""
        return list(self._tables)

    # ------------------------------------------------------------------ conversion
    def _forget_models(self) -> None:
        """Stop tracking every model set up so far (their layers keep their FP8 state; the loss scaler and a
        checkpoint state still waiting for its model are kept)."""
        self.fp8_models, self.reports, self._tables, self._plain_models = [], [], [], []
        self._param_owner.clear()
        self._optimizer_tables.clear()
        self._announced = self._announced_plain = self._exclude_checked = 0

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert ``module``'s eligible Linear layers to FP8 in place, bind their state, track the model.

        Raises:
            ValueError: for sharded (FSDP) modules. A model with no layer that can run in FP8 is not tracked; if no
                model set up with the plugin has one, the first forward (Trainer: ``connect``) raises.
        """
        self._check_strategy(module)
        self._switch_kept_layers()  # a switch still waiting for the next forward
        for name, child in module.named_modules():  # FP8 already (an earlier conversion): convert_to_fp8 keeps it
            if name in self.high_precision_layers and isinstance(child, FP8Module):
                convert_from_fp8(child)
        # A pattern may name a layer of only one of several models (Fabric: a generator and a discriminator): the
        # patterns are checked across all models in `announce`, once they are known. The layers kept in high precision
        # by name are excluded exactly, with their own reason.
        report = convert_to_fp8(
            module,
            recipe=self.recipe,
            exclude=[*self.exclude, *map(exact_pattern, self.high_precision_layers)],
            skip_unaligned=self.skip_unaligned,
            log_summary=False,
            allow_unmatched_exclude=True,
        )
        for name, reason in self.high_precision_layers.items():
            if name in report.skipped and not any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
                report.skipped[name] = reason
        self._converted_after_sharding(module, report)
        self._gather_layers, self._gather_scales_stale = None, True
        if not report.fp8_layers:
            # Fabric may set up a model with nothing to convert next to FP8 ones (a conv discriminator, a frozen
            # teacher): it runs in compute_dtype. With no FP8 model at all, the first forward raises (announce).
            if not any(m is module for m, _ in self._plain_models):
                self._plain_models.append((module, report))
            return module
        known = next((i for i, m in enumerate(self.fp8_models) if m is module), None)
        if known is not None:
            self.reports[known] = report
            for param in module.parameters():  # sharding replaced them since the first conversion
                self._param_owner.setdefault(id(param), known)
        else:
            self.fp8_models.append(module)
            self.reports.append(report)
            for param in module.parameters():
                self._param_owner.setdefault(id(param), len(self.fp8_models) - 1)
            if self._pending_states:
                self._load_model_state(module, *self._pending_states.pop(0))
        # a submodule shared by two models (a common trunk) is in both models' tables: list each table once
        self._tables = list({id(t): t for m in self.fp8_models for t in state_tables(m)}.values())
        self._optimizer_tables.clear()
        return module

    def keep_in_high_precision(
        self, name: str, reason: str = "kept in high precision", *, before_next_forward: bool = False
    ) -> None:
        """Switch the FP8 layer ``name`` back to its high-precision type (same Parameters: the optimizer and DDP are
        unaffected) and keep it there for the rest of the plugin's life, as if ``exclude`` named it.

        ``name`` is a fully-qualified layer name within a model set up with the plugin, as ``exclude`` patterns name
        layers (the LightningModule's names for the Trainer), matched exactly; the layer of that name is switched in
        every set-up model that has one. From then on ``convert_module`` keeps it in high precision, with ``reason`` in
        the conversion report's ``skipped`` (``trainer.validate`` / ``test`` / ``predict`` convert the model again),
        and :meth:`state_dict` saves the name, so that a run resumed from the checkpoint, or an evaluation of it,
        switches it again before its first batch. Its row stays in its state table, unused; it is no longer rolled,
        read by :class:`~lightning_fp8.FP8Stats` or exported by :func:`~lightning_fp8.fp8_state_dict`.

        Args:
            name: the layer's fully-qualified name.
            reason: why (shown in the conversion report).
            before_next_forward: switch it at the start of the next forward (any forward of a set-up model:
                training, validation, test, predict), or at the next :meth:`state_dict` or teardown if those come
                first, instead of now. :class:`~lightning_fp8.FP8FallbackCallback` decides at the end of a training
                step: every callback that reads statistics at the end of that step still reads the layer, whatever
                the callbacks' order.

        Raises:
            ValueError: if ``name`` is not a non-empty string.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be the fully-qualified name of a layer, got {name!r}")
        self.high_precision_layers[name] = str(reason)
        self._switch_pending = True
        if not before_next_forward:
            self._switch_kept_layers()

    def _switch_kept_layers(self) -> list[str]:
        """Switch the FP8 layers of the set-up models named in ``high_precision_layers`` (after a call of
        :meth:`keep_in_high_precision`, or a restore); returns their names. A no-op (one flag test) otherwise."""
        if not self._switch_pending:
            return []
        self._switch_pending = False
        switched = []
        for model, report in zip(self.fp8_models, self.reports):
            for name, child in model.named_modules():
                if name in self.high_precision_layers and isinstance(child, FP8Module):
                    if isinstance(_local(getattr(child, "weight", None)), FP8ShardedWeight):
                        rank_zero_warn(
                            f"FP8Precision: layer {name!r} switches to high precision, but FSDP2 gathers its weight in "
                            "FP8 (the all-gather's dtype is fixed when it first runs): it computes in high precision "
                            "from the dequantized FP8 weight."
                        )
                    convert_from_fp8(child)
                    switched.append(name)
            for name, reason in self.high_precision_layers.items():  # a layer shared by two models is in both reports
                if name in report.converted or name in report.already_fp8:
                    report.converted[:] = [n for n in report.converted if n != name]
                    report.already_fp8[:] = [n for n in report.already_fp8 if n != name]
                    report.skipped[name] = reason
        return switched

    def _check_strategy(self, module: nn.Module | None) -> None:
        """Sharded models: refuse FSDP1 (``FullyShardedDataParallel``, see the error); under FSDP2 / DTensor
        (``ModelParallelStrategy``) mark the sharded FP8 layers (their weights are not cast once per step and kept: the
        kept FP8 copy of a whole weight would undo the sharding), and warn once when layers that could gather their
        weights in FP8 gather them in high precision (the model was not prepared with :func:`prepare_for_sharding`)."""
        if module is None:
            return
        if any("FullyShardedDataParallel" in type(m).__name__ for m in module.modules()):
            raise ValueError(
                "FP8Precision does not support FSDP1 (FullyShardedDataParallel, strategy='fsdp'): shard with FSDP2 "
                "through ModelParallelStrategy instead (fully_shard in configure_model, after "
                "lightning_fp8.prepare_for_sharding(self)); see the distributed page of the docs."
            )
        self._own_gather_layers(module)  # layers wrapped for FP8 all-gather without prepare_for_sharding too
        unprepared, replaced = [], []
        tied = tied_parameters(module)
        for name, layer in fp8_layers(module):
            if any(isinstance(p, DTensor) for p in layer.parameters(recurse=False)):
                layer._fp8_sharded = True  # type: ignore[assignment]
                weight = getattr(layer, "weight", None)
                if (
                    not isinstance(_local(weight), FP8ShardedWeight)
                    and gathers_fp8(layer.fp8_recipe)  # type: ignore[arg-type]
                    and id(weight) not in tied  # a tied weight gathers in high precision on purpose
                ):
                    # prepared, then the weight lost its wrapper (torch's TP styles, load_state_dict(assign=True))
                    (replaced if layer.weight_provider is gathered_weight else unprepared).append(name)  # type: ignore[attr-defined]
        if replaced and not self._warned_unprepared:
            self._warned_unprepared = True  # once, like the warning below
            rank_zero_warn(
                f"FP8Precision: {len(replaced)} FP8 layer(s) ({', '.join(replaced[:3])}{', ...' if len(replaced) > 3 else ''}) "
                "were prepared for FP8 all-gather, but their weights lost it afterwards, so they gather in high "
                "precision: sharded for tensor parallelism with torch's ColwiseParallel / RowwiseParallel (use "
                "lightning_fp8.FP8ColwiseParallel / FP8RowwiseParallel), or replaced (load_state_dict(assign=True), a "
                "new nn.Parameter: load into the parameters in place, with load_state_dict without assign or "
                "torch.distributed.checkpoint's set_model_state_dict)."
            )
        if unprepared and not self._warned_unprepared and not self._fp8_all_gather_declined:
            self._warned_unprepared = True
            rank_zero_warn(
                f"FP8Precision: {len(unprepared)} sharded FP8 layer(s) ({', '.join(unprepared[:3])}"
                f"{', ...' if len(unprepared) > 3 else ''}) gather their weights in high precision. To gather them in "
                "FP8: call lightning_fp8.prepare_for_sharding(model) before sharding (Trainer: at the top of "
                "configure_model; Fabric: of the parallelize_fn), and shard FP8 layers for tensor parallelism with "
                "lightning_fp8.FP8ColwiseParallel / FP8RowwiseParallel (torch's styles drop the FP8 all-gather)."
            )

    def _converted_after_sharding(self, module: nn.Module, report: ConversionReport) -> None:
        """Layers must become FP8 before the model is sharded (FSDP2 wraps each sharded module in a new class and
        decides at sharding time how each weight is gathered): raise when ``convert_module`` finds a sharded model
        with layers still to convert."""
        if not any(isinstance(p, DTensor) for p in module.parameters()):
            return
        late = list(report.converted) + [
            n for n, why in report.skipped.items() if type(module.get_submodule(n)).__name__.startswith("FSDP") and "subclass" in why
        ]
        if late:
            raise ValueError(
                f"FP8Precision: the model was sharded (fully_shard / parallelize_module) before its layers were converted "
                f"to FP8 ({', '.join(late[:3])}{', ...' if len(late) > 3 else ''}). Call "
                "lightning_fp8.prepare_for_sharding(self) at the top of LightningModule.configure_model (Fabric: of the "
                "ModelParallelStrategy parallelize_fn), before sharding."
            )

    # ------------------------------------------------------------------ FSDP2 FP8 all-gather
    def _own_gather_layers(self, module: nn.Module) -> None:
        """Name this plugin on every layer of ``module`` whose weight FSDP2 gathers in FP8: its pre-all-gather then
        asks this plugin for the shared scales (:meth:`_gather_scales_for`); they are collected again at the next
        gather."""
        for layer in module.modules():
            if fp8_all_gather_shard(layer) is not None:
                layer.__dict__["_fp8_gather_plugin"] = weakref.ref(self)
                self._gather_layers = None

    def _gather_scales_for(self, layer: nn.Module) -> None:
        """Called by FSDP2's pre-all-gather of ``layer``'s FP8 weight (through the layer, which names this plugin):
        make sure the shared scales of the weights FSDP2 gathers in FP8 fit the weights. They are computed for all
        such weights at once, one all-reduce (:func:`~lightning_fp8.distributed.precompute_fp8_weight_scales`), at the
        first gather after an optimizer step (the plugin's, or any step of an optimizer holding such weights: a
        counter that a global ``torch.optim`` post-step hook moves, as a fused optimizer moves no version counter), a
        set-up or a restore (a flag), or when this layer changed since:
        its parameter (a new one, or an in-place change such as ``load_state_dict``: its version counter) or its
        training flag (weights swapped in for evaluation through ``.data``, as weight averaging does, move no version
        counter). Otherwise a flag test and one look at the layer (host values, no device work).

        The decision rests only on what every rank that gathers the layer shares (the steps, loads and mode switches
        of a sharded model run on all its ranks), and it is taken where FSDP2 gathers, which all those ranks do
        together, never in a forward that one rank may run alone; so every rank joins the collective. FSDP2's
        ``unshard()`` ahead of the forward gets fresh scales too."""
        if self._gather_layers is None:  # the layers (FP8, or switched back to high precision) whose weights do
            self._gather_layers = [m for model in self.fp8_models for m in model.modules() if fp8_all_gather_shard(m) is not None]
            self._gather_set = {id(m) for m in self._gather_layers}
            self._gather_scales_stale = True
        epoch = _gathered_weights_epoch()
        if epoch != getattr(self, "_gather_epoch", None):  # an optimizer stepped the gathered weights, maybe unseen
            self._gather_epoch, self._gather_scales_stale = epoch, True
        weight = layer.weight
        seen = layer.__dict__.get("_fp8_gather_seen")
        if not self._gather_scales_stale and seen is not None and seen[0] is weight and seen[1:] == (weight._version, layer.training):
            return
        layers = self._gather_layers if id(layer) in self._gather_set else [layer]  # a layer set up elsewhere: its own
        shards = [fp8_all_gather_shard(m) for m in layers]
        precompute_fp8_weight_scales([w for w in shards if w is not None])
        for m in layers:
            m.__dict__["_fp8_gather_seen"] = (m.weight, m.weight._version, m.training)
        if layers is self._gather_layers:
            self._gather_scales_stale = False

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        """Tensors are created in their own dtype (no default-dtype change)."""
        return nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        """Modules are created as usual; conversion happens in :meth:`convert_module`."""
        return nullcontext()

    @override
    def convert_input(self, data: Any) -> Any:
        """Batches are left as they are (Lightning's ``bf16-mixed`` does not cast them either): float targets,
        masks and weights keep their precision; autocast casts what reaches a GEMM."""
        return data

    def _device(self, index: int = 0) -> torch.device:
        for tensor in self.fp8_models[index].parameters():
            return tensor.device
        return torch.device("cpu")

    def announce(self) -> None:
        """Log, on rank 0 and once per model, the line that confirms FP8 is active (Trainer: at ``connect``;
        Fabric: at the first forward, once the models are on their device and wrapped).

        Raises:
            ValueError: if an ``exclude`` pattern matches no layer of any model set up with the plugin, naming the
                closest layer names; if no model set up with the plugin has a layer that can run in FP8 (never train
                silently in high precision).
        """
        self._check_exclude()
        if not self.fp8_models and self._plain_models:
            reasons = "; ".join(
                f"{n or '<root>'}: {why}" for _, report in self._plain_models for n, why in report.skipped.items()
            )
            raise ValueError(
                "FP8Precision found no layer that can run in FP8 (" + (reasons or "the model has no nn.Linear") + "). "
                "Refusing to train silently in high precision: remove the plugin, or adjust `exclude` / `skip_unaligned`."
            )
        while self._announced_plain < len(self._plain_models):
            module, report = self._plain_models[self._announced_plain]
            self._announced_plain += 1
            why = "; ".join(f"{n or '<root>'}: {w}" for n, w in report.skipped.items()) or "it has no nn.Linear"
            rank_zero_info(
                f"lightning_fp8: {type(module).__name__} has no layer that can run in FP8 ({why}); it runs in "
                f"{self.compute_dtype}"
            )
        while self._announced < len(self.fp8_models):
            index = self._announced
            self._announced += 1
            # Fabric wraps the module for its strategy after convert_module: check the result once here.
            self._check_strategy(self.fp8_models[index])
            device = self._device(index)
            if index == 0:
                self.loss_scaler.bind(device)
            report = self.reports[index]
            report.device = str(device)
            report.gemm_path = gemm.gemm_path(device, report.recipe.name)
            rank_zero_info(f"lightning_fp8: {report.summary()}; compute dtype {self.compute_dtype}")

    def _check_exclude(self) -> None:
        """Every ``exclude`` pattern must match a layer of a set-up model (checked when models were added)."""
        models = self.fp8_models + [module for module, _ in self._plain_models]
        if not self.exclude or len(models) <= self._exclude_checked:
            return
        check_exclude(
            self.exclude,
            models,
            owner=f"FP8Precision(exclude={self.exclude!r})",
            advice="Fix the pattern or remove it."
            + (f" (Checked across the {len(models)} models set up so far.)" if len(models) > 1 else ""),
        )
        self._exclude_checked = len(models)

    # ------------------------------------------------------------------ forward
    @override
    def forward_context(self) -> AbstractContextManager:
        """``torch.autocast(compute_dtype)`` plus the FP8 region (layers in eval mode stay in ``compute_dtype``
        when ``fp8_eval=False``)."""
        if not self.fp8_models and not self._plain_models:
            return nullcontext()  # not set up yet
        self._switch_kept_layers()  # one flag test, unless a layer is waiting to be switched
        self.announce()
        stack = ExitStack()
        stack.enter_context(torch.autocast(self._device().type, dtype=self.compute_dtype))
        stack.enter_context(fp8_region(enabled=True, defer_amax_history_roll=True, fp8_eval=self.fp8_eval))
        if torch.is_grad_enabled():  # a training forward (not an evaluation between two optimizers' steps)
            self._stepped_tables.clear()
        every = self.statistics_every_n_steps
        if every > 1:
            # each table counts on its own optimizer steps 0, n, 2n, ... (see after_optimizer_step); read at forward
            # time by the layers (ForwardDecision.count_statistics). On exit the flags go back to what they were: True
            # outside the plugin's regions, the outer region's inside a nested one (a wrapped module called inside
            # another one's forward, or inside fabric.autocast())
            saved = [(table, table.count_statistics) for table in self._tables]
            for table in self._tables:
                table.count_statistics = table.statistics_step % every == 0
            stack.callback(_restore_count_flags, saved)
        return stack

    # ------------------------------------------------------------------ the step
    @staticmethod
    def _check_optimizer(optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, LBFGS):
            raise TypeError(
                "FP8Precision does not support LBFGS or other closure-driven optimizers: loss scaling must see the "
                "gradients of one backward before the step. Use a first-order optimizer (SGD, Adam, AdamW)."
            )

    def _tables_of(self, optimizer: Any) -> list[FP8StateTable]:
        """The state tables of the models whose parameters ``optimizer`` updates. An optimizer over the parameters of
        no set-up model (a model wrapped in a way that replaced its parameters) rolls every table; one over a model
        without FP8 layers rolls none."""
        inner = _inner_optimizer(optimizer)
        groups = getattr(inner, "param_groups", [])
        size = sum(len(group["params"]) for group in groups)  # add_param_group() invalidates the cache
        cached = self._optimizer_tables.get(inner)
        if cached is None or cached[0] != size:
            params = [p for group in groups for p in group["params"]]
            owners = {self._param_owner[id(p)] for p in params if id(p) in self._param_owner}
            if owners:
                models = [self.fp8_models[i] for i in sorted(owners)]
            else:
                plain = {id(p) for m, _ in self._plain_models for p in m.parameters()}
                models = [] if any(id(p) in plain for p in params) else self.fp8_models
            tables = list({id(t): t for m in models for t in state_tables(m)}.values())
            cached = self._optimizer_tables[inner] = (size, tables)
        return cached[1]

    def _scale_loss(self, tensor: Tensor) -> Tensor:
        """The loss to run backward on. The loss-scale update of the previous optimizer steps is applied first
        (once per backward), and every table's grad_output amaxes follow the scale (see :meth:`apply_loss_scale_update`)."""
        scaled, ratio = self.loss_scaler.scale(tensor)
        self.apply_loss_scale_update(ratio)
        return scaled

    def apply_loss_scale_update(self, ratio: Tensor | None) -> None:
        """When the loss scale changed by ``ratio`` (``"dynamic"`` loss scaling), multiply the grad_output amaxes
        recorded under the old scale by it, in every state table (every model's gradients are scaled), and re-derive
        the ``delayed`` gradient scales: the next backward then casts with scales that fit the new loss scale. A
        constant number of tensor operations per table."""
        if ratio is not None:
            for table in self._tables:
                table.rescale_grad_output(ratio)

    def _step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Step (or skip) through the loss scaler, then the FP8 bookkeeping of this optimizer's models."""
        out = self.loss_scaler.step(optimizer, **kwargs)
        self.after_optimizer_step(optimizer)
        return out

    def after_optimizer_step(self, optimizer: Any = None) -> None:
        """The FP8 bookkeeping of one optimizer step (a constant number of tensor operations per state table):
        MAX-reduce the pending amaxes of the models ``optimizer`` updates (all models if ``None``) across ranks
        (one collective), then roll their histories."""
        tables = self._tables if optimizer is None else self._tables_of(optimizer)
        self._advance_statistics_steps(tables, None if optimizer is None else _inner_optimizer(optimizer))
        all_reduce_pending_amax(tables)
        for table in tables:
            table.roll()
        self._gather_scales_stale = True  # the weights changed (and may change again through .data before the forward)

    def _advance_statistics_steps(self, tables: list[FP8StateTable], optimizer: Any) -> None:
        """One step of ``statistics_every_n_steps`` for each of ``tables`` that ``optimizer`` keeps time for: the first
        optimizer that steps a table is its clock (``None``: every table steps), so that optimizers taking turns over
        parts of one table (a generator and a discriminator in one module) make one step per round; and a table steps
        at most once between two training forwards (two optimizers stepping after one forward make one step)."""
        for table in tables:
            if optimizer is not None:
                clock = self._statistics_clocks.get(table)
                if clock is None or clock() is None:
                    self._statistics_clocks[table] = weakref.ref(optimizer)
                elif clock() is not optimizer:
                    continue
            if id(table) not in self._stepped_tables:
                self._stepped_tables.add(id(table))
                table.statistics_step += 1

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        """Loss-scaler state, skipped-step count, the step count of ``statistics_every_n_steps`` and every model's FP8
        state: tensors and plain values only.

        A loss-scale update still pending from the last optimizer step is applied first (it would otherwise
        happen at the next backward), so the saved scale is the one the next backward uses; so is a switch to high
        precision waiting for the next forward, so that the saved FP8 state and ``high_precision_layers`` agree."""
        self.apply_loss_scale_update(self.loss_scaler.update())
        self._switch_kept_layers()
        scaler = self.loss_scaler.state_dict()
        return {
            "version": PLUGIN_STATE_VERSION,
            "recipe": self.recipe.to_dict(),
            "loss_scaling": scaler["mode"],
            "loss_scaler": scaler["scaler"],
            "skipped_steps": scaler["skipped_steps"],
            "world_size": world_size(),
            "model_classes": [_model_class(model) for model in self.fp8_models],
            "models": [fp8_state_dict(model) for model in self.fp8_models],
            "high_precision_layers": dict(self.high_precision_layers),
            # where statistics_every_n_steps stands, per model and state table: a resumed run counts on the steps the
            # uninterrupted one would
            "statistics_steps": [[table.statistics_step for table in state_tables(model)] for model in self.fp8_models],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (or lightning-fp8 0.1's plugin state).

        The layers the checkpoint keeps in high precision (``high_precision_layers``; absent from checkpoints written
        before the plugin kept them) are switched first, and kept for the models set up later. The FP8 states go to
        the set-up models in order; states of models not set up yet wait for them.

        Raises:
            ValueError: if the checkpoint was written with another recipe or FP8 settings.
        """
        version = state_dict.get("version")
        if version == 1:
            state_dict = {
                **state_dict,
                "loss_scaling": "dynamic" if state_dict["loss_scaler"] else "off",
                "skipped_steps": state_dict.get("skipped_steps") if state_dict.get("skipped_steps") is not None else torch.zeros((), dtype=torch.int64),
                "models": [] if state_dict.get("fp8") is None else [state_dict["fp8"]],
            }
        elif version != PLUGIN_STATE_VERSION:
            raise ValueError(f"Unknown FP8Precision checkpoint state version {version!r}")
        saved = FP8Recipe.from_dict(state_dict["recipe"], legacy=version == 1)
        if saved != self.recipe:
            raise ValueError(
                f"The checkpoint was trained with FP8 recipe {saved.to_dict()}, but this FP8Precision is configured "
                f"with {self.recipe.to_dict()}. Resume with the same settings; to switch recipes, load only the model "
                "weights (they do not depend on the recipe) and start a new run."
            )
        if not state_dict["models"] and self.fp8_models:
            rank_zero_warn(
                "FP8Precision: the checkpoint holds no FP8 state (for example, it was saved by the main process of "
                "strategy='ddp_spawn', which does not train): the FP8 state starts fresh, as from a bf16 checkpoint."
            )
        elif len(state_dict["models"]) < len(self.fp8_models):
            raise ValueError(
                f"The checkpoint holds the FP8 state of {len(state_dict['models'])} model(s), but {len(self.fp8_models)} "
                "are set up with this FP8Precision."
            )
        classes = [_model_class(name) for name in state_dict.get("model_classes") or []]
        current = [_model_class(m) for m in self.fp8_models]
        if current[: len(classes)] != classes[: len(current)]:
            raise ValueError(
                f"The checkpoint holds the FP8 state of models {classes}, in set-up order, but this FP8Precision set up "
                f"{current}: set the models up in the same order."
            )
        warning, ratio = self.loss_scaler.load_state_dict(
            {"mode": state_dict["loss_scaling"], "scaler": state_dict["loss_scaler"], "skipped_steps": state_dict["skipped_steps"]}
        )
        if warning:
            rank_zero_warn(f"FP8Precision: {warning}.")
        self._load_ratio = None if ratio is None or ratio == 1.0 else ratio
        self._rescaled: set[int] = set()
        self._stepped_tables.clear()
        models = list(state_dict["models"])
        # The counters of a checkpoint are those of the rank that saved it: they continue exactly only where one
        # rank saved and one rank loads. Otherwise each rank restarts its counters from zero instead of counting
        # the saving rank twice, or losing the others (FP8Stats takes a new baseline from them).
        self._restore_counters = state_dict.get("world_size", 1) == 1 and world_size() == 1
        self._gather_scales_stale = True  # restored weights may come with the state
        for model in self.fp8_models:  # weights FSDP2 holds gathered (the root's, after evaluation) were cast with
            reshard_fsdp_modules(model)  # the scales before the restore: gather them again at the next forward
        kept = state_dict.get("high_precision_layers") or {}
        if kept:
            # by the set-up models' own names: a run resumed with torch.compile switched on or off names its layers
            # with or without `_orig_mod` (the FP8 state is matched the same way); a compiled layer's wrapper and the
            # layer share a name without it, and the layer comes last (`<name>._orig_mod`)
            current = {without_orig_mod(n): n for model in self.fp8_models for n, _ in model.named_modules()}
            kept = {current.get(without_orig_mod(name), name): reason for name, reason in kept.items()}
            self.high_precision_layers.update(kept)
            self._switch_pending = True
            for name in self._switch_kept_layers():
                rank_zero_info(
                    f"lightning_fp8: layer {name!r} runs in high precision, as in the run the checkpoint comes from "
                    f"({self.high_precision_layers[name]})"
                )
        steps = list(state_dict.get("statistics_steps") or [])  # absent from checkpoints before the setting
        pending = [(state, steps[i] if i < len(steps) else None) for i, state in enumerate(models)]
        for model in self.fp8_models[: len(pending)]:
            self._load_model_state(model, *pending.pop(0))
        self._pending_states = pending

    def _load_model_state(self, model: nn.Module, state: dict[str, Any], statistics_steps: list[int] | None) -> None:
        load_fp8_state_dict(model, state, counters=self._restore_counters)
        tables = state_tables(model)
        for table, step in zip(tables, statistics_steps or [0] * len(tables)):
            table.statistics_step = int(step)
        if self._load_ratio is not None:  # the gradients were recorded under another loss scale than the new one
            ratio = torch.tensor(self._load_ratio, dtype=torch.float32)
            for table in tables:
                if id(table) not in self._rescaled:  # a table shared by two models is rescaled once
                    self._rescaled.add(id(table))
                    table.rescale_grad_output(ratio)

    @override
    def teardown(self) -> None:
        """Nothing device-side to free; a switch to high precision still waiting for the next forward is done now (a
        layer switched at the last training step is in high precision when ``fit`` returns)."""
        self._switch_kept_layers()


def _inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Fabric's and Lightning's wrappers."""
    inner = optimizer
    while hasattr(inner, "optimizer") or hasattr(inner, "_optimizer"):
        inner = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer")
    return inner


def _restore_count_flags(saved: list[tuple[FP8StateTable, bool]]) -> None:
    for table, flag in saved:
        table.count_statistics = flag


def _retains_graph(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.backward(*args, **kwargs)`` keeps the graph (``retain_graph``, the second positional argument,
    defaults to ``create_graph``)."""
    retain = kwargs.get("retain_graph", args[1] if len(args) > 1 else None)
    if retain is None:
        retain = kwargs.get("create_graph", args[2] if len(args) > 2 else False)
    return bool(retain)


def warn_if_retained_graph_under_compile(
    plugin: FP8PrecisionBase, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Warn once per plugin when a backward retains the graph while inductor (``torch.compile``'s default backend) has
    compiled something in this process and its FX graph cache is on: a later backward over a retained graph of a
    compiled FP8 model can then be silently wrong (a torch defect: a backward compiled with donated buffers is loaded
    from the cache where the first backward retains the graph; see the troubleshooting page). Process-wide, because
    the compiled wrapper may sit outside what the plugin sees (Fabric and the Trainer unwrap a compiled model)."""
    if plugin._warned_retained_graph or not _retains_graph(args, kwargs):
        return
    import sys

    inductor_config = sys.modules.get("torch._inductor.config")
    if "torch._inductor.compile_fx" not in sys.modules or inductor_config is None or not inductor_config.fx_graph_cache:
        return
    plugin._warned_retained_graph = True
    rank_zero_warn(
        "lightning_fp8: a backward retains the graph while torch.compile's inductor is in use. A second backward over a "
        "retained graph of an inductor-compiled model can be silently wrong: inductor's FX graph cache may hand back a "
        "backward compiled with donated buffers, which overwrites saved activations (a torch defect; FP8 layers bypass "
        "AOTAutograd's cache, whose check would raise). If the graph is compiled, set "
        "torch._inductor.config.fx_graph_cache = False (or TORCHINDUCTOR_FX_GRAPH_CACHE=0) before compiling; see the "
        "troubleshooting page, 'A second backward over a retained graph'."
    )


class FP8Precision(FP8PrecisionBase, HalfPrecision):
    """FP8 training for Lightning Fabric: ``Fabric(plugins=[FP8Precision()])``.

    Every argument is described in :class:`FP8PrecisionBase`. Forward arguments are cast to
    ``compute_dtype`` as Fabric's ``bf16-mixed`` casts them (the Trainer plugin leaves batches alone);
    outputs come back in the default dtype. Statistics for a Fabric loop: :class:`lightning_fp8.FP8Stats`.
    """

    @override
    def convert_input(self, data: Any) -> Any:
        """Cast floating-point forward arguments to ``compute_dtype``, as Fabric's ``bf16-mixed`` does."""
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.compute_dtype)

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Scale the loss (``"dynamic"`` loss scaling), then run the backward pass (warning once where a retained graph
        of a compiled model is at risk: see the troubleshooting page, 'A second backward over a retained graph')."""
        warn_if_retained_graph_under_compile(self, args, kwargs)
        self._scale_loss(tensor).backward(*args, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale the gradients in place (before clipping or inspecting them); once per step."""
        self.loss_scaler.unscale(optimizer)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Step through the loss scaler (skipping non-finite steps), then the FP8 bookkeeping."""
        self._check_optimizer(optimizer)
        return self._step(optimizer, **kwargs)


# ------------------------------------------------------------------ fabric.load of a distributed checkpoint folder


def _loading_into_fp8_objects(load_checkpoint: Any) -> Any:
    """Wrap Fabric's ``ModelParallelStrategy.load_checkpoint`` so that ``fabric.load`` restores the FP8 plugin and
    :class:`~lightning_fp8.FP8Stats` readers of its ``state`` in place, from a distributed checkpoint folder too.

    Why: ``fabric.load(path, {"model": ..., "optimizer": ..., "fp8": plugin, "stats": stats})`` promises to restore the
    given objects in place, and does so from a single-file checkpoint (Lightning calls their ``load_state_dict``). From
    a folder written by ``ModelParallelStrategy`` (FSDP2, tensor parallelism), Lightning 2.6's
    ``lightning.fabric.strategies.model_parallel._load_checkpoint`` puts the saved dictionaries in the state instead
    (``state[key] = metadata.pop(key)``) and never calls ``load_state_dict``: the run resumed silently with empty amax
    histories, the initial loss scale and a reader that had forgotten the run so far. The wrapper loads each such
    object from the dictionary that replaced it and puts the object back, as the single-file branch does. It acts
    only on lightning-fp8's objects, and on nothing where Lightning restored them itself (the object is still in the
    state); other objects keep Lightning's behaviour. The Trainer is not affected: its plugin state is restored by the
    Trainer's own checkpoint connector.
    """

    @functools.wraps(load_checkpoint)
    def load(self: Any, path: Any, state: Any = None, *args: Any, **kwargs: Any) -> Any:
        # the other arguments pass through as given: Lightning 2.6 added ``weights_only``, 2.5 has only ``strict``
        ours = {}
        if isinstance(state, MutableMapping):  # Lightning's branch takes any mapping it can assign into
            ours = {key: obj for key, obj in state.items() if isinstance(obj, (FP8PrecisionBase, FP8Stats))}
        remainder = load_checkpoint(self, path, state, *args, **kwargs)
        for key, obj in ours.items():
            loaded = state.get(key)
            if loaded is not obj:
                obj.load_state_dict(loaded)
                state[key] = obj
        return remainder

    load._lightning_fp8_loads_fp8_objects = True  # type: ignore[attr-defined]
    return load


def _patch_model_parallel_load() -> None:
    """Install :func:`_loading_into_fp8_objects` on Fabric's ``ModelParallelStrategy`` (once)."""
    from lightning.fabric.strategies.model_parallel import ModelParallelStrategy

    if not getattr(ModelParallelStrategy.load_checkpoint, "_lightning_fp8_loads_fp8_objects", False):
        ModelParallelStrategy.load_checkpoint = _loading_into_fp8_objects(ModelParallelStrategy.load_checkpoint)


_patch_model_parallel_load()
