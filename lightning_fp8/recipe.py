"""FP8 formats and scaling recipes: plain data plus the amax -> scale formulas.

This module is the bottom layer of the package. It knows the FP8 dtypes, their maxima and the
scaling formulas; it does not know about modules, autograd or Lightning.

Formats
-------
``hybrid`` (default)
    E4M3 (``torch.float8_e4m3fn``, max 448) for inputs and weights, E5M2 (``torch.float8_e5m2``,
    max 57344) for gradients: gradients need range more than precision.
``e4m3``
    E4M3 for all three tensors.

Recipes
-------
``tensorwise`` (current scaling, default)
    One scale per tensor, computed from the tensor being cast::

        scale = fp8_max / max(amax(|x|), eps)   (in float64, rounded toward zero to float32)

``delayed`` (Transformer Engine semantics)
    One scale per tensor, computed from a ring buffer of the last ``amax_history_len`` amaxes::

        amax_ref = max(history)          if amax_compute_algo == "max"
                 = history[most recent]  if amax_compute_algo == "most_recent"
        scale    = fp8_max / amax_ref / 2**margin

    A zero or non-finite ``amax_ref`` keeps the previous scale; non-finite entries of the history are
    ignored, so one bad step cannot poison the following ``amax_history_len`` steps. Unlike Transformer
    Engine, a tensor whose history is still empty is cast with its *current* amax, never with a blind
    scale of 1.

``rowwise``
    One scale per row of each GEMM operand (torchao ``rowwise`` semantics): E4M3 for all three GEMMs,
    scales rounded down to a power of two::

        scale[i] = 2**floor(log2(fp8_max / max(amax(|x[i, :]|), eps)))

Every recipe can round its scales down to a power of two (``power_of_2_scale=True``); a power-of-two
scale makes the cast exact up to the FP8 rounding of the mantissa.

The cast itself is saturating for finite values (``|x * scale| > fp8_max`` clamps to ``±fp8_max``)
and maps non-finite values to NaN, so a NaN or Inf in a tensor always reaches the GEMM output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

import torch

RecipeName = Literal["tensorwise", "delayed", "rowwise"]
FP8Format = Literal["hybrid", "e4m3"]
AmaxComputeAlgo = Literal["max", "most_recent"]

RECIPES: tuple[str, ...] = get_args(RecipeName)
FORMATS: tuple[str, ...] = get_args(FP8Format)
AMAX_COMPUTE_ALGOS: tuple[str, ...] = get_args(AmaxComputeAlgo)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FP8_MAX = {E4M3: E4M3_MAX, E5M2: E5M2_MAX}

#: amax is clamped to at least this value before taking the reciprocal (same value as torchao).
AMAX_EPS = 1e-12

#: The three tensors every FP8 GEMM layer quantizes, in the order used by the state buffers.
ROLES: tuple[str, ...] = ("input", "weight", "grad_output")
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not valid; choose one of {list(choices)}")


@dataclass(frozen=True)
class FP8Recipe:
    """How a layer chooses its FP8 scales. Plain-typed and frozen, so it can live in yaml.

    Args:
        name: ``"tensorwise"`` (current scaling), ``"delayed"`` (amax history) or ``"rowwise"``.
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``. ``rowwise`` always uses
            E4M3 for all three tensors, as in torchao; asking for ``hybrid`` with it is accepted and
            means the same thing.
        amax_history_len: length of the per-tensor amax ring buffer (every recipe keeps one for the
            statistics; ``delayed`` also derives its scale from it).
        amax_compute_algo: ``"max"`` or ``"most_recent"``: how ``delayed`` reduces the history.
        margin: ``delayed`` divides its scale by ``2**margin``.
        power_of_2_scale: round every scale down to a power of two (always on for ``rowwise``).

    Raises:
        ValueError: naming the field and the valid values, for any invalid setting.
    """

    name: RecipeName = "tensorwise"
    fp8_format: FP8Format = "hybrid"
    amax_history_len: int = 16
    amax_compute_algo: AmaxComputeAlgo = "max"
    margin: int = 0
    power_of_2_scale: bool = False

    def __post_init__(self) -> None:
        _check_choice("recipe", self.name, RECIPES)
        _check_choice("fp8_format", self.fp8_format, FORMATS)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}")
        if not isinstance(self.power_of_2_scale, bool):
            raise ValueError(f"power_of_2_scale must be a bool, got {self.power_of_2_scale!r}")

    @property
    def round_to_power_of_2(self) -> bool:
        """Whether scales are rounded down to a power of two."""
        return self.power_of_2_scale or self.name == "rowwise"

    def dtype(self, role: int) -> torch.dtype:
        """FP8 dtype for ``role`` (``INPUT``, ``WEIGHT`` or ``GRAD_OUTPUT``)."""
        if role == GRAD_OUTPUT and self.fp8_format == "hybrid" and self.name != "rowwise":
            return E5M2
        return E4M3

    def to_dict(self) -> dict[str, object]:
        """Plain-value form, stored next to the FP8 state so a mismatched checkpoint is detected."""
        return dataclasses.asdict(self)


def resolve_recipe(recipe: FP8Recipe | str | None, **overrides: object) -> FP8Recipe:
    """Turn a recipe name (or ``None`` for the default) into an :class:`FP8Recipe`."""
    if recipe is None:
        return FP8Recipe(**overrides)  # type: ignore[arg-type]
    if isinstance(recipe, FP8Recipe):
        return dataclasses.replace(recipe, **overrides) if overrides else recipe
    if isinstance(recipe, str):
        return FP8Recipe(name=recipe, **overrides)  # type: ignore[arg-type]
    raise ValueError(f"recipe must be one of {list(RECIPES)} or an FP8Recipe, got {recipe!r}")


def amax_to_scale(amax: torch.Tensor, fp8_max: float, margin: int = 0, power_of_2: bool = False) -> torch.Tensor:
    """``scale = fp8_max / max(amax, eps) / 2**margin``, in float64, rounded toward zero to float32.

    Computing the reciprocal in float64 makes eager and ``torch.compile`` agree bit for bit (they round
    a float32 division differently). Rounding toward zero keeps ``amax * scale <= fp8_max`` in float32
    arithmetic, so the tensor's own amax is never counted as an overflow (round-to-nearest pushes it
    one ulp past ``fp8_max`` in a few percent of casts). A NaN amax gives a NaN scale, an infinite
    amax a zero scale; callers decide what to do with those.
    """
    exact = fp8_max / torch.clamp(amax.to(torch.float64), min=AMAX_EPS)
    if margin:
        exact = exact / (2.0**margin)
    scale = exact.to(torch.float32)
    scale = torch.where(scale.to(torch.float64) > exact, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    if power_of_2:
        rounded = torch.exp2(torch.floor(torch.log2(scale)))
        # float32 log2 rounds a scale just below 2**k up to exactly k: step back so the result is never
        # above the scale (a larger scale would push the amax past fp8_max and count it as an overflow).
        scale = torch.where(rounded > scale, rounded * 0.5, rounded)
    return scale
