"""``FP8Precision`` for the Lightning Trainer: ``Trainer(plugins=[FP8Precision()])``.

The logic lives in :class:`lightning_fp8.fabric.FP8PrecisionBase`; this class adds only the Trainer's
hooks, as Lightning's ``TransformerEnginePrecision(Precision, FabricTEPrecision)`` does: the loss scaling
around the closure-based ``optimizer_step``, ``pre_backward``, gradient clipping on unscaled gradients, and
the strategy and optimizer checks. Batches reach ``training_step`` untouched. With ``calibration_batches``, it also
adds a small callback that calibrates the ``delayed`` amax histories at ``on_train_start`` (the Trainer gives
precision plugins no hook between the checkpoint restore and the first batch).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision.half import HalfPrecision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fp8.calibration import _loss_tensor, calibrate_with, first_training_batches, muted_logging
from lightning_fp8.fabric import FP8PrecisionBase, warn_if_retained_graph_under_compile
from lightning_fp8.linear import weights_may_have_changed
from lightning_fp8.state import state_tables

SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)


class _CalibrateBeforeTraining(Callback):
    """Added by ``FP8Precision(calibration_batches=N)``: calibrates at ``on_train_start``
    (:meth:`FP8Precision.calibrate_before_training`). It holds no state of its own (nothing in checkpoints)."""

    def __init__(self, plugin: FP8Precision) -> None:
        self.plugin = plugin

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.precision_plugin is self.plugin:
            self.plugin.calibrate_before_training(trainer, pl_module)


class FP8Precision(FP8PrecisionBase, HalfPrecision):
    """FP8 training for the Lightning Trainer, with the arguments of :class:`lightning_fp8.fabric.FP8PrecisionBase`.

    Example::

        trainer = Trainer(plugins=[FP8Precision(recipe="delayed")])

    Lightning runs validation, test and predict with ``module.eval()``: FP8 layers then use the
    current scales and record no statistics; ``fp8_eval=False`` evaluates in ``compute_dtype`` instead.
    (``HalfPrecision`` is a base class only so that Lightning's throughput utilities read the right
    peak FLOPs; see :class:`lightning_fp8.fabric.FP8PrecisionBase`.)
    """

    def _step_phase(self, training: bool) -> None:
        """Entering a training step after an evaluation step, or the other way round: the weights may have been
        swapped through ``.data`` in between (Lightning's ``WeightAveraging`` swaps the averaged weights in around
        validation, moving no version counter), so the FP8 weight casts kept for reuse are made stale
        (:func:`~lightning_fp8.weights_may_have_changed`). Evaluation forwards without gradients keep none anyway;
        this covers an evaluation step that enables them."""
        if getattr(self, "_training_phase", None) != training:
            self._training_phase = training
            weights_may_have_changed()

    @override
    def train_step_context(self) -> AbstractContextManager:
        self._step_phase(True)
        return super().train_step_context()

    @override
    def val_step_context(self) -> AbstractContextManager:
        self._step_phase(False)
        return super().val_step_context()

    @override
    def test_step_context(self) -> AbstractContextManager:
        self._step_phase(False)
        return super().test_step_context()

    @override
    def predict_step_context(self) -> AbstractContextManager:
        self._step_phase(False)
        return super().predict_step_context()

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Check the strategy, then convert in place (see the base class).

        A Trainer trains one model: a plugin reused for another model (a notebook cell run again) forgets the
        models of earlier fits, so that their state is not checkpointed, rolled or logged with the new one's.
        """
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and not isinstance(trainer.strategy, SUPPORTED_STRATEGIES):
            raise ValueError(
                f"FP8Precision does not support the {type(trainer.strategy).__name__} strategy. Supported: "
                "single device (strategy='auto'), DDP (strategy='ddp', 'ddp_spawn', 'ddp_notebook') and FSDP2 / tensor "
                "parallelism through ModelParallelStrategy (see lightning_fp8.prepare_for_sharding)."
            )
        if not any(m is module for m in self.fp8_models) and not any(m is module for m, _ in self._plain_models):
            self._forget_models()
        return super().convert_module(module)

    _calibrates_before_training = True

    @override
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        """Called after the model is on its device: reject closure-driven optimizers, log the FP8 line; with
        ``calibration_batches``, add the callback that calibrates at the start of training."""
        for optimizer in optimizers:
            self._check_optimizer(optimizer)
        self.announce()
        if self.calibration_batches:
            self._add_calibration_callback()
        return super().connect(model, optimizers, lr_schedulers)

    def _add_calibration_callback(self) -> None:
        """The Trainer's precision plugins have no hook between the checkpoint restore and the first training batch:
        a callback's ``on_train_start`` is that point (after the restore, with the training dataloader set up), so the
        plugin adds one (:class:`_CalibrateBeforeTraining`), once per Trainer."""
        module = next((m for m in self.fp8_models if isinstance(m, pl.LightningModule)), None)
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            return
        if not module.automatic_optimization:
            raise ValueError(
                f"FP8Precision(calibration_batches={self.calibration_batches}) runs training_step for the loss, which "
                "needs automatic optimization; with manual optimization set calibration_batches=0 and call "
                "lightning_fp8.calibrate(model, batches, loss_fn) in on_train_start"
            )
        if not any(isinstance(c, _CalibrateBeforeTraining) and c.plugin is self for c in trainer.callbacks):
            trainer.callbacks.append(_CalibrateBeforeTraining(self))

    def calibrate_before_training(self, trainer: pl.Trainer, module: pl.LightningModule) -> int:
        """Calibrate the ``delayed`` amax histories on the first ``calibration_batches`` batches of the training
        dataloader (called at ``on_train_start``). Returns the number of batches used (0 when skipped).

        The batches come from a pass over the training dataloader that leaves the random state and the loaders'
        generators as they were (``lightning_fp8.calibration.first_training_batches``; with a shuffling sampler
        that pass draws its own order). Each batch is moved to the device as for training (``batch_to_device``: the
        module's transfer hooks) and runs
        ``training_step(batch, batch_idx)`` inside :meth:`~lightning_fp8.fabric.FP8PrecisionBase.forward_context` with ``self.log`` muted; the returned loss
        (divided by ``accumulate_grad_batches``, as Lightning divides it for training) is backpropagated through ``torch.autograd.grad`` (no ``.grad``, no optimizer step, no DDP gradient
        reduction). Every DDP rank calibrates on its own batches; the amaxes are MAX-reduced as in training.
        Skipped, with an info line, when some history already holds an amax: the state was restored from a
        checkpoint (or an earlier fit trained this model), and calibration must not overwrite it.
        """
        tables = [t for t in state_tables(module) if t.recipe.name == "delayed"]
        if not self.calibration_batches or not tables:
            return 0
        if any(bool(t.initialized.any()) for t in tables):  # one host read per table, before training
            rank_zero_info(
                "lightning_fp8: calibration skipped: the amax histories already hold measured amaxes (restored from a "
                "checkpoint, or trained by an earlier fit)"
            )
            return 0
        if trainer.train_dataloader is None:
            return 0

        def step(m: nn.Module, batch: Any, index: int) -> Any:
            with muted_logging(m):
                output = m.training_step(batch, index)
            if output is None or trainer.accumulate_grad_batches == 1:
                return output
            # Lightning backpropagates training_step's loss / accumulate_grad_batches: the grad_output amaxes must be
            # recorded in that domain, as training records them.
            return _loss_tensor(output) / trainer.accumulate_grad_batches

        with first_training_batches(trainer, self.calibration_batches) as batches:
            used = calibrate_with(
                module, batches, step, backward=True, num_batches=self.calibration_batches, precision=self
            )
        rank_zero_info(f"lightning_fp8: calibrated the delayed amax histories on {used} training batch(es) per rank")
        return used

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        """Scale the loss (``"dynamic"`` loss scaling) before Lightning's backward hooks and the backward."""
        return super().pre_backward(self._scale_loss(tensor), module)

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Optimizable | None, *args: Any, **kwargs: Any
    ) -> None:
        """Lightning's backward, warning once where a retained graph of a compiled model is at risk
        (see the troubleshooting page, 'A second backward over a retained graph')."""
        warn_if_retained_graph_under_compile(self, args, kwargs)
        super().backward(tensor, model, optimizer, *args, **kwargs)

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
