"""``FP8Precision`` for Lightning Fabric: the logic of the precision plugin (the Trainer one is a thin subclass).

What the plugin owns:

* **Conversion.** ``convert_module`` turns the eligible ``nn.Linear`` layers into
  :class:`~lightning_fp8.FP8Linear` in place (idempotent; DDP ignores the returned module). If no layer
  can run in FP8 it raises instead of silently training in high precision. Rank 0 logs one line with
  the recipe, the converted/skipped layers (with reasons), the GEMM path and the device.
* **The autocast region.** Every forward runs inside ``torch.autocast(compute_dtype)`` plus
  :func:`~lightning_fp8.fp8_autocast`. The backward runs outside it (each layer decides at forward time).
* **Dynamic loss scaling** with ``torch.amp.GradScaler``: the loss is scaled before backward, the
  gradients are unscaled before clipping, a step with non-finite gradients is skipped and the scale
  backs off, and it grows after ``growth_interval`` clean steps. The number of skipped steps is
  counted on the device.
* **Delayed-scaling bookkeeping.** The layers record amaxes during every forward and backward of an
  accumulation window (combined with max); the amax histories roll once per optimizer step, after the
  step (or the skip), so a skipped step still records its amaxes. Under DDP the pending amaxes are
  first MAX-reduced across ranks in one collective, so every rank derives the same scales.
* **Checkpoint state.** ``state_dict`` holds the loss-scaler state, the skipped-step count and every
  layer's FP8 state keyed by module name, as tensors and plain values only (``weights_only=True``
  loads it). The model ``state_dict`` is untouched: it keeps the keys and dtypes of the plain model.

Synchronisations: the FP8 layers and the bookkeeping never read a device value on the host. With
an optimizer that accepts the scaler's tensors (``_step_supports_amp_scaling``, e.g.
``torch.optim.AdamW(fused=True)``), a step performs no device-to-host synchronisation; with any
other optimizer, ``GradScaler.step`` reads the inf-check flag once.

Why subclass Lightning's ``MixedPrecision``: Lightning's throughput utilities map a ``MixedPrecision``
plugin to its compute dtype for the FLOPs table; the FP8 plugin is an autocast plugin plus FP8 GEMMs.
All behaviour is defined here, not inherited.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision.amp import MixedPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from lightning_fp8.convert import ConversionReport, convert_to_fp8
from lightning_fp8.distributed import all_reduce_pending_amax, keep_fp8_state_local_under_ddp
from lightning_fp8.linear import fp8_autocast
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.scaling import fp8_state_dict, load_fp8_state_dict, roll_amax_history

log = logging.getLogger(__name__)

COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
PLUGIN_STATE_VERSION = 1


class FP8Precision(MixedPrecision):
    """FP8 training for Lightning Fabric: ``Fabric(plugins=[FP8Precision()])``.

    All arguments are keyword-only and plainly typed so LightningCLI yaml can express them.

    Args:
        recipe: ``"tensorwise"`` (current scaling, default), ``"delayed"`` (amax history, Transformer
            Engine semantics) or ``"rowwise"`` (per-row power-of-two scales). See :mod:`lightning_fp8.recipe`.
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients; default) or ``"e4m3"``.
        amax_history_len: length of each tensor's amax ring buffer (default 16).
        amax_compute_algo: ``"max"`` or ``"most_recent"`` (``delayed`` only).
        margin: ``delayed`` scales are divided by ``2**margin``.
        power_of_2_scale: round every scale down to a power of two.
        compute_dtype: dtype of ``torch.autocast`` around the forward: ``torch.bfloat16`` (default) or
            ``torch.float16``. Parameters and optimizer state stay in their own dtype (float32).
        exclude: glob patterns of fully-qualified module names kept in high precision (e.g. ``["lm_head"]``).
        skip_unaligned: keep layers whose features are not multiples of 16 in high precision (default).
        fp8_eval: run validation, test and predict in FP8 too (default ``True``: the model is evaluated
            with the numerics it is trained with, so validation and training losses are comparable).
            With ``False`` evaluation runs in ``compute_dtype`` only.
        loss_scaling: dynamic loss scaling with ``torch.amp.GradScaler`` (default ``True``). Off, steps
            with non-finite gradients are not skipped.
        init_scale: ``GradScaler`` setting: the initial loss scale (default ``2**16``).
        growth_factor: ``GradScaler`` setting: the scale is multiplied by this after ``growth_interval``
            consecutive steps with finite gradients (default ``2.0``).
        backoff_factor: ``GradScaler`` setting: the scale is multiplied by this when a step is skipped for
            non-finite gradients (default ``0.5``).
        growth_interval: ``GradScaler`` setting: consecutive clean steps before the scale grows (default ``2000``).

    Raises:
        ValueError: for any invalid value, naming the field and the valid values.
    """

    #: Parameters, gradients and optimizer state stay float32; FP8 applies to GEMM operands only.
    #: ``"32-true"`` makes Lightning's model summary report the real parameter memory.
    precision: Literal["32-true"] = "32-true"  # type: ignore[assignment]

    def __init__(
        self,
        *,
        recipe: Literal["tensorwise", "delayed", "rowwise"] = "tensorwise",
        fp8_format: Literal["hybrid", "e4m3"] = "hybrid",
        amax_history_len: int = 16,
        amax_compute_algo: Literal["max", "most_recent"] = "max",
        margin: int = 0,
        power_of_2_scale: bool = False,
        compute_dtype: torch.dtype = torch.bfloat16,
        exclude: list[str] | None = None,
        skip_unaligned: bool = True,
        fp8_eval: bool = True,
        loss_scaling: bool = True,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
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
        self.compute_dtype = compute_dtype
        self.exclude = list(exclude)
        self.skip_unaligned = bool(skip_unaligned)
        self.fp8_eval = bool(fp8_eval)
        self.loss_scaling = bool(loss_scaling)
        self._scaler_kwargs = {
            "init_scale": float(init_scale),
            "growth_factor": float(growth_factor),
            "backoff_factor": float(backoff_factor),
            "growth_interval": growth_interval,
        }
        # Read by Lightning's throughput utilities (FLOPs of the compute dtype).
        self._desired_input_dtype = compute_dtype
        self.scaler: torch.amp.GradScaler | None = None
        self.device: str | None = None
        self.report: ConversionReport | None = None
        self._model: nn.Module | None = None
        self._skipped_steps: Tensor | None = None
        self._pending_state: dict[str, Any] | None = None
        self._announced = False

    # ------------------------------------------------------------------ conversion
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert ``module``'s eligible Linear layers to FP8 in place and return it.

        Raises:
            ValueError: if no layer of the model can run in FP8.
        """
        self._check_strategy(module)
        report = convert_to_fp8(
            module, recipe=self.recipe, exclude=self.exclude, skip_unaligned=self.skip_unaligned, log_summary=False
        )
        if not report.fp8_layers:
            reasons = "; ".join(f"{n or '<root>'}: {why}" for n, why in report.skipped.items()) or "it has no nn.Linear"
            raise ValueError(
                "FP8Precision found no layer that can run in FP8 (" + reasons + "). Refusing to train silently in "
                "high precision: remove the plugin, or adjust `exclude` / `skip_unaligned`."
            )
        keep_fp8_state_local_under_ddp(module)
        self._model = module
        self.report = report
        self._announced = False
        if self._pending_state is not None:
            load_fp8_state_dict(module, self._pending_state)
            self._pending_state = None
        return module

    def _check_strategy(self, module: nn.Module | None) -> None:
        """Refuse sharded modules (FSDP, FSDP2 / DTensor parameters), which this plugin cannot serve yet."""
        if module is None:
            return
        if any(type(p).__name__ == "DTensor" for p in module.parameters()) or any(
            "FullyShardedDataParallel" in type(m).__name__ or type(m).__name__.startswith("FSDP") for m in module.modules()
        ):
            raise ValueError(
                "FP8Precision supports single-device and DDP training; FSDP / FSDP2 (sharded parameters) is not "
                "supported yet."
            )

    def _device(self) -> torch.device:
        assert self._model is not None
        for tensor in self._model.parameters():
            return tensor.device
        return torch.device("cpu")

    def announce(self) -> None:
        """Log, on rank 0 and once per setup, the one line that confirms FP8 is active (Trainer: at
        ``connect``; Fabric: at the first forward, once the model is on its device and wrapped)."""
        if self._announced or self.report is None:
            return
        # Fabric wraps the module for its strategy after convert_module: check the result once here.
        self._check_strategy(self._model)
        self._announced = True
        device = self._device()
        self.report.device = str(device)
        rank_zero_info(f"lightning_fp8: {self.report.summary()}; compute dtype {self.compute_dtype}")

    # ------------------------------------------------------------------ forward
    def forward_context(self) -> AbstractContextManager:
        """``torch.autocast(compute_dtype)`` plus the FP8 region (FP8 off in eval if ``fp8_eval=False``)."""
        if self._model is None:
            return torch.autocast("cpu", dtype=self.compute_dtype, enabled=False)  # not set up yet
        self.announce()
        device = self._device()
        self.device = device.type
        fp8 = self.fp8_eval or self._model.training
        stack = ExitStack()
        stack.enter_context(torch.autocast(device.type, dtype=self.compute_dtype))
        stack.enter_context(fp8_autocast(enabled=fp8, defer_amax_history_roll=True))
        return stack

    # ------------------------------------------------------------------ loss scaling
    def _get_scaler(self, device_type: str) -> torch.amp.GradScaler | None:
        if not self.loss_scaling:
            return None
        if self.scaler is None:
            self.scaler = torch.amp.GradScaler(device_type, **self._scaler_kwargs)
        return self.scaler

    def _scale_loss(self, tensor: Tensor) -> Tensor:
        scaler = self._get_scaler(tensor.device.type)
        return tensor if scaler is None else scaler.scale(tensor)

    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Scale the loss (dynamic loss scaling), then run the backward pass."""
        self._scale_loss(tensor).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale the gradients in place (before clipping or inspecting them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    @staticmethod
    def _check_optimizer(optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, LBFGS):
            raise TypeError(
                "FP8Precision does not support LBFGS or other closure-driven optimizers: dynamic loss scaling must "
                "see the gradients of one backward before the step. Use a first-order optimizer (SGD, Adam, AdamW)."
            )

    def _step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Step (or skip) through the scaler, count skipped steps, update the scale, roll amax histories."""
        scaler = self.scaler
        if scaler is None or scaler._scale is None:  # no loss scaling, or no scaled backward yet
            out = optimizer.step(**kwargs)
        else:
            out = scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
            found_inf = sum(
                v.to(scaler._scale.device, non_blocking=True)
                for v in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
            )
            skipped = (found_inf > 0).to(torch.int64)
            self._skipped_steps = skipped if self._skipped_steps is None else self._skipped_steps + skipped
            scaler.update()
        self.after_optimizer_step()
        return out

    def after_optimizer_step(self) -> None:
        """Reduce the pending amaxes across data-parallel ranks (one collective), then roll every FP8
        layer's amax history once, after the last backward of the window."""
        if self._model is not None:
            all_reduce_pending_amax(self._model)
            roll_amax_history(self._model)

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Fabric: step through the loss scaler (skipping non-finite steps) and do the FP8 bookkeeping."""
        self._check_optimizer(optimizer)
        return self._step(optimizer, **kwargs)

    # ------------------------------------------------------------------ statistics for the callback
    @property
    def loss_scale(self) -> Tensor | None:
        """Current loss scale, on the device (``None`` before the first backward or without loss scaling)."""
        return None if self.scaler is None else self.scaler._scale

    @property
    def skipped_steps(self) -> Tensor | None:
        """Cumulative number of optimizer steps skipped for non-finite gradients, on the device."""
        return self._skipped_steps

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Loss-scaler state, skipped-step count and every layer's FP8 state: tensors and plain values only."""
        state: dict[str, Any] = {"version": PLUGIN_STATE_VERSION, "recipe": self.recipe.to_dict()}
        state["loss_scaler"] = self.scaler.state_dict() if self.scaler is not None else {}
        state["skipped_steps"] = None if self._skipped_steps is None else self._skipped_steps.detach().clone()
        state["fp8"] = fp8_state_dict(self._model) if self._model is not None else None
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved.

        Raises:
            ValueError: if the checkpoint was written with another recipe or FP8 settings.
        """
        if state_dict.get("version") != PLUGIN_STATE_VERSION:
            raise ValueError(f"Unknown FP8Precision checkpoint state version {state_dict.get('version')!r}")
        saved = state_dict["recipe"]
        if saved != self.recipe.to_dict():
            raise ValueError(
                f"The checkpoint was trained with FP8 recipe {saved}, but this FP8Precision is configured with "
                f"{self.recipe.to_dict()}. Resume with the same settings; to switch recipes, load only the model "
                "weights (they do not depend on the recipe) and start a new run."
            )
        if state_dict["loss_scaler"]:
            if not self.loss_scaling:
                raise ValueError("The checkpoint has a loss-scaler state but FP8Precision(loss_scaling=False).")
            device_type = self._device().type if self._model is not None else "cpu"
            self._get_scaler(device_type).load_state_dict(state_dict["loss_scaler"])  # type: ignore[union-attr]
        skipped = state_dict.get("skipped_steps")
        self._skipped_steps = None if skipped is None else skipped.clone()
        fp8 = state_dict.get("fp8")
        if fp8 is not None:
            if self._model is not None:
                load_fp8_state_dict(self._model, fp8)
            else:
                self._pending_state = fp8

    def teardown(self) -> None:
        """Nothing device-side to free; kept for symmetry with Lightning's plugins."""
