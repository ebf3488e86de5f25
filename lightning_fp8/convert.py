"""Swapping ``nn.Linear`` layers to :class:`~lightning_fp8.FP8Linear` and back, in place.

Conversion changes each eligible layer's class in place: the module object, its Parameters, hooks
and every reference to it stay the same, so optimizers, weight tying and wrappers (DDP ignores the
return value of ``convert_module``) keep working, and the ``state_dict`` keys do not change.

Default skip rules (each skipped layer is reported with its reason):

* names matching one of the ``exclude`` glob patterns (``fnmatch`` on the fully-qualified name,
  e.g. ``"lm_head"``, ``"*.router"``, ``"encoder.layers.0.*"``);
* ``in_features`` or ``out_features`` not a multiple of 16 (FP8 tensor cores need it; such layers
  would be zero-padded on every call, which costs more than it saves). Pass ``skip_unaligned=False``
  to convert them anyway: they are padded and stay correct;
* subclasses of ``nn.Linear`` other than FP8Linear: their ``forward`` may not be ``nn.Linear``'s (for
  example ``nn.MultiheadAttention.out_proj``, whose weights are used by a functional kernel and never
  through ``forward``), so converting them could silently do nothing.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_fp8.gemm import describe_gemm_path, gemm_path
from lightning_fp8.linear import FP8Linear
from lightning_fp8.recipe import FP8Recipe, resolve_recipe
from lightning_fp8.scaling import remove_state

log = logging.getLogger(__name__)


@dataclass
class ConversionReport:
    """What :func:`convert_to_fp8` did.

    Attributes:
        converted: names of the layers converted by this call.
        already_fp8: names of the layers that were FP8Linear already (conversion is idempotent).
        skipped: ``{name: reason}`` for every ``nn.Linear`` (or subclass) left in high precision.
        recipe: the recipe of the FP8 layers.
        gemm_path: ``"native"`` or ``"emulated"`` for the device the layers are on.
        device: that device, as a string.
    """

    converted: list[str] = field(default_factory=list)
    already_fp8: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    recipe: FP8Recipe = field(default_factory=FP8Recipe)
    gemm_path: str = "emulated"
    device: str = "cpu"

    @property
    def fp8_layers(self) -> list[str]:
        """All FP8 layers of the model after the call."""
        return self.already_fp8 + self.converted

    def summary(self) -> str:
        """One line: recipe, layer counts, skip reasons and GEMM path."""
        skipped = "; ".join(f"{name or '<root>'}: {why}" for name, why in self.skipped.items())
        return (
            f"FP8 active: recipe={self.recipe.name} fp8_format={self.recipe.fp8_format}, "
            f"{len(self.fp8_layers)} Linear layer(s) in FP8, {len(self.skipped)} skipped"
            + (f" ({skipped})" if skipped else "")
            + f"; GEMM path: {describe_gemm_path(self.device)}"
        )

    def __str__(self) -> str:
        return self.summary()


def _skip_reason(name: str, module: nn.Module, parent: nn.Module | None, exclude: Sequence[str], skip_unaligned: bool) -> str | None:
    if isinstance(parent, nn.MultiheadAttention):
        return "inside nn.MultiheadAttention, which uses the weights in a functional kernel, not through forward"
    if type(module) is not nn.Linear:
        return f"{type(module).__name__} is a subclass of nn.Linear whose forward may differ"
    for pattern in exclude:
        if fnmatch.fnmatchcase(name, pattern):
            return f"excluded by pattern {pattern!r}"
    if skip_unaligned and (module.in_features % 16 or module.out_features % 16):
        return (
            f"in_features={module.in_features}, out_features={module.out_features}: not both multiples of 16 "
            "(pass skip_unaligned=False to convert with padding)"
        )
    return None


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def convert_to_fp8(
    module: nn.Module,
    recipe: FP8Recipe | str | None = None,
    exclude: Sequence[str] = (),
    skip_unaligned: bool = True,
    log_summary: bool = True,
) -> ConversionReport:
    """Convert the eligible ``nn.Linear`` layers of ``module`` (including ``module`` itself) to FP8Linear, in place.

    Idempotent: layers that are FP8Linear already are left alone (and reported in ``already_fp8``).
    Logs the report's one-line summary at INFO level.

    Args:
        module: the model; modified in place.
        recipe: an :class:`FP8Recipe` or recipe name (default ``"tensorwise"``).
        exclude: glob patterns of fully-qualified module names to keep in high precision.
        skip_unaligned: skip layers whose features are not multiples of 16 (default) instead of padding.
        log_summary: log the one-line summary (the precision plugin logs its own line instead).

    Raises:
        ValueError: if an existing FP8Linear has a different recipe (never a silent mix of recipes).
    """
    recipe = resolve_recipe(recipe)
    if isinstance(exclude, str):
        exclude = [exclude]
    device = _device_of(module)
    report = ConversionReport(recipe=recipe, gemm_path=gemm_path(device), device=str(device))
    parents: dict[str, nn.Module] = {}
    for name, child in module.named_modules():
        for child_name, grandchild in child.named_children():
            parents[f"{name}.{child_name}" if name else child_name] = child
    # Check every existing FP8 layer before converting anything: a mismatch leaves the model untouched.
    for name, child in module.named_modules():
        if isinstance(child, FP8Linear) and child.fp8_recipe != recipe:
            raise ValueError(
                f"Layer {name or '<root>'!r} is already FP8 with recipe {child.fp8_recipe} and cannot be "
                f"converted again with {recipe}; call convert_from_fp8 first."
            )
    for name, child in module.named_modules():
        if isinstance(child, FP8Linear):
            report.already_fp8.append(name)
        elif isinstance(child, nn.Linear):
            reason = _skip_reason(name, child, parents.get(name), exclude, skip_unaligned)
            if reason is None:
                FP8Linear.from_linear(child, recipe)
                report.converted.append(name)
            else:
                report.skipped[name] = reason
    if log_summary:
        log.info(report.summary())
    return report


def convert_from_fp8(module: nn.Module) -> list[str]:
    """Turn every FP8Linear in ``module`` back into a plain ``nn.Linear`` in place (same Parameters).

    Use it to export a model trained in FP8: afterwards nothing of lightning_fp8 is needed to run or
    load it. Returns the names of the layers converted back.
    """
    names = []
    for name, child in module.named_modules():
        if isinstance(child, FP8Linear):
            remove_state(child)
            del child.fp8_recipe
            child.__dict__.pop("_fp8_forward_enabled", None)
            child.__class__ = nn.Linear
            names.append(name)
    return names
