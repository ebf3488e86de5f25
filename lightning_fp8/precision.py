"""``FP8Precision`` for the Lightning Trainer: ``Trainer(plugins=[FP8Precision()])``.

A thin subclass of the Fabric plugin (:class:`lightning_fp8.fabric.FP8Precision`), following
Lightning's own pattern (``TransformerEnginePrecision``, ``BitsandbytesPrecision``): the logic lives in
the Fabric class; this class adapts it to the Trainer's hooks (closure-based ``optimizer_step``,
``pre_backward``, gradient clipping, ``on_before_optimizer_step``, strategy checks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision.amp import MixedPrecision
from lightning.pytorch.plugins.precision.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy)


class FP8Precision(MixedPrecision, FabricFP8Precision):
    """FP8 training for the Lightning Trainer, with the arguments and behaviour of the Fabric plugin.

    See :class:`lightning_fp8.fabric.FP8Precision` for every argument.

    Example::

        trainer = Trainer(plugins=[FP8Precision(recipe="delayed")])

    Lightning runs validation, test and predict with ``module.eval()``: FP8 layers then use the
    current scales and record no statistics; ``fp8_eval=False`` evaluates in ``compute_dtype`` instead.
    """

    precision = FabricFP8Precision.precision
    __init__ = FabricFP8Precision.__init__  # one signature, for LightningCLI as well

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Check the strategy, then convert in place (see the Fabric class)."""
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and not isinstance(trainer.strategy, SUPPORTED_STRATEGIES):
            raise ValueError(
                f"FP8Precision does not support the {type(trainer.strategy).__name__} strategy yet. Supported: "
                "single device (strategy='auto') and DDP (strategy='ddp', 'ddp_spawn', 'ddp_notebook')."
            )
        return FabricFP8Precision.convert_module(self, module)

    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        """Called after the model is on its device: reject closure-driven optimizers, log the FP8 line."""
        for optimizer in optimizers:
            self._check_optimizer(optimizer)
        self.announce()
        return super().connect(model, optimizers, lr_schedulers)

    def forward_context(self) -> Any:
        return FabricFP8Precision.forward_context(self)

    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        return Precision.pre_backward(self, self._scale_loss(tensor), module)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward + scaled backward), unscale, call the hooks and clipping, then step
        or skip through the loss scaler and roll the amax histories."""
        self._check_optimizer(optimizer)
        closure_result = closure()
        # Automatic optimization with a training_step that returned None: no backward ran.
        skip_backward = closure_result is None and model.automatic_optimization
        if skip_backward:
            self._after_closure(model, optimizer)
            return closure_result
        # Unscale before on_before_optimizer_step and clipping. Also fine for fused optimizers: the
        # scaler then hands them `found_inf` and no `grad_scale`, still without a host sync.
        self._unscale_once(optimizer)
        self._after_closure(model, optimizer)
        return self._step(optimizer, **kwargs)

    def _unscale_once(self, optimizer: Any) -> None:
        """Unscale ``optimizer``'s gradients unless that already happened since the last scaler update."""
        scaler = self.scaler
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer in manual optimization
        if scaler is None or scaler._scale is None:
            return
        if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            scaler.unscale_(optimizer)

    def clip_gradients(self, optimizer: Optimizer, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Clip unscaled gradients (any optimizer, fused ones included). In manual optimization,
        ``self.clip_gradients`` runs before ``optimizer.step()``: the gradients are unscaled here first."""
        if clip_val:
            self._unscale_once(optimizer)
        kwargs = {} if gradient_clip_algorithm is None else {"gradient_clip_algorithm": gradient_clip_algorithm}
        Precision.clip_gradients(self, optimizer, clip_val=clip_val, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return FabricFP8Precision.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        FabricFP8Precision.load_state_dict(self, state_dict)
