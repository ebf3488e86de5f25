"""What every FP8 layer shares: a row in an FP8 state table, its per-layer views, and following the device.

An FP8 layer (:class:`~lightning_fp8.FP8Linear`, and any layer type registered with
:func:`~lightning_fp8.convert.register_fp8_module`) derives from :class:`FP8Module`. It holds an
:class:`~lightning_fp8.state.FP8StateRef` (the table and its row); a layer built on its own starts with a
private table of one row, and :func:`~lightning_fp8.convert_to_fp8` (or the precision plugin) binds all
layers of a model into one table per recipe.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_fp8.recipe import FP8Recipe, resolve_recipe
from lightning_fp8.region import ForwardDecision
from lightning_fp8.state import FP8StateRef, FP8StateTable


class FP8Module(nn.Module):
    """Mixin for FP8 layers (see the module docstring). Defines no ``__init__``: call :meth:`init_fp8_state`."""

    fp8_state: FP8StateRef
    _fp8_decision: ForwardDecision | None
    #: FP8 weight casts kept for reuse within an optimizer step, by cast spec (see ``FP8Linear``).
    _fp8_weight_casts: dict[Any, Any]

    def init_fp8_state(self, recipe: FP8Recipe | str | None, device: torch.device | str | None) -> None:
        """Give the layer fresh FP8 state: a private table of one row on ``device``."""
        self.fp8_state = FP8StateRef(FP8StateTable(resolve_recipe(recipe), 1, device), 0)
        self._fp8_decision = None
        self._fp8_weight_casts = {}

    def __getstate__(self) -> dict[str, Any]:
        # the kept weight casts are transient (and hold weak references, which do not pickle): a pickled or saved
        # layer starts without them
        state = dict(super().__getstate__())
        state.pop("_fp8_weight_casts", None)
        state.pop("_fp8_weight_records", None)
        return state

    def remove_fp8_state(self) -> None:
        """Forget the FP8 state (used when turning the layer back into its high-precision original)."""
        self.__dict__.pop("fp8_state", None)
        self.__dict__.pop("_fp8_decision", None)
        self.__dict__.pop("_fp8_weight_casts", None)

    @property
    def fp8_recipe(self) -> FP8Recipe:
        """The layer's recipe. Assigning one gives the layer fresh FP8 state in a private table."""
        return self.fp8_state.table.recipe

    @fp8_recipe.setter
    def fp8_recipe(self, recipe: FP8Recipe | str) -> None:
        self.init_fp8_state(recipe, self.fp8_state.table.device)

    def _row(self, tensor: Tensor) -> Tensor:
        return tensor[self.fp8_state.index]

    # The layer's row of its state table (the names of lightning-fp8 0.1's buffers). ``fp8_amax_history``,
    # ``fp8_initialized`` and ``fp8_counts_epoch`` are live views; the others are copies (the table keeps one
    # tensor per role for them, see lightning_fp8.state).
    @property
    def fp8_scale(self) -> Tensor:
        """``(3,)`` copy: the scale of input, weight and grad_output (see :mod:`lightning_fp8.state`)."""
        return self._row(self.fp8_state.table.scale)

    @property
    def fp8_amax_history(self) -> Tensor:
        """``(3, amax_history_len)`` view: the amax ring buffers, index 0 the most recent."""
        return self._row(self.fp8_state.table.amax_history)

    @property
    def fp8_amax_pending(self) -> Tensor:
        """``(3,)`` copy: the amaxes recorded since the last roll."""
        return self._row(self.fp8_state.table.amax_pending)

    @property
    def fp8_counts(self) -> Tensor:
        """``(3, 4)`` copy: cumulative seen, nonzero, overflow, underflow element counts (this rank)."""
        return self._row(self.fp8_state.table.counts)

    @property
    def fp8_initialized(self) -> Tensor:
        """``(3,)`` view: whether each ``delayed`` history holds a usable amax.

        The forward's input and weight casts read a copy made at each roll (``FP8StateTable.forward_ready``), so a
        write through this view reaches them at the next roll (the grad_output casts at once); to change state
        between rolls, write rows with :func:`~lightning_fp8.load_fp8_state_dict`."""
        return self._row(self.fp8_state.table.initialized)

    def _apply(self, fn: Any, recurse: bool = True) -> FP8Module:
        # The state table follows the layer's device, never its dtype (``module.half()`` must not turn a scale
        # into float16); shared tables move once, on the first of their layers.
        super()._apply(fn, recurse)
        self.fp8_state.table.follow(fn)
        self.fp8_state.follow_table()
        self.drop_weight_casts()  # a new dtype or device may keep the storage and version of the weight
        return self

    def train(self, mode: bool = True) -> FP8Module:
        if mode != self.training:
            self.drop_weight_casts()  # weight-averaging callbacks swap weights through .data around evaluation
        return super().train(mode)

    def drop_weight_casts(self) -> None:
        """Forget the FP8 weight casts kept for reuse within an optimizer step (see ``FP8Linear``)."""
        self.__dict__["_fp8_weight_casts"] = {}

    def _check_state_device(self, device: torch.device) -> None:
        table_device = self.fp8_state.table.device
        if table_device != device:
            raise RuntimeError(
                f"The FP8 state of this layer is on {table_device} but its input is on {device}. The layers of a "
                "model share one state table: move the whole model (model.to(device)), not single layers."
            )
