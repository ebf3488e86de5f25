"""Swapping high-precision layers to FP8 layers and back, in place, through a registry of layer types.

The registry maps a module type to its FP8 counterpart (:func:`register_fp8_module`); built in:
``nn.Linear`` -> :class:`~lightning_fp8.FP8Linear`. Conversion changes each eligible layer's class in
place: the module object, its Parameters, hooks and every reference to it stay the same, so optimizers,
weight tying and wrappers (DDP ignores the return value of ``convert_module``) keep working, and the
``state_dict`` keys do not change. After converting, the FP8 state of all the model's FP8 layers is bound
into one state table per recipe (:func:`lightning_fp8.state.bind_state_tables`).

Default skip rules (each skipped layer is reported with its reason):

* names matching one of the ``exclude`` glob patterns (``fnmatch`` on the fully-qualified name,
  e.g. ``"lm_head"``, ``"*.router"``, ``"encoder.layers.0.*"``). A pattern is matched against each
  layer's *own* name only: ``"blocks.0"`` names the block, not the Linear layers inside it (use
  ``"blocks.0.*"``). A pattern that matches no layer is an error that names the closest layer names
  (a typo such as ``"lm_haed"`` must not silently train the head in FP8; see ``check_exclude``);
* for ``nn.Linear``: ``in_features`` or ``out_features`` not a multiple of 16 (FP8 tensor cores need it;
  such layers would be zero-padded on every call, which costs more than it saves). Pass
  ``skip_unaligned=False`` to convert them anyway: they are padded and stay correct;
* subclasses of a registered type (for example ``nn.MultiheadAttention.out_proj``, whose weights are used
  by a functional kernel and never through ``forward``): their ``forward`` may not be the base class's,
  so converting them could silently do nothing. Only exact registered types are converted.
"""

from __future__ import annotations

import difflib
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
from lightning_fp8.state import bind_state_tables, without_orig_mod

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
            + f"; GEMM path: {describe_gemm_path(self.device, self.recipe.name)}"
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


_GLOB_CHARS = frozenset("*?[")


def exact_pattern(name: str) -> str:
    """``name`` as an ``fnmatch`` pattern that matches exactly it (its glob characters escaped)."""
    return "".join(f"[{c}]" if c in _GLOB_CHARS else c for c in name)


def closest_names(pattern: str, names: Sequence[str], n: int = 5) -> list[str]:
    """The names in ``names`` closest to ``pattern`` (``difflib``), best first; for typos in name patterns.

    A name is compared whole, without the ``_orig_mod`` components ``torch.compile`` inserts, and by its trailing
    components (as many as ``pattern`` has), so ``"lm_haed"`` finds ``"model.lm_head"``."""
    parts = pattern.count(".") + 1
    scored: dict[str, float] = {}
    for name in dict.fromkeys(names):
        tail = ".".join(name.split(".")[-parts:])
        scored[name] = max(
            difflib.SequenceMatcher(None, pattern, candidate).ratio()
            for candidate in dict.fromkeys((name, without_orig_mod(name), tail))
        )
    close = set(difflib.get_close_matches(pattern, list(scored), n=n, cutoff=0.6))
    close |= {name for name, score in scored.items() if score >= 0.6}
    best = max((scored[name] for name in close), default=0.0)
    close = {name for name in close if scored[name] >= best - 0.15}  # not the also-rans of a clear winner
    return sorted(close, key=lambda name: (-scored[name], name))[:n]


def unmatched_pattern_hint(
    pattern: str, layer_names: Sequence[str], other_names: Sequence[str] = (), what: str = "layer"
) -> str:
    """Why ``pattern`` matches none of ``layer_names`` and what would: a module of ``other_names`` it matches (a
    block: its layers need ``pattern.*``), a glob for a name written without its prefix, the closest names (of
    ``what``: ``"layer"``, ``"FP8 layer"``)."""
    hints = []
    parents = [name for name in other_names if fnmatch.fnmatchcase(name, pattern)]
    if parents:
        hints.append(
            f"it matches {_quoted(parents, 3)}, which {'is' if len(parents) == 1 else 'are'} not a layer: patterns "
            f"match each layer by its own fully-qualified name, so use {pattern + '.*'!r} for the layers inside"
        )
    compiled = [
        name for name in layer_names if "_orig_mod" in name and fnmatch.fnmatchcase(without_orig_mod(name), pattern)
    ]
    if compiled:
        hints.append(
            f"it would match {_quoted(compiled, 3)} without the '_orig_mod.' that torch.compile inserts into the "
            "names of the modules it wraps: write it into the pattern, or start the pattern with '*'"
        )
    elif not parents and not _GLOB_CHARS & set(pattern):
        for glob in (f"*{pattern}", f"*{pattern}*"):
            matches = [name for name in layer_names if fnmatch.fnmatchcase(name, glob)]
            if matches:
                hints.append(f"the glob {glob!r} would match {_quoted(matches, 3)}")
                break
    close = closest_names(pattern, layer_names)
    if close:
        hints.append(f"closest {what} names: {_quoted(close, 5)}")
    elif layer_names:
        hints.append(f"the {what}s are: {_quoted(layer_names, 8)}")
    else:
        hints.append("the model has no nn.Linear layer" if what == "layer" else f"there is no {what}")
    return "; ".join(hints)


def _quoted(names: Sequence[str], limit: int) -> str:
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def check_exclude(
    exclude: Sequence[str], modules: Sequence[nn.Module], owner: str = "exclude", advice: str = ""
) -> None:
    """Raise if a pattern of ``exclude`` matches no layer (of a registered type: ``nn.Linear``, FP8 or not, and its
    subclasses) of any of ``modules``, by fully-qualified name within its model. Checking several models at once is
    what the precision plugin does for Fabric, where a pattern may name a layer of only one of them.

    Raises:
        ValueError: naming each unmatched pattern with ``unmatched_pattern_hint``, prefixed by ``owner`` and
            followed by ``advice``.
    """
    if isinstance(exclude, str):
        exclude = [exclude]
    layers: list[str] = []
    others: list[str] = []
    for module in modules:
        for name, child in module.named_modules():
            if isinstance(child, FP8Module) or _registered_base(child) is not None:
                layers.append(name)
            else:
                others.append(name)
    problems = [
        f"pattern {pattern!r} matches no layer ({unmatched_pattern_hint(pattern, layers, others)})"
        for pattern in exclude
        if not any(fnmatch.fnmatchcase(name, pattern) for name in layers)
    ]
    if problems:
        raise ValueError(
            f"{owner}: " + "; ".join(problems) + ". Patterns are fnmatch globs on fully-qualified module names of "
            "nn.Linear layers; a pattern that matches nothing is an error, so that a typo cannot silently train a "
            "layer in FP8." + (f" {advice}" if advice else "")
        )


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
    allow_unmatched_exclude: bool = False,
) -> ConversionReport:
    """Convert the eligible layers of ``module`` (including ``module`` itself) to their FP8 types, in place.

    Idempotent: layers that are FP8 already are left alone (and reported in ``already_fp8``). Afterwards
    every FP8 layer of ``module`` holds its state in one table per recipe. Logs the report's one-line
    summary at INFO level.

    Args:
        module: the model; modified in place.
        recipe: an :class:`FP8Recipe` or recipe name (default ``"tensorwise"``).
        exclude: glob patterns (``fnmatch``) of fully-qualified names of layers to keep in high precision. Each
            pattern is matched against the layers' own names (``"blocks.0"`` names a block, not its layers: use
            ``"blocks.0.*"``).
        skip_unaligned: skip layers whose features are not multiples of 16 (default) instead of padding.
        log_summary: log the one-line summary (the precision plugin logs its own line instead).
        allow_unmatched_exclude: do not raise for ``exclude`` patterns that match no layer of ``module`` (the
            precision plugin passes ``True`` and checks the patterns across all its models, see ``check_exclude``).

    Raises:
        ValueError: if an existing FP8Linear has a different recipe (never a silent mix of recipes); if an
            ``exclude`` pattern matches no layer (unless ``allow_unmatched_exclude``), naming the closest layer
            names; if an ``exclude`` pattern matches a layer that is FP8 already (the pattern could not take
            effect). The model is left untouched in each case.
    """
    recipe = resolve_recipe(recipe)
    if isinstance(exclude, str):
        exclude = [exclude]
    device = _device_of(module)
    report = ConversionReport(recipe=recipe, gemm_path=gemm_path(device, recipe.name), device=str(device))
    parents: dict[str, nn.Module] = {}
    for name, child in module.named_modules():
        for child_name, grandchild in child.named_children():
            parents[f"{name}.{child_name}" if name else child_name] = child
    # Check every existing FP8 layer and the patterns before converting anything: an error leaves the model untouched.
    for name, child in module.named_modules():
        if isinstance(child, FP8Module) and child.fp8_recipe != recipe:
            raise ValueError(
                f"Layer {name or '<root>'!r} is already FP8 with recipe {child.fp8_recipe} and cannot be "
                f"converted again with {recipe}; call convert_from_fp8 first."
            )
        if isinstance(child, FP8Module):
            pattern = next((p for p in exclude if fnmatch.fnmatchcase(name, p)), None)
            if pattern is not None:
                raise ValueError(
                    f"exclude pattern {pattern!r} matches layer {name or '<root>'!r}, which is FP8 already: it cannot "
                    "be kept in high precision. Call convert_from_fp8 first, or convert once with this exclude."
                )
    if not allow_unmatched_exclude:
        check_exclude(
            exclude,
            [module],
            owner=f"convert_to_fp8(exclude={list(exclude)!r})",
            advice="Pass allow_unmatched_exclude=True to ignore patterns that match nothing.",
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
