"""``FP8Precision`` for the Lightning Trainer: ``Trainer(plugins=[FP8Precision()])``.

The logic lives in :class:`lightning_fp8.fabric.FP8PrecisionBase`; this class adds only the Trainer's
hooks, as Lightning's ``TransformerEnginePrecision(Precision, FabricTEPrecision)`` does: the loss scaling
around the closure-based ``optimizer_step``, ``pre_backward``, gradient clipping on unscaled gradients, and
the strategy and optimizer checks. Batches reach ``training_step`` untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision.half import HalfPrecision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fp8.fabric import FP8PrecisionBase

SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy)


class FP8Precision(FP8PrecisionBase, HalfPrecision):
    """FP8 training for the Lightning Trainer, with the arguments of :class:`lightning_fp8.fabric.FP8PrecisionBase`.

    Example::

        trainer = Trainer(plugins=[FP8Precision(recipe="delayed")])

    Lightning runs validation, test and predict with ``module.eval()``: FP8 layers then use the
    current scales and record no statistics; ``fp8_eval=False`` evaluates in ``compute_dtype`` instead.
    (``HalfPrecision`` is a base class only so that Lightning's throughput utilities read the right
    peak FLOPs; see :class:`lightning_fp8.fabric.FP8PrecisionBase`.)
    """

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Check the strategy, then convert in place (see the base class).

        A Trainer trains one model: a plugin reused for another model (a notebook cell run again) forgets the
        models of earlier fits, so that their state is not checkpointed, rolled or logged with the new one's.
        """
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and not isinstance(trainer.strategy, SUPPORTED_STRATEGIES):
            raise ValueError(
                f"FP8Precision does not support the {type(trainer.strategy).__name__} strategy yet. Supported: "
                "single device (strategy='auto') and DDP (strategy='ddp', 'ddp_spawn', 'ddp_notebook')."
            )
        if not any(m is module for m in self.fp8_models) and not any(m is module for m, _ in self._plain_models):
            self._forget_models()
        return super().convert_module(module)

    @override
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        """Called after the model is on its device: reject closure-driven optimizers, log the FP8 line."""
        for optimizer in optimizers:
            self._check_optimizer(optimizer)
        self.announce()
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        """Scale the loss (``"dynamic"`` loss scaling) before Lightning's backward hooks and the backward."""
        return super().pre_backward(self._scale_loss(tensor), module)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward + backward), unscale, call the hooks and clipping, then step or skip through the
        loss scaler and do the FP8 bookkeeping."""
        self._check_optimizer(optimizer)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward ran. The hooks and clipping run as under Lightning's
            # 16-mixed; nothing is unscaled and no step is taken.
            self._after_closure(model, optimizer)
            return closure_result
        # Unscale before on_before_optimizer_step and clipping. Also fine for fused optimizers: the scaler then
        # hands them `found_inf` and no `grad_scale`, still without a host sync.
        self.loss_scaler.unscale(optimizer)
        self._after_closure(model, optimizer)
        return self._step(optimizer, **kwargs)

    @override
    def clip_gradients(self, optimizer: Optimizer, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Clip unscaled gradients (any optimizer, fused ones included). In manual optimization ``self.clip_gradients``
        runs before ``optimizer.step()``: the gradients are unscaled here first."""
        if clip_val:
            self.loss_scaler.unscale(optimizer)
        kwargs = {} if gradient_clip_algorithm is None else {"gradient_clip_algorithm": gradient_clip_algorithm}
        super().clip_gradients(optimizer, clip_val=clip_val, **kwargs)
