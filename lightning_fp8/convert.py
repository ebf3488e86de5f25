"""Swapping high-precision layers to FP8 layers and back, in place, through a registry of layer types.

The registry maps a module type to its FP8 counterpart (:func:`register_fp8_module`); built in:
``nn.Linear`` -> :class:`~lightning_fp8.FP8Linear`. Conversion changes each eligible layer's class in
place: the module object, its Parameters, hooks and every reference to it stay the same, so optimizers,
weight tying and wrappers (DDP ignores the return value of ``convert_module``) keep working, and the
``state_dict`` keys do not change. After converting, the FP8 state of all the model's FP8 layers is bound
into one state table per recipe (:func:`lightning_fp8.state.bind_state_tables`).

Default skip rules (each skipped layer is reported with its reason):

* names matching one of the ``exclude`` glob patterns (``fnmatch`` on the fully-qualified name,
  e.g. ``"lm_head"``, ``"*.router"``, ``"encoder.layers.0.*"``);
* for ``nn.Linear``: ``in_features`` or ``out_features`` not a multiple of 16 (FP8 tensor cores need it;
  such layers would be zero-padded on every call, which costs more than it saves). Pass
  ``skip_unaligned=False`` to convert them anyway: they are padded and stay correct;
* subclasses of a registered type (for example ``nn.MultiheadAttention.out_proj``, whose weights are used
  by a functional kernel and never through ``forward``): their ``forward`` may not be the base class's,
  so converting them could silently do nothing. Only exact registered types are converted.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_fp8.gemm import describe_gemm_path, gemm_path
from lightning_fp8.linear import FP8Linear
from lightning_fp8.module import FP8Module
from lightning_fp8.recipe import FP8Recipe, resolve_recipe
from lightning_fp8.state import bind_state_tables

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FP8ModuleRule:
    """How one high-precision module type becomes an FP8 module.

    Attributes:
        source: the high-precision type (converted only when a module's type is exactly this).
        fp8_type: the FP8 type, a subclass of ``source`` and of :class:`~lightning_fp8.module.FP8Module`.
        convert: ``(module, recipe) -> module``: converts in place and returns the module.
        skip_reason: ``(module, skip_unaligned) -> str | None``: why a module of this type stays in high
            precision, or ``None`` to convert it.
    """

    source: type[nn.Module]
    fp8_type: type[nn.Module]
    convert: Callable[[nn.Module, FP8Recipe], nn.Module]
    skip_reason: Callable[[nn.Module, bool], str | None] = lambda module, skip_unaligned: None


_REGISTRY: dict[type[nn.Module], FP8ModuleRule] = {}


def register_fp8_module(rule: FP8ModuleRule, *, replace: bool = False) -> None:
    """Register how ``rule.source`` modules become FP8 modules (used by :func:`convert_to_fp8`).

    Raises:
        ValueError: if ``rule.source`` is registered already and ``replace`` is false.
    """
    if rule.source in _REGISTRY and not replace:
        raise ValueError(f"{rule.source.__name__} is registered already (pass replace=True to override)")
    if not issubclass(rule.fp8_type, FP8Module) or not issubclass(rule.fp8_type, rule.source):
        raise ValueError(f"{rule.fp8_type.__name__} must subclass both FP8Module and {rule.source.__name__}")
    _REGISTRY[rule.source] = rule


def registered_fp8_modules() -> dict[type[nn.Module], FP8ModuleRule]:
    """A copy of the registry: high-precision type -> :class:`FP8ModuleRule`."""
    return dict(_REGISTRY)


def _linear_skip_reason(module: nn.Module, skip_unaligned: bool) -> str | None:
    assert isinstance(module, nn.Linear)
    if skip_unaligned and (module.in_features % 16 or module.out_features % 16):
        return (
            f"in_features={module.in_features}, out_features={module.out_features}: not both multiples of 16 "
            "(pass skip_unaligned=False to convert with padding)"
        )
    return None


register_fp8_module(FP8ModuleRule(nn.Linear, FP8Linear, FP8Linear.from_linear, _linear_skip_reason))


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


def _registered_base(module: nn.Module) -> type[nn.Module] | None:
    """The registered type ``module`` is an instance of (exactly or as a subclass), if any."""
    if type(module) in _REGISTRY:
        return type(module)
    for source in _REGISTRY:
        if isinstance(module, source):
            return source
    return None


def _skip_reason(
    name: str, module: nn.Module, parent: nn.Module | None, exclude: Sequence[str], skip_unaligned: bool
) -> str | None:
    if isinstance(parent, nn.MultiheadAttention):
        return "inside nn.MultiheadAttention, which uses the weights in a functional kernel, not through forward"
    source = _registered_base(module)
    assert source is not None
    if type(module) is not source:
        base = f"nn.{source.__name__}" if source.__module__.startswith("torch.nn") else source.__qualname__
        return f"{type(module).__name__} is a subclass of {base} whose forward may differ"
    for pattern in exclude:
        if fnmatch.fnmatchcase(name, pattern):
            return f"excluded by pattern {pattern!r}"
    return _REGISTRY[source].skip_reason(module, skip_unaligned)


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
    """Convert the eligible layers of ``module`` (including ``module`` itself) to their FP8 types, in place.

    Idempotent: layers that are FP8 already are left alone (and reported in ``already_fp8``). Afterwards
    every FP8 layer of ``module`` holds its state in one table per recipe. Logs the report's one-line
    summary at INFO level.

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
        if isinstance(child, FP8Module) and child.fp8_recipe != recipe:
            raise ValueError(
                f"Layer {name or '<root>'!r} is already FP8 with recipe {child.fp8_recipe} and cannot be "
                f"converted again with {recipe}; call convert_from_fp8 first."
            )
    for name, child in module.named_modules():
        if isinstance(child, FP8Module):
            report.already_fp8.append(name)
        elif _registered_base(child) is not None:
            reason = _skip_reason(name, child, parents.get(name), exclude, skip_unaligned)
            if reason is None:
                _REGISTRY[type(child)].convert(child, recipe)
                report.converted.append(name)
            else:
                report.skipped[name] = reason
    bind_state_tables(module)
    if log_summary:
        log.info(report.summary())
    return report


def convert_from_fp8(module: nn.Module) -> list[str]:
    """Turn every FP8 layer in ``module`` back into its high-precision type in place (same Parameters).

    Use it to export a model trained in FP8: afterwards nothing of lightning_fp8 is needed to run or
    load it. Returns the names of the layers converted back.
    """
    names = []
    sources = {rule.fp8_type: rule.source for rule in _REGISTRY.values()}
    for name, child in module.named_modules():
        if isinstance(child, FP8Module):
            source = sources.get(type(child)) or next(src for t, src in sources.items() if isinstance(child, t))
            child.remove_fp8_state()
            child.__class__ = source
            names.append(name)
    return names
