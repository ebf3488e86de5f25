"""FP8Linear: a drop-in ``nn.Linear`` whose three GEMMs run in FP8 inside :func:`fp8_autocast`.

::

    output      = x · Wᵀ          x: E4M3, W: E4M3
    grad_input  = grad_out · W     grad_out: E5M2 (hybrid) or E4M3
    grad_weight = grad_outᵀ · x

Each of ``x``, ``W`` and ``grad_out`` is quantized once per use (``tensorwise``/``delayed``: once in
all; ``rowwise``: once per GEMM, along the GEMM's reduction dimension). For ``tensorwise`` and
``delayed`` only the FP8 copies of ``x`` and ``W`` and their scales are saved for backward, about half
the bytes that ``nn.Linear`` under bf16 autocast keeps (torchao keeps the high-precision input);
``rowwise`` saves ``x`` in the compute dtype, as ``nn.Linear`` does.

Outside :func:`fp8_autocast` (and for an empty batch) the layer is exactly ``nn.Linear``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fp8.cast import quantize_rowwise, quantize_tensorwise
from lightning_fp8.gemm import fp8_mm
from lightning_fp8.recipe import E4M3, E5M2, GRAD_OUTPUT, INPUT, WEIGHT, FP8Recipe, resolve_recipe
from lightning_fp8.scaling import STATE_BUFFERS, FP8State, init_state, state_of

_GEMM_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _AutocastState:
    enabled: bool = False
    defer_amax_history_roll: bool = False


_AUTOCAST = _AutocastState()


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, *, defer_amax_history_roll: bool = False) -> Iterator[None]:
    """Region in which :class:`FP8Linear` layers compute in FP8. Nestable; restores the outer state.

    Args:
        enabled: ``False`` makes FP8Linear layers behave exactly like ``nn.Linear`` inside the region.
        defer_amax_history_roll: leave the amaxes recorded inside the region pending until
            :func:`lightning_fp8.roll_amax_history` is called (the precision plugin does this once per
            optimizer step so that all micro-batches of an accumulation window share one scale).
            By default every cast rolls its tensor's history immediately.

    The backward pass may run outside the region: each layer decides at forward time.
    """
    previous = (_AUTOCAST.enabled, _AUTOCAST.defer_amax_history_roll)
    _AUTOCAST.enabled, _AUTOCAST.defer_amax_history_roll = bool(enabled), bool(defer_amax_history_roll)
    try:
        yield
    finally:
        _AUTOCAST.enabled, _AUTOCAST.defer_amax_history_roll = previous


def is_fp8_autocast_enabled() -> bool:
    """Whether the current code runs inside an enabled :func:`fp8_autocast` region."""
    return _AUTOCAST.enabled


def _in_backward() -> bool:
    # A forward running while the autograd engine executes a graph is an activation-checkpointing
    # recomputation: it must reuse the scales of the original forward and not record statistics twice.
    # Under torch.compile the recomputation happens inside the compiled backward graph, which never
    # runs the forward's state updates, so there is nothing to detect.
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def _in_inference_mode() -> bool:
    # Inference never moves the FP8 state, even in training mode. (Dynamo cannot trace this query; a
    # compiled graph follows ``module.training`` alone.)
    if torch.compiler.is_compiling():
        return False
    return torch.is_inference_mode_enabled()


def _gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in _GEMM_OUT_DTYPES else torch.float32


def _column_major(x: Tensor) -> Tensor:
    """Same shape and values, column-major storage."""
    return x.t().contiguous().t()


class _TensorwiseFn(torch.autograd.Function):
    """The three GEMMs for ``tensorwise`` and ``delayed``; ``x`` and ``W`` arrive already quantized."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x2d: Tensor,
        weight: Tensor,
        x_fp8: Tensor,
        x_scale: Tensor,
        w_fp8: Tensor,
        w_scale: Tensor,
        state: FP8State,
        recipe: FP8Recipe,
        update: bool,
        roll: bool,
        out_dtype: torch.dtype,
    ) -> Tensor:
        out = fp8_mm(x_fp8, w_fp8.t(), x_scale, w_scale, _gemm_dtype(out_dtype), use_fast_accum=True)
        # Save only what the needed gradients use: x for grad_weight, W for grad_input.
        need_input_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(
            x_fp8 if need_weight_grad else None, x_scale, w_fp8 if need_input_grad else None, w_scale
        )
        ctx.state, ctx.recipe, ctx.update, ctx.roll = state, recipe, update, roll
        ctx.x_dtype, ctx.w_dtype = x2d.dtype, weight.dtype
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x_fp8, x_scale, w_fp8, w_scale = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        go_fp8, go_scale = quantize_tensorwise(grad_out, ctx.state, ctx.recipe, GRAD_OUTPUT, ctx.update, ctx.roll)
        gemm_dtype = _gemm_dtype(grad_out.dtype)
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = fp8_mm(go_fp8, _column_major(w_fp8), go_scale, w_scale, gemm_dtype).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = fp8_mm(go_fp8.t().contiguous(), _column_major(x_fp8), go_scale, x_scale, gemm_dtype)
            grad_weight = grad_weight.to(ctx.w_dtype)
        return (grad_input, grad_weight) + (None,) * 9


class _RowwiseFn(torch.autograd.Function):
    """The three GEMMs for ``rowwise``: every operand scaled along its GEMM's reduction dimension."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x2d: Tensor,
        weight: Tensor,
        state: FP8State,
        recipe: FP8Recipe,
        update: bool,
        roll: bool,
        out_dtype: torch.dtype,
        update_forward: bool,
    ) -> Tensor:
        record = state if update_forward else None
        x_fp8, x_scale = quantize_rowwise(x2d, -1, E4M3, record, recipe, INPUT, roll)
        w_fp8, w_scale = quantize_rowwise(weight, -1, E4M3, record, recipe, WEIGHT, roll)
        out = fp8_mm(x_fp8, w_fp8.t(), x_scale, w_scale.t().contiguous(), torch.bfloat16, use_fast_accum=True)
        ctx.save_for_backward(x2d if ctx.needs_input_grad[1] else None, weight)
        ctx.x_dtype = x2d.dtype
        ctx.state, ctx.recipe, ctx.update, ctx.roll = state, recipe, update, roll
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x2d, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        record = ctx.state if ctx.update else None
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            go_fp8, go_scale = quantize_rowwise(grad_out, -1, E4M3, record, ctx.recipe, GRAD_OUTPUT, ctx.roll)
            w_fp8, w_scale = quantize_rowwise(weight, 0, E4M3)
            grad_input = fp8_mm(go_fp8, _column_major(w_fp8), go_scale, w_scale, torch.bfloat16).to(ctx.x_dtype)
            record = None
        if ctx.needs_input_grad[1]:
            go_fp8, go_scale = quantize_rowwise(grad_out, 0, E4M3, record, ctx.recipe, GRAD_OUTPUT, ctx.roll)
            x_fp8, x_scale = quantize_rowwise(x2d, 0, E4M3)
            grad_weight = fp8_mm(
                go_fp8.t().contiguous(), _column_major(x_fp8), go_scale.t().contiguous(), x_scale, torch.bfloat16
            ).to(weight.dtype)
        return (grad_input, grad_weight) + (None,) * 6


def _check_input(x: Tensor) -> None:
    if x.dtype in (E4M3, E5M2):
        raise TypeError(
            f"FP8Linear expects a high-precision floating-point input, got {x.dtype}: "
            "the layer quantizes its input itself; pass the unquantized tensor."
        )
    if not x.is_floating_point():
        raise TypeError(f"FP8Linear expects a floating-point input, got {x.dtype}")


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs run in FP8 inside :func:`fp8_autocast`.

    A subclass of ``nn.Linear`` with exactly its parameters and ``state_dict`` keys. The FP8 scaling
    state (scales, amax ring buffers, overflow/underflow counters; see :mod:`lightning_fp8.scaling`)
    lives in non-persistent buffers on the layer's device and is exported with
    :func:`lightning_fp8.fp8_state_dict`.

    Usually created by :func:`lightning_fp8.convert_to_fp8`, which turns existing ``nn.Linear``
    layers into FP8Linear in place (same object, same Parameters).

    Args:
        in_features: size of each input sample, as for ``nn.Linear``.
        out_features: size of each output sample, as for ``nn.Linear``.
        bias: learn an additive bias, as for ``nn.Linear``.
        device: device of the parameters (and of the FP8 state), as for ``nn.Linear``.
        dtype: dtype of the parameters, as for ``nn.Linear`` (the FP8 state keeps its own dtypes).
        recipe: an :class:`~lightning_fp8.FP8Recipe` or a recipe name (default ``"tensorwise"``).

    Statistics and (in standalone use) amax histories are updated only in training mode
    (``module.training``) and never under ``torch.inference_mode()``; evaluation casts use the
    current scales and leave the state untouched, so validation never shifts a ``delayed`` scale.
    An activation-checkpointing recomputation does not record statistics a second time.
    """

    fp8_recipe: FP8Recipe

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: FP8Recipe | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8_recipe = resolve_recipe(recipe)
        init_state(self, self.fp8_recipe, device=self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe | str | None = None) -> FP8Linear:
        """Turn ``linear`` into an FP8Linear *in place* (its class changes; Parameters, hooks and
        references stay) and return it."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"from_linear expects a plain torch.nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        linear.fp8_recipe = resolve_recipe(recipe)
        init_state(linear, linear.fp8_recipe, device=linear.weight.device)
        return linear  # type: ignore[return-value]

    def forward(self, input: Tensor) -> Tensor:
        enabled = _AUTOCAST.enabled
        recomputing = _in_backward()  # always False under torch.compile
        if recomputing:
            # An activation-checkpointing recomputation runs in the backward pass, usually outside the
            # region: it must take the path of the original forward (or autograd sees other tensors).
            enabled = getattr(self, "_fp8_forward_enabled", enabled)
        elif not torch.compiler.is_compiling():
            self._fp8_forward_enabled = enabled
        if not enabled:
            return F.linear(input, self.weight, self.bias)
        _check_input(input)
        if input.numel() == 0:
            return F.linear(input, self.weight, self.bias)  # nothing to quantize; same result and grads
        device_type = input.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
        x2d = input.reshape(-1, self.in_features).contiguous()
        # ``update`` is what this forward's backward records (grad_output); the forward's own casts are
        # not recorded again in a recomputation. With reentrant checkpointing the original forward runs
        # without a graph, so the recomputation's backward is the only one that records grad_output.
        update = self.training and not _in_inference_mode()
        update_forward = update and not recomputing
        roll = not _AUTOCAST.defer_amax_history_roll
        state, recipe = state_of(self), self.fp8_recipe
        if recipe.name == "rowwise":
            if torch.is_autocast_enabled(device_type):
                x2d = x2d.to(out_dtype)  # what nn.Linear under autocast saves, not the fp32 input
            out = _RowwiseFn.apply(x2d, self.weight, state, recipe, update, roll, out_dtype, update_forward)
        else:
            x_fp8, x_scale = quantize_tensorwise(x2d, state, recipe, INPUT, update_forward, roll)
            w_fp8, w_scale = quantize_tensorwise(self.weight, state, recipe, WEIGHT, update_forward, roll)
            out = _TensorwiseFn.apply(
                x2d, self.weight, x_fp8, x_scale, w_fp8, w_scale, state, recipe, update, roll, out_dtype
            )
        out = out.reshape(*input.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def _apply(self, fn: Any, recurse: bool = True) -> FP8Linear:
        # The FP8 state keeps its dtypes (float32 scales and amaxes, int64 counters) and follows only the
        # device: ``module.to(torch.bfloat16)``, ``.half()`` or ``.double()`` cast the parameters, not the
        # state (a bf16 scale is not the recipe's scale; a float64 one breaks the GEMM contract).
        state = {name: self._buffers.pop(name) for name in STATE_BUFFERS if name in self._buffers}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buf in state.items():
                moved = fn(buf)
                self._buffers[name] = moved if moved.dtype == buf.dtype else buf.to(device=moved.device)
            moved_from_meta = any(buf.is_meta for buf in state.values()) and not self.fp8_scale.is_meta
            if moved_from_meta:  # e.g. to_empty() after building on the meta device: the values are garbage
                init_state(self, self.fp8_recipe, device=self.fp8_scale.device)
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.fp8_recipe.name}, fp8_format={self.fp8_recipe.fp8_format}"
