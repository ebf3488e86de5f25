"""Loss scaling for the FP8 plugins: ``torch.amp.GradScaler`` behind one small adapter.

Modes (``FP8Precision(loss_scaling=...)``):

``"auto"`` (default)
    ``"dynamic"`` for ``compute_dtype=torch.float16``, ``"skip_nonfinite"`` for ``torch.bfloat16``.
``"dynamic"`` (``True``)
    Dynamic loss scaling: the loss is multiplied by the scale before backward, the gradients are divided
    by it before clipping and the step, a step with non-finite gradients is skipped and the scale backs off
    (``× backoff_factor``), and it grows (``× growth_factor``) after ``growth_interval`` clean steps.
    float16 needs it (its range is 2**-24 .. 65504); with bfloat16, which has float32's exponent range,
    it buys nothing.
``"skip_nonfinite"``
    No scaling (the gradients are the true gradients at every point, so ``.grad`` read after
    ``backward`` and a direct ``clip_grad_norm_`` see what they expect), but a step whose gradients hold a
    NaN or Inf is still skipped and counted. The scale stays 1.
``"off"`` (``False``)
    No scaler: every step is applied.

Skipped steps are counted on the device. With an optimizer that accepts the scaler's tensors
(``_step_supports_amp_scaling``, e.g. ``torch.optim.AdamW(fused=True)``) a step does no device-to-host
synchronisation; with any other optimizer ``GradScaler.step`` reads the inf-check flag once.

Why an adapter: every access to ``GradScaler`` internals (the scale tensor, the per-optimizer inf checks
and stages) sits in this class, so a change in torch touches one file.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

LossScalingMode = Literal["auto", "dynamic", "skip_nonfinite", "off"]
LOSS_SCALING_MODES: tuple[str, ...] = ("auto", "dynamic", "skip_nonfinite", "off")


def resolve_loss_scaling(mode: LossScalingMode | bool, compute_dtype: torch.dtype) -> str:
    """The effective mode: ``"dynamic"``, ``"skip_nonfinite"`` or ``"off"`` (``True``/``False`` are ``"dynamic"``/``"off"``)."""
    if mode is True:
        return "dynamic"
    if mode is False:
        return "off"
    if mode not in LOSS_SCALING_MODES:
        raise ValueError(f"loss_scaling={mode!r} is not valid; choose one of {list(LOSS_SCALING_MODES)} (or True/False)")
    if mode == "auto":
        return "dynamic" if compute_dtype == torch.float16 else "skip_nonfinite"
    return mode


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class LossScaler:
    """The plugins' loss scaler (see the module docstring for the modes).

    Args:
        mode: ``"dynamic"``, ``"skip_nonfinite"`` or ``"off"`` (already resolved).
        init_scale: ``GradScaler`` setting (``"dynamic"`` only; the other modes keep the scale at 1).
        growth_factor: ``GradScaler`` setting.
        backoff_factor: ``GradScaler`` setting.
        growth_interval: ``GradScaler`` setting.
    """

    def __init__(
        self,
        mode: str,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.mode = mode
        self._settings = {
            "init_scale": float(init_scale) if mode == "dynamic" else 1.0,
            "growth_factor": float(growth_factor),
            "backoff_factor": float(backoff_factor),
            "growth_interval": int(growth_interval),
        }
        self.scaler: torch.amp.GradScaler | None = None
        if mode != "off":
            self.scaler = torch.amp.GradScaler(_default_device_type(), **self._settings)
        self._device = torch.device("cpu")
        self.skipped_steps = torch.zeros((), dtype=torch.int64)
        # Optimizers stepped since the last scaled backward: their gradients are consumed. (A training_step
        # that returned None ran no backward; a second optimizer stepping after the same backward is fine.)
        self._stepped: set[int] | None = None  # None: no scaled backward yet
        # GradScaler.update() runs once per backward, before the next one (or before a checkpoint), so that
        # every optimizer stepping on the gradients of one backward is unscaled with the same scale.
        self._update_pending = False

    # ------------------------------------------------------------------ setup
    def bind(self, device: torch.device) -> None:
        """Follow the model's device (a new GradScaler for another device type keeps the state)."""
        self._device = device
        self.skipped_steps = self.skipped_steps.to(device)
        scaler = self.scaler
        if scaler is not None and scaler._device != device.type:
            state = scaler.state_dict()
            self.scaler = torch.amp.GradScaler(device.type, **self._settings)
            if state:
                self.scaler.load_state_dict(state)

    # ------------------------------------------------------------------ the step
    def scale(self, loss: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(the loss to call backward on, ratio)``: the loss multiplied by the scale (``"dynamic"``), after the
        scale update of the previous steps; ``ratio`` is ``new_scale / old_scale`` of that update (a device
        scalar, ``"dynamic"`` only, else ``None``): amaxes recorded under the old scale must be multiplied by it."""
        if self.scaler is None:
            return loss, None
        ratio = self.update()
        self._stepped = set()
        return self.scaler.scale(loss), ratio

    def update(self) -> Tensor | None:
        """Apply the pending scale update (``GradScaler.update``) of the optimizer steps since the last backward:
        back off if any of them found non-finite gradients, grow after ``growth_interval`` clean ones. Returns
        ``new_scale / old_scale`` in ``"dynamic"`` mode, ``None`` otherwise or when nothing is pending."""
        if not self._update_pending or self.scaler is None:
            return None
        self._update_pending = False
        if self.mode != "dynamic":
            self.scaler.update(new_scale=1.0)  # resets the per-optimizer inf checks; the scale stays 1
            return None
        before = self.scaler._scale.clone()
        self.scaler.update()
        return self.scaler._scale / before

    def _has_fresh_gradients(self, optimizer: Any) -> bool:
        return self._stepped is not None and id(optimizer) not in self._stepped

    def unscale(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the scale and record the inf check, once per step. Does nothing
        when no scaled backward ran since the last step (a ``training_step`` that returned ``None``)."""
        scaler = self.scaler
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if scaler is None or scaler._scale is None or not self._has_fresh_gradients(optimizer):
            return
        if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            scaler.unscale_(optimizer)

    def step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` (or skip it for non-finite gradients) and count a skip; the scale update follows at the
        next backward (:meth:`update`), once for all optimizers stepping on the same gradients."""
        scaler = self.scaler
        inner = getattr(optimizer, "_optimizer", optimizer)
        if scaler is None or scaler._scale is None or not self._has_fresh_gradients(inner):
            return optimizer.step(**kwargs)
        out = scaler.step(optimizer, **kwargs)
        found_inf = sum(
            v.to(scaler._scale.device, non_blocking=True)
            for v in scaler._per_optimizer_states[id(inner)]["found_inf_per_device"].values()
        )
        skipped = (found_inf > 0).to(torch.int64).to(self.skipped_steps.device)
        self.skipped_steps = self.skipped_steps + skipped
        assert self._stepped is not None
        self._stepped.add(id(inner))
        self._update_pending = True
        return out

    # ------------------------------------------------------------------ reading
    @property
    def scale_tensor(self) -> Tensor | None:
        """The current loss scale on the device (1 in ``"skip_nonfinite"`` mode), ``None`` in ``"off"`` mode."""
        if self.scaler is None:
            return None
        if self.scaler._scale is not None:
            return self.scaler._scale
        return torch.full((), float(self.scaler._init_scale), device=self._device)  # before the first backward

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"mode", "scaler" (GradScaler state, {} when off), "skipped_steps"}``: plain values and tensors.
        Apply a pending update first (:meth:`update`; the caller rescales with its ratio)."""
        if self._update_pending:
            raise RuntimeError("LossScaler.state_dict() with a scale update pending: call update() first")
        return {
            "mode": self.mode,
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "skipped_steps": self.skipped_steps.detach().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> tuple[str | None, float | None]:
        """Restore :meth:`state_dict`; whatever the step in progress had pending is dropped (an in-place reload).

        Returns ``(warning, ratio)``. When the saved mode differs, a scale saved in one mode means nothing in
        another: the scaler starts fresh, ``warning`` says so, and ``ratio`` is ``new scale / saved scale``, by
        which amaxes recorded under the saved scale (the grad_output histories) must be multiplied.
        """
        self.skipped_steps = state["skipped_steps"].detach().clone().to(self.skipped_steps.device)
        self._update_pending, self._stepped = False, None
        if self.scaler is not None:  # fresh per-optimizer stages and inf checks, as after GradScaler.update()
            self.scaler._per_optimizer_states.clear()
        saved_mode = state.get("mode")
        if saved_mode != self.mode:
            saved_scale = float(state["scaler"]["scale"]) if state["scaler"] else 1.0
            if self.scaler is not None:
                self.scaler = torch.amp.GradScaler(self.scaler._device, **self._settings)
            new_scale = self._settings["init_scale"] if self.scaler is not None else 1.0
            warning = (
                f"the checkpoint's loss scaling mode is {saved_mode!r} but this FP8Precision uses {self.mode!r}: the "
                f"loss scaler starts fresh (scale {new_scale:g}; the checkpoint's was {saved_scale:g}, and the gradient "
                "amax histories are rescaled to match)"
            )
            return warning, new_scale / saved_scale
        if self.scaler is not None and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        return None, None
