"""Per-layer FP8 scaling state, kept on the layer's device and updated with tensor ops only.

Every FP8 layer owns, for each of its three quantized tensors (``input``, ``weight``,
``grad_output``; see :data:`lightning_fp8.recipe.ROLES`), stacked along the first dimension:

==================  ===========  =====================================================================
buffer              shape        meaning
==================  ===========  =====================================================================
``fp8_scale``       ``(3,)``     scale used by the most recent cast (``fp8 = x * scale``); for
                                 ``rowwise`` the smallest row scale
``fp8_amax_history````(3, L)``   ring buffer of the last ``L`` amaxes, index 0 the most recent
``fp8_amax_pending````(3,)``     running max of the amaxes seen since the last roll (max over the
                                 micro-batches of an accumulation window)
``fp8_counts``      ``(3, 4)``   cumulative ``seen``, ``nonzero``, ``overflow``, ``underflow``
                                 element counts (int64)
``fp8_initialized`` ``(3,)``     ``delayed`` only: the history holds a usable amax
==================  ===========  =====================================================================

They are *non-persistent* buffers: they follow ``module.to(device)`` but are not part of the
module ``state_dict``, so a checkpoint of a converted model loads into the plain model. The state
travels through :func:`fp8_state_dict` / :func:`load_fp8_state_dict` instead, as tensors and plain
values only (loadable with ``torch.load(weights_only=True)``).

No function here reads a tensor value on the host: no ``.item()``, no Python branch on data.

Why our own state instead of torchao's: torchao keeps no statistics at all and removed delayed
scaling; Transformer Engine keeps its state in a pickled ``_extra_state`` blob inside the module
``state_dict``. Neither gives a plain, device-resident, checkpoint-safe record of every cast.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_fp8.recipe import FP8_MAX, ROLES, FP8Recipe, amax_to_scale

#: Columns of ``fp8_counts``.
COUNT_FIELDS: tuple[str, ...] = ("seen", "nonzero", "overflow", "underflow")
SEEN, NONZERO, OVERFLOW, UNDERFLOW = 0, 1, 2, 3

STATE_BUFFERS: tuple[str, ...] = (
    "fp8_scale",
    "fp8_amax_history",
    "fp8_amax_pending",
    "fp8_counts",
    "fp8_initialized",
)
STATE_FORMAT_VERSION = 1


class FP8State(NamedTuple):
    """Views of one layer's state buffers (see the table above), passed to the cast functions."""

    scale: torch.Tensor
    amax_history: torch.Tensor
    amax_pending: torch.Tensor
    counts: torch.Tensor
    initialized: torch.Tensor


def state_of(module: nn.Module) -> FP8State:
    """The :class:`FP8State` of a module that carries FP8 buffers."""
    return FP8State(*(getattr(module, name) for name in STATE_BUFFERS))


def init_state(module: nn.Module, recipe: FP8Recipe, device: torch.device | None = None) -> None:
    """Register fresh FP8 state buffers on ``module`` (non-persistent)."""
    n, length = len(ROLES), recipe.amax_history_len
    kw: dict[str, Any] = {"device": device}
    module.register_buffer("fp8_scale", torch.ones(n, dtype=torch.float32, **kw), persistent=False)
    module.register_buffer("fp8_amax_history", torch.zeros(n, length, dtype=torch.float32, **kw), persistent=False)
    module.register_buffer("fp8_amax_pending", torch.zeros(n, dtype=torch.float32, **kw), persistent=False)
    module.register_buffer("fp8_counts", torch.zeros(n, len(COUNT_FIELDS), dtype=torch.int64, **kw), persistent=False)
    module.register_buffer("fp8_initialized", torch.zeros(n, dtype=torch.bool, **kw), persistent=False)


def remove_state(module: nn.Module) -> None:
    """Delete the FP8 state buffers from ``module``."""
    for name in STATE_BUFFERS:
        module._buffers.pop(name, None)


@torch.no_grad()
def record_cast(
    state: FP8State,
    recipe: FP8Recipe,
    role: int,
    amax: torch.Tensor,
    scale: torch.Tensor,
    seen: int,
    counts: torch.Tensor,
    roll: bool,
) -> None:
    """Record one cast of tensor ``role``: used scale, amax, ``seen`` and ``[nonzero, overflow, underflow]``.

    ``amax`` is combined (max, NaN-propagating) into the pending amax; with ``roll=True`` the
    history rolls right away (standalone use), otherwise it waits for :func:`roll_amax_history`
    (the precision plugin rolls once per optimizer step).
    """
    state.scale[role].copy_(scale)
    state.amax_pending[role].copy_(torch.maximum(state.amax_pending[role], amax.float()))
    state.counts[role, SEEN].add_(seen)
    state.counts[role, NONZERO:].add_(counts)
    if roll:
        roll_role(state, recipe, role)


def roll_role(state: FP8State, recipe: FP8Recipe, role: int) -> None:
    """Push the pending amax of ``role`` into its history (if one was recorded); for ``delayed``, derive the next scale."""
    history = state.amax_history[role]
    pending = state.amax_pending[role]
    # Nothing recorded since the last roll (the layer did not run, or a second optimizer stepped in
    # the same training step): the history stays as it is. A NaN pending amax is recorded.
    recorded = pending != 0
    history.copy_(torch.where(recorded, torch.cat([pending.view(1), history[:-1]]), history))
    pending.zero_()
    if recipe.name != "delayed":
        return
    # Non-finite entries are ignored, so one bad step does not poison the next L steps.
    usable = torch.where(torch.isfinite(history), history, torch.zeros_like(history))
    amax_ref = usable.max() if recipe.amax_compute_algo == "max" else usable[0]
    fp8_max = FP8_MAX[recipe.dtype(role)]
    new_scale = amax_to_scale(amax_ref, fp8_max, recipe.margin, recipe.round_to_power_of_2)
    ok = amax_ref > 0
    state.scale[role].copy_(torch.where(ok, new_scale, state.scale[role]))
    state.initialized[role].copy_(state.initialized[role] | ok)


@torch.no_grad()
def roll_amax_history(model: nn.Module) -> None:
    """Push every FP8 layer's pending amax into its history (and, for ``delayed``, update the scale).

    Called once per optimizer step by the precision plugin, after the last backward of the
    accumulation window; standalone layers roll after every cast instead.
    """
    for module in fp8_modules(model).values():
        state = state_of(module)
        for role in range(len(ROLES)):
            roll_role(state, module.fp8_recipe, role)


def fp8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """All modules of ``model`` that carry FP8 state, keyed by qualified name."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "fp8_recipe") and hasattr(m, "fp8_scale")}


def fp8_state_dict(model: nn.Module) -> dict[str, Any]:
    """Export the FP8 state of every FP8 layer of ``model``, keyed by module name.

    The result holds only tensors (cloned, on the layers' devices) and plain Python values, so it
    can be saved with ``torch.save`` and loaded with ``torch.load(weights_only=True)``.
    """
    layers = {}
    for name, module in fp8_modules(model).items():
        entry: dict[str, Any] = {"recipe": module.fp8_recipe.to_dict()}
        for buf in STATE_BUFFERS:
            entry[buf] = getattr(module, buf).detach().clone()
        layers[name] = entry
    return {"version": STATE_FORMAT_VERSION, "roles": list(ROLES), "layers": layers}


@torch.no_grad()
def load_fp8_state_dict(model: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Import a state made by :func:`fp8_state_dict` into ``model``'s FP8 layers.

    Raises:
        ValueError: if a layer's saved recipe differs from its current recipe (never a silent mix
            of recipes), if the format version is unknown, or, with ``strict=True``, if the saved
            and current sets of FP8 layers differ.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_FORMAT_VERSION:
        raise ValueError(
            f"Unknown FP8 state format (expected version {STATE_FORMAT_VERSION}, got "
            f"{state.get('version') if isinstance(state, dict) else type(state).__name__})"
        )
    modules = fp8_modules(model)
    saved = state["layers"]
    if strict:
        missing = sorted(set(modules) - set(saved))
        unexpected = sorted(set(saved) - set(modules))
        if missing or unexpected:
            raise ValueError(
                f"FP8 state does not match the model's FP8 layers: missing {missing}, unexpected {unexpected}"
            )
    for name, module in modules.items():
        if name not in saved:
            continue
        entry = saved[name]
        current = module.fp8_recipe.to_dict()
        if entry["recipe"] != current:
            raise ValueError(
                f"FP8 layer {name!r} was saved with recipe {entry['recipe']} but is configured with {current}. "
                "Resume with the same FP8Precision settings, or drop the FP8 state (the weights are recipe-free) "
                "by loading the model state_dict alone."
            )
        for buf in STATE_BUFFERS:
            getattr(module, buf).copy_(entry[buf])
