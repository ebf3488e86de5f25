"""FP8 formats and scaling recipes: plain data, the amax -> scale formulas, and the per-operand cast specs.

This module is the bottom layer of the package. It knows the FP8 dtypes, their maxima and the
scaling formulas; it does not know about modules, autograd or Lightning. Every other module learns
what to do from a recipe's :class:`CastSpec` objects (``FP8Recipe.cast_specs()``), never by
branching on the recipe's name.

Formats
-------
``hybrid`` (default for ``tensorwise`` and ``delayed``)
    E4M3 (``torch.float8_e4m3fn``, max 448) for inputs and weights, E5M2 (``torch.float8_e5m2``,
    max 57344) for gradients: gradients need range more than precision.
``e4m3``
    E4M3 for all three tensors (the only format of ``rowwise``: the row-wise FP8 GEMM takes E4M3 operands).

Recipes
-------
``tensorwise`` (current scaling, default)
    One scale per tensor, computed from the tensor being cast::

        scale = fp8_max / max(amax(|x|), eps)   (in float64, rounded toward zero to float32)

``delayed`` (Transformer Engine semantics)
    One scale per tensor, computed from a ring buffer of the last ``amax_history_len`` amaxes::

        amax_ref = max(history)          if amax_compute_algo == "max" (default)
                 = history[most recent]  if amax_compute_algo == "most_recent"
        scale    = fp8_max / amax_ref / 2**margin

    A zero or non-finite ``amax_ref`` keeps the previous scale; non-finite entries of the history are
    ignored, so one bad step cannot poison the following ``amax_history_len`` steps. Unlike Transformer
    Engine, a tensor whose history is still empty is cast with its *current* amax, never with a blind
    scale of 1.

``rowwise``
    One scale per row of each GEMM operand, along the GEMM's reduction dimension (torchao ``rowwise``
    semantics): E4M3 for all three GEMMs, scales rounded down to a power of two by default::

        scale[i] = 2**floor(log2(fp8_max / max(amax(|x[i, :]|), eps)))

``blockwise`` (DeepSeek-V3 tiles; Transformer Engine's ``Float8BlockScaling``)
    E4M3 for every operand. Activations (the input) and gradients (grad_output) get one scale per 1×128
    tile along the GEMM's reduction dimension, weights one per 128×128 block; the transposed operands of the
    backward GEMMs are tiled along *their* reduction dimension (the input and grad_output of the grad_weight
    GEMM per 128×1 tile, along the tokens). Float32 scales, each from the amax of its own tile::

        scale[tile] = fp8_max / max(amax(|x[tile]|), eps)       (option: rounded down to a power of two)

``mxfp8`` (OCP Microscaling MXFP8; NVIDIA's MXFP8 recipe)
    One scale per block of 32 consecutive elements along the GEMM's reduction dimension, for every operand
    of every GEMM (the backward GEMMs quantize their transposed operands along their own reduction
    dimension). The scale is a power of two stored as E8M0; the block's decoding scale ``2**e`` is rounded
    *up* (NVIDIA's rule), so no element saturates because of the rounding::

        e            = ceil(log2(max(amax(|x[block]|), eps) / fp8_max))
        scale[block] = 2**-e   (= 2**floor(log2(fp8_max / amax)): the power-of-two rounding of the formula above)

    E4M3 data for every operand by default; ``fp8_format="hybrid"`` gives E5M2 gradients. (The OCP
    specification's own example rule, ``2**(floor(log2(amax)) - emax)``, can saturate up to the top
    element of a block; the rounded-up scale never does.)

Block recipes derive every scale from the tensor being cast and keep no scaling history (their amax
history is kept for the statistics only). A dimension that is not a multiple of the block size ends in a
partial block, whose scale comes from the elements it has (the kernels' zero padding adds nothing to a
block's amax and nothing to a product).

Every recipe can round its scales down to a power of two (``power_of_2_scale=True``; on by default for
``rowwise``, always for ``mxfp8``); a power-of-two scale makes the multiplication by the scale exact.

The cast itself is saturating for finite values (``|x * scale| > fp8_max`` clamps to ``±fp8_max``)
and maps non-finite values to NaN, so a NaN or Inf in a tensor always reaches the GEMM output.

Settings a recipe does not use are rejected when the recipe is built (``margin`` and
``amax_compute_algo`` outside ``delayed``, ``fp8_format="hybrid"`` with ``rowwise`` or ``blockwise``,
``power_of_2_scale=False`` with ``mxfp8``), so a configuration never silently means less than it says.

Cast specs
----------
An FP8 linear layer runs three GEMMs, each with two quantized operands::

    forward      output      = input       @ weightᵀ     reduction over in_features
    grad_input   grad_input  = grad_output @ weight      reduction over out_features
    grad_weight  grad_weight = grad_outputᵀ @ input      reduction over the tokens

``FP8Recipe.cast_specs()`` compiles a recipe into one :class:`CastSpec` per operand of each GEMM
(:class:`LinearCastSpecs`): the FP8 dtype, the granularity (one scale for the tensor, or one per slice
along the GEMM's reduction dimension, or one per block), where the scale comes from (the tensor's current amax or the
amax history), the margin and the power-of-two rounding. Two uses of a tensor with the same cast
(tensor granularity) share one FP8 copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

RecipeName = Literal["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"]
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

#: Block sizes of the block recipes: ``blockwise`` tiles and blocks, ``mxfp8`` blocks (fixed by the hardware GEMMs).
BLOCKWISE_TILE = 128
MX_BLOCK = 32
#: Recipes with one scale per block (they keep no scaling history).
BLOCK_RECIPES: tuple[str, ...] = ("blockwise", "mxfp8")
#: Recipes whose operands are E4M3 only (their hardware GEMM takes no E5M2).
_E4M3_ONLY = ("rowwise", "blockwise")

#: amax is clamped to at least this value before taking the reciprocal (same value as torchao).
AMAX_EPS = 1e-12


@torch.compiler.assume_constant_result
def fp8_max(dtype: torch.dtype) -> float:
    """``FP8_MAX[dtype]``, the largest finite value of an FP8 format, read as a constant under ``torch.compile``.

    Code that runs under compile reads the float constants of this package through functions like this one:
    ``torch.compile(dynamic=True)`` turns a float read from a module-level name into a symbolic graph input, and
    dynamo cannot lift one that is first read in the backward of an ``autograd.Function`` (the ``E5M2`` gradient
    cast of ``tensorwise`` and ``delayed``), which failed the whole compile. The value is not guarded: these are
    constants, a compiled graph keeps the value it was traced with.
    """
    return FP8_MAX[dtype]


@torch.compiler.assume_constant_result
def amax_eps() -> float:
    """:data:`AMAX_EPS`, read as a constant under ``torch.compile`` (see :func:`fp8_max`)."""
    return AMAX_EPS


#: The three tensors every FP8 GEMM layer quantizes, in the order used by the state table.
ROLES: tuple[str, ...] = ("input", "weight", "grad_output")
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not valid; choose one of {list(choices)}")


def _unused(field: str, value: object, recipe: str, hint: str) -> ValueError:
    return ValueError(f"{field}={value!r} has no effect with recipe={recipe!r}: {hint}")


@dataclass(frozen=True)
class CastSpec:
    """How one GEMM operand is quantized: ``fp8 = saturate(x * scale)``.

    Attributes:
        role: which tensor this is (``INPUT``, ``WEIGHT`` or ``GRAD_OUTPUT``); its statistics are
            recorded in that row of the layer's state.
        dtype: the FP8 dtype.
        granularity: ``"tensor"`` (one scale), ``"row"`` (one scale per slice along ``axis``) or ``"block"``
            (one scale per ``block`` of the 2-D tensor).
        axis: for ``"row"``: the dimension the scales are computed *along* (the GEMM's reduction
            dimension in the tensor's own layout): ``-1`` gives one scale per row, shape ``(M, 1)``;
            ``0`` one per column, shape ``(1, N)``. ``None`` for ``"tensor"`` and ``"block"``.
        block: for ``"block"``: the block shape ``(rows, columns)`` in the tensor's own layout (``(1, 128)``: a
            tile along the rows, for a reduction over the last dimension; ``(128, 1)``: along the columns, for a
            reduction over the first). The scales then have shape ``(ceil(R / rows), ceil(C / columns))``.
        scale_format: ``"float32"``, or ``"e8m0"`` (a power of two that the hardware GEMM receives as an E8M0
            decoding scale: ``mxfp8``).
        scale_source: ``"current"`` (the tensor's own amax) or ``"history"`` (the amax history, falling
            back to the current amax while the history is empty).
        margin: the scale is divided by ``2**margin``.
        power_of_2: the scale is rounded down to a power of two.
    """

    role: int
    dtype: torch.dtype
    granularity: Literal["tensor", "row", "block"] = "tensor"
    axis: int | None = None
    scale_source: Literal["current", "history"] = "current"
    margin: int = 0
    power_of_2: bool = False
    block: tuple[int, int] | None = None
    scale_format: Literal["float32", "e8m0"] = "float32"

    def transposed_block(self) -> tuple[int, int] | None:
        """``block`` for the transposed tensor (``None`` outside ``"block"`` granularity)."""
        return None if self.block is None else (self.block[1], self.block[0])

    @property
    def fp8_max(self) -> float:
        """The largest finite value of ``dtype``."""
        return fp8_max(self.dtype)

    def same_cast(self, other: CastSpec) -> bool:
        """Whether ``other`` quantizes the same tensor to the same bits (so one FP8 copy serves both)."""
        return self == other


@dataclass(frozen=True)
class LinearCastSpecs:
    """The cast specs of the six operands of a linear layer's three GEMMs (``(a, b)`` of ``a @ b``).

    Derived once (the layers read them on every forward): ``history_scaled`` (some operand takes its scale from
    the amax history), ``input_reused`` / ``weight_reused`` (the backward casts the input / weight as the
    forward did, so the forward's FP8 copy serves it), ``grad_output_reused`` (both backward GEMMs cast the
    gradient the same way).
    """

    forward: tuple[CastSpec, CastSpec]  # input (M, K), weight (N, K)
    grad_input: tuple[CastSpec, CastSpec]  # grad_output (M, N), weight (N, K)
    grad_weight: tuple[CastSpec, CastSpec]  # grad_output (M, N), input (M, K)
    history_scaled: bool = dataclasses.field(init=False)
    input_reused: bool = dataclasses.field(init=False)
    weight_reused: bool = dataclasses.field(init=False)
    grad_output_reused: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        pairs = (self.forward, self.grad_input, self.grad_weight)
        derived = {
            "history_scaled": any(spec.scale_source == "history" for pair in pairs for spec in pair),
            "input_reused": self.grad_weight[1].same_cast(self.forward[0]),
            "weight_reused": self.grad_input[1].same_cast(self.forward[1]),
            "grad_output_reused": self.grad_weight[0].same_cast(self.grad_input[0]),
        }
        for key, value in derived.items():
            object.__setattr__(self, key, value)


@dataclass(frozen=True)
class FP8Recipe:
    """How a layer chooses its FP8 scales. Plain-typed and frozen, so it can live in yaml.

    Fields left at ``None`` take the recipe's own default; a field the recipe does not use raises.

    Args:
        name: ``"tensorwise"`` (current scaling), ``"delayed"`` (amax history), ``"rowwise"``, ``"blockwise"``
            (DeepSeek-V3 1×128 tiles and 128×128 weight blocks) or ``"mxfp8"`` (OCP MXFP8 blocks of 32).
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``. Default: ``"hybrid"``
            for ``tensorwise`` and ``delayed``, ``"e4m3"`` for ``mxfp8``; ``rowwise`` and ``blockwise`` use
            ``"e4m3"`` only.
        amax_history_len: length of the per-tensor amax ring buffer (every recipe keeps one for the
            statistics; ``delayed`` also derives its scale from it).
        amax_compute_algo: ``"max"`` (default) or ``"most_recent"``: how ``delayed`` reduces the
            history. ``delayed`` only.
        margin: ``delayed`` divides its scale by ``2**margin``. ``delayed`` only.
        power_of_2_scale: round every scale down to a power of two. Default: ``True`` for
            ``rowwise``, ``False`` otherwise; ``mxfp8`` scales are always powers of two (``False`` raises).

    Raises:
        ValueError: naming the field and the valid values, for any invalid or unused setting.
    """

    name: RecipeName = "tensorwise"
    fp8_format: FP8Format | None = None
    amax_history_len: int = 16
    amax_compute_algo: AmaxComputeAlgo | None = None
    margin: int = 0
    power_of_2_scale: bool | None = None

    def __post_init__(self) -> None:
        _check_choice("recipe", self.name, RECIPES)
        if self.fp8_format is not None:
            _check_choice("fp8_format", self.fp8_format, FORMATS)
        if self.amax_compute_algo is not None:
            _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}")
        if self.power_of_2_scale is not None and not isinstance(self.power_of_2_scale, bool):
            raise ValueError(f"power_of_2_scale must be a bool (or None for the recipe's default), got {self.power_of_2_scale!r}")
        if self.name != "delayed":
            hint = "only recipe='delayed' uses it (it shapes the scale derived from the amax history); remove it"
            if self.margin:
                raise _unused("margin", self.margin, self.name, hint + " or use recipe='delayed'")
            if self.amax_compute_algo is not None:
                raise _unused("amax_compute_algo", self.amax_compute_algo, self.name, hint + " or use recipe='delayed'")
        if self.name in _E4M3_ONLY and self.fp8_format == "hybrid":
            kind = "row-wise" if self.name == "rowwise" else "block-scaled (1x128 / 128x128)"
            raise _unused(
                "fp8_format",
                "hybrid",
                self.name,
                f"the {kind} FP8 GEMM takes E4M3 operands only, so {self.name} always uses 'e4m3'; leave fp8_format "
                "unset (None) or set it to 'e4m3'",
            )
        if self.name == "mxfp8" and self.power_of_2_scale is False:
            raise _unused(
                "power_of_2_scale",
                False,
                "mxfp8",
                "MXFP8 scales are E8M0, powers of two by definition; leave power_of_2_scale unset (None) or True, "
                "or use recipe='blockwise' for float32 block scales",
            )
        # Resolve the recipe's defaults, so equal configurations compare (and checkpoint) equal.
        e4m3_default = self.name in _E4M3_ONLY or self.name == "mxfp8"
        pow2_default = self.name in ("rowwise", "mxfp8")
        resolved = {
            "fp8_format": self.fp8_format or ("e4m3" if e4m3_default else "hybrid"),
            "amax_compute_algo": (self.amax_compute_algo or "max") if self.name == "delayed" else None,
            "power_of_2_scale": pow2_default if self.power_of_2_scale is None else self.power_of_2_scale,
        }
        for key, value in resolved.items():
            object.__setattr__(self, key, value)

    @property
    def round_to_power_of_2(self) -> bool:
        """Whether scales are rounded down to a power of two."""
        return bool(self.power_of_2_scale)

    def dtype(self, role: int) -> torch.dtype:
        """FP8 dtype for ``role`` (``INPUT``, ``WEIGHT`` or ``GRAD_OUTPUT``)."""
        return E5M2 if role == GRAD_OUTPUT and self.fp8_format == "hybrid" else E4M3

    def cast_specs(self) -> LinearCastSpecs:
        """The :class:`CastSpec` of each operand of the three GEMMs of a linear layer (see the module docstring)."""
        specs = _CAST_SPECS.get(self)
        if specs is None:
            specs = _CAST_SPECS[self] = _cast_specs(self)
        return specs

    def to_dict(self) -> dict[str, Any]:
        """Plain-value form (defaults resolved), stored next to the FP8 state so a mismatched checkpoint is detected."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], legacy: bool = False) -> FP8Recipe:
        """Inverse of ``to_dict()``. With ``legacy=True``, reads the form written by lightning-fp8 0.1, which stored
        the settings a recipe ignored (such as ``amax_compute_algo`` for ``tensorwise``) and always rounded
        ``rowwise`` scales to powers of two."""
        values = dict(values)
        if not legacy:
            return cls(**values)
        name = values.get("name", "tensorwise")
        if name != "delayed":
            values["amax_compute_algo"] = None
            values["margin"] = 0  # 0.1 accepted and ignored it
        if name == "rowwise":
            values["fp8_format"] = "e4m3"  # 0.1 accepted "hybrid" and used E4M3
            values["power_of_2_scale"] = True  # 0.1 always rounded rowwise scales
        return cls(**values)


_CAST_SPECS: dict[FP8Recipe, LinearCastSpecs] = {}


def _cast_specs(recipe: FP8Recipe) -> LinearCastSpecs:
    dtype = recipe.dtype
    pow2 = recipe.round_to_power_of_2
    if recipe.name in BLOCK_RECIPES:
        tile = BLOCKWISE_TILE if recipe.name == "blockwise" else MX_BLOCK
        scale_format: Literal["float32", "e8m0"] = "e8m0" if recipe.name == "mxfp8" else "float32"

        def block(role: int, shape: tuple[int, int]) -> CastSpec:
            return CastSpec(role, dtype(role), "block", None, "current", 0, pow2, shape, scale_format)

        along_rows, along_columns = (1, tile), (tile, 1)  # reduction over the last / the first dimension
        weight = (tile, tile) if recipe.name == "blockwise" else None
        return LinearCastSpecs(
            forward=(block(INPUT, along_rows), block(WEIGHT, weight or along_rows)),
            grad_input=(block(GRAD_OUTPUT, along_rows), block(WEIGHT, weight or along_columns)),
            grad_weight=(block(GRAD_OUTPUT, along_columns), block(INPUT, along_columns)),
        )
    if recipe.name == "rowwise":

        def spec(role: int, axis: int) -> CastSpec:
            return CastSpec(role, dtype(role), "row", axis, "current", 0, pow2)

        return LinearCastSpecs(
            forward=(spec(INPUT, -1), spec(WEIGHT, -1)),
            grad_input=(spec(GRAD_OUTPUT, -1), spec(WEIGHT, 0)),
            grad_weight=(spec(GRAD_OUTPUT, 0), spec(INPUT, 0)),
        )
    source: Literal["current", "history"] = "history" if recipe.name == "delayed" else "current"
    x, w, g = (CastSpec(role, dtype(role), "tensor", None, source, recipe.margin, pow2) for role in (INPUT, WEIGHT, GRAD_OUTPUT))
    return LinearCastSpecs(forward=(x, w), grad_input=(g, w), grad_weight=(g, x))


def resolve_recipe(recipe: FP8Recipe | str | None, **overrides: object) -> FP8Recipe:
    """Turn a recipe name (or ``None`` for the default) into an :class:`FP8Recipe`."""
    if recipe is None:
        return FP8Recipe(**overrides)  # type: ignore[arg-type]
    if isinstance(recipe, FP8Recipe):
        return dataclasses.replace(recipe, **overrides) if overrides else recipe
    if isinstance(recipe, str):
        return FP8Recipe(name=recipe, **overrides)  # type: ignore[arg-type]
    raise ValueError(f"recipe must be one of {list(RECIPES)} or an FP8Recipe, got {recipe!r}")


def amax_to_scale(
    amax: torch.Tensor, fp8_max: float | torch.Tensor, margin: int = 0, power_of_2: bool = False
) -> torch.Tensor:
    """``scale = fp8_max / max(amax, eps) / 2**margin``, in float64, rounded toward zero to float32.

    ``fp8_max`` may be a float64 tensor that broadcasts against ``amax`` (one maximum per role).

    Computing the reciprocal in float64 makes eager and ``torch.compile`` agree bit for bit (they round
    a float32 division differently). Rounding toward zero keeps ``amax * scale <= fp8_max`` in float32
    arithmetic, so the tensor's own amax is never counted as an overflow (round-to-nearest pushes it
    one ulp past ``fp8_max`` in a few percent of casts). A NaN amax gives a NaN scale, an infinite
    amax a zero scale; callers decide what to do with those.

    With ``power_of_2`` the scale is rounded down to a power of two: the largest power of two not above that float32
    scale, which is the largest one not above the float64 quotient itself (rounding toward zero to float32 cannot
    cross a power of two, each being a float32; below float32's smallest subnormal both give zero). So it is the
    quotient with its mantissa bits cleared (exact: a float64 power of two), then converted to float32 (exact down
    to 2**-149; 2**-150 and below round to zero). A NaN quotient would become an infinity: adding ``quotient * 0``
    (zero, or NaN) keeps it NaN. Eight operations where rounding to float32 and then to a power of two took sixteen
    (eager on a GPU each is a kernel launch); ``tests/test_recipe.py`` checks that the two give the same bits.
    """
    exact = fp8_max / torch.clamp(amax.to(torch.float64), min=amax_eps())
    if margin:
        exact = exact / (2.0**margin)
    if power_of_2:
        exact = exact.to(torch.float64)  # already (a float32 tensor fp8_max, outside the contract, would not be)
        power = (exact.view(torch.int64) & _FLOAT64_EXPONENT_BITS).view(torch.float64)
        return stored((power + exact * 0.0).to(torch.float32))
    scale = exact.to(torch.float32)
    scale = torch.where(scale.to(torch.float64) > exact, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    return stored(scale)


#: The sign and exponent bits of a float64 (its 52 mantissa bits cleared): ``x & mask`` is ``x`` rounded down to a
#: power of two, for a positive normal ``x``.
_FLOAT64_EXPONENT_BITS = -(1 << 52)


def stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself; under ``torch.compile``, a tensor that inductor computes once into its own buffer.

    Inductor inlines a chain of elementwise operations into every loop that reads its result. A scale is derived
    from its amax by a dozen such operations (float64 division, round toward zero, power-of-two rounding), and its
    readers are loops over the data: the cast, and the GEMM's output scaling, which reads a per-column scale once per
    output element. Inlined there, the scale formula ran once per data element instead of once per scale (on a CPU,
    most of the gap between the compiled ``rowwise`` step and torchao's). Used for the small per-tensor, per-row or
    per-block tensors derived from amaxes, and for data that many reads would otherwise inline (the input of the
    rounding formula, :func:`_rounded_compiled`; a padded block-recipe input; FP8 data read by several loops).

    An identity ``as_strided`` view of a clone is the barrier: inductor's lowering of ``as_strided`` needs a stored
    input (eager, it is skipped; a tensor subclass such as a ``DTensor`` is left alone). The clone matters when ``t``
    is a view (a slice, an expanded or strided tensor): applied to a view of a buffer inductor computed, the lowering
    reads that buffer with the view's strides and without its offset, wrong values without an error.

    Known wrong, not fixed: a view of one element at an offset (``y[1, 1]``, ``y[1, 1:2]`` of a computed ``y``)
    reads the buffer's first element compiled (torch 2.13: inductor drops the clone of a view whose sizes and strides
    equal the clone's, not comparing the offset). No caller in this package passes one (scales are computed tensors,
    biases are parameters); copying such tensors by ``t * 1.0`` instead fixed it but changed what the compiled
    ``delayed`` layers save for backward (an FP8 copy kept), so it was not kept.
    """
    if torch.compiler.is_compiling() and type(t) is torch.Tensor:
        t = t.clone()
        return t.as_strided(t.shape, t.stride())
    return t


#: the tensor types :func:`rounded_to` rounds through their bits (a subclass such as a ``DTensor`` converts as it does)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: the 16-bit dtypes whose roundings inductor may skip (see :func:`rounded_to`)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def rounded_to(
    x: torch.Tensor, dtype: torch.dtype, *, store: bool = False, rounded_gradient: bool = False
) -> torch.Tensor:
    """``x.to(dtype)`` (``x`` float32 or 16-bit), for a 16-bit ``dtype`` rounded also where inductor would not.

    Inductor computes fused bfloat16 and float16 arithmetic in float32, and when a consumer in the same kernel reads
    a value converted to one of them, it reads the float32 value: the conversion's rounding is skipped (unless the
    global ``torch._inductor.config.emulate_precision_casts`` is set). That is its design for ordinary operations, but
    four conversions define what an FP8 layer computes:

    * an emulated GEMM's output: it stands for a kernel that writes its output rounded to ``out_dtype`` (compiled,
      the emulation's result flowed unrounded into the bias or the upcast to float32);
    * under autocast, the bias, which ``nn.Linear`` hands to its GEMM in the autocast dtype (and its gradient, a
      16-bit sum over the tokens);
    * in 16 bits, the layer's output with its bias added, which the next FP8 layer's cast reads (``x`` of ``dtype``
      itself: the value as stored);
    * under autocast, the input of the recipes that cast what the GEMM would compute with (``rowwise``, the block
      recipes).

    Compiled on a machine without FP8 GEMMs, a step gave other numbers than the same step run eagerly, for every
    recipe (one ``FP8Linear`` in float32 with ``rowwise``, whose GEMM outputs bfloat16: outputs apart by up to 0.004,
    weight gradients by 0.85, from the first step; in bfloat16 or float16, every recipe). Compiling, the conversion
    is written so that the consumer reads the rounded value, in one of two ways:

    * for inductor's C++ backend (a CPU tensor), in float32 arithmetic: :func:`_rounded_in_float32` computes the
      rounded value from operations inductor keeps (multiplications, additions, comparisons); the conversion that
      follows is exact;
    * for Triton (a GPU tensor), through the bits: the converted value viewed as ``int16``, OR-ed with zero (an
      integer operation, which only the rounded 16 bits can feed) and viewed back. (Triton may contract the float32
      formula's multiply and subtract into one fused multiply-add, which would break it.) On a CPU the float32
      formula replaces the bit view because inductor's C++ backend does not vectorize ``int16`` (it is not among
      its ``VECTORIZABLE_DTYPES``): every loop fused with the view ran as scalar code (a 1024 x 1024 rounding with
      an amax, one thread, this AMD EPYC: 0.88 ms through the bits, 0.23 ms through the formula, 0.10 ms unrounded).
      Nor through float32's bits as ``int32`` (round half to even by an integer addition, which it vectorizes, checked
      exact over all 2**32 values): inductor lowers the bit view itself as a store, a scalar loop and a load, which
      the C++ compiler folds away in 16-lane loops but not in the 32-lane loops of a kernel that also holds 16-bit
      values, as the FP8 layers' kernels do (a compiled 256 x 128 GEMM output scaled and rounded to bfloat16: 35 us
      through the ``int32`` bits, 19 us through the formula, 12.5 us unrounded).

    With ``store``, compiled, the rounded tensor is computed once into its own 16-bit buffer (:func:`stored`) instead
    of being recomputed, from ``x``, in every loop that reads it: for a tensor that several loops read, as the input
    of ``rowwise`` and the block recipes (its two amaxes, its row-wise and its column-wise cast). On this CPU (AMD
    EPYC, one thread), one compiled ``rowwise`` layer's forward kernel (256 x 448 tokens x features) went from 0.26
    to 0.21 ms, and in ``benchmarks/bench_llama.py`` the compiled ``rowwise`` step of the tiny / small stacks from
    1.26 / 1.17 to 1.20 / 1.10 times torchao's ``rowwise``. The gradient passes through as it does without
    ``store``. Only where inductor's C++ backend compiles (a CPU): the float32 formula is a dozen operations per
    element there, while Triton's rounding is a view of the bits, which a loop recomputes for free; stored for Triton,
    the Llama3-8B-shaped ``rowwise`` block's backward took 138 kernel launches instead of 133 and about 1.6 % more
    bytes (``benchmarks/gpu_kernels.py``'s estimate; the H200 measured ``rowwise`` without the store).

    With ``rounded_gradient``, compiled, the gradient is taken as already rounded to ``dtype``: the caller's consumer
    of the result is an FP8 layer whose backward hands back its input gradient rounded (a GEMM's output, of
    ``dtype`` or converted to it by :func:`rounded_to`), and rounding it a second time, a full pass of the formula
    over the gradient, changed no bit. ``FP8Linear`` passes it for ``rowwise`` only. Measured on this AMD EPYC, one
    thread, ``benchmarks/bench_llama.py --cold-compile`` at the tiny size: ``rowwise``'s cold compile 92 -> 55 s and
    99 -> 58 s (two runs), its compiled step the same within the run-to-run spread (15.6 -> 15.1 and 16.0 -> 16.1
    ms; one compiled layer alone, 256 x 448 input, 128 outputs: 1.41-1.43 -> 1.36-1.39 ms); for ``blockwise`` the
    compiled step grew by 7-11% (23.5 -> 25.2 and 24.0 -> 26.7 ms; its fused kernels 5.6 -> 7.0 ms per block:
    inductor fuses the backward otherwise), so the block recipes keep the second rounding. Without it, the gradient
    is rounded (see :class:`_RoundedCompiled`).

    ``tests/test_compiled_rounding.py`` checks the compiled result against ``.to`` on every float32 class, so a torch
    that simplified either away would fail it. The gradient is ``x.to(dtype)``'s. Eager (and for a tensor subclass
    such as a ``DTensor``) this is ``x.to(dtype)``, ``store`` or not.
    """
    # a 16-bit x of the other 16-bit dtype (a bfloat16 input under float16 autocast) is rounded too: x.float() is
    # exact, and inductor would skip the conversion between the two as it skips any other
    direct = x.dtype not in (torch.float32, *SIXTEEN_BIT) or dtype not in SIXTEEN_BIT or type(x) not in _PLAIN
    if direct or not torch.compiler.is_compiling():
        return x.to(dtype)
    if x.requires_grad and torch.is_grad_enabled():
        return _RoundedCompiled.apply(x, dtype, store, rounded_gradient)
    return _rounded_compiled(x, dtype, store)


def _rounded_compiled(x: torch.Tensor, dtype: torch.dtype, store: bool = False) -> torch.Tensor:
    """``x`` (float32 or 16-bit) converted to ``dtype``, its rounding kept by inductor (and, with ``store``, for
    inductor's C++ backend, in a buffer of its own): see :func:`rounded_to`. For ``x`` of ``dtype`` (the value as
    stored), inductor's ``x.float()`` is the unrounded float32 value it kept.

    For inductor's C++ backend the formula's input is :func:`stored`: the formula reads it about two dozen times
    (comparisons, both branches, the split), and inductor inlines an elementwise input into every read, so each formula
    in a chain multiplied the operations it traces by that: an FP8 layer's biased output (the bias rounded, added, the
    sum rounded) read by the next layer's cast traced loop bodies of 25,000 operations (16 tokens), and one
    tensor-parallel pair of biased layers (``tests/test_compiled_rounding.py``) spent about 70 s of its compiled
    backward's 77 s in inductor's code generation, this AMD EPYC. Stored, that backward compiles in about 5 s. The
    buffer is dropped where all its readers fuse into one loop (inductor removes a buffer a single kernel writes and
    reads): on the Llama stack of ``benchmarks/bench_llama.py`` (tiny, compiled, one thread) the steps of every recipe
    stayed within the run-to-run spread."""
    if inductor_cpp_backend(x.device.type):
        rounded = _rounded_in_float32(stored(x.float()), dtype).to(dtype)
        return stored(rounded) if store else rounded
    return _through_bits(x.to(dtype))  # the bit view: recomputed in each reading loop at no cost (see rounded_to)


@torch.compiler.assume_constant_result
def inductor_cpp_backend(device_type: str) -> bool:
    """Whether inductor compiles code for tensors of ``device_type`` with its C++ backend (a CPU tensor, unless
    ``torch._inductor.config.cpu_backend`` asks for Triton), where the compiled roundings take another form than in
    Triton: see :func:`rounded_to`. A constant to ``torch.compile``; ``benchmarks/compiled_saved.py`` replaces it
    to build a GPU's graphs on a CPU."""
    from torch._inductor import config

    return device_type == "cpu" and config.cpu_backend == "cpp"


def _through_bits(y: torch.Tensor) -> torch.Tensor:
    """``y`` (bfloat16 or float16) as read from its own 16 bits: see :func:`rounded_to`."""
    return (y.view(torch.int16) | 0).view(y.dtype)


#: per 16-bit dtype, for :func:`_rounded_in_float32`: Veltkamp's multiplier ``2**(24 - p) + 1`` (``p`` the dtype's
#: significand bits), its smallest normal magnitude, the constant ``M`` whose float32 spacing is its subnormal spacing,
#: and the magnitude from which it overflows to infinity (None for bfloat16, whose range is float32's)
_ROUNDING = {
    torch.bfloat16: (65537.0, 2.0**-126, 1.5 * 2.0**-110, None),
    torch.float16: (8193.0, 2.0**-14, 0.75, 65520.0),
}


@torch.compiler.assume_constant_result
def _rounding_constants(dtype: torch.dtype) -> tuple[float, float, float, float | None]:
    """``_ROUNDING[dtype]``, read as constants under ``torch.compile`` (see :func:`fp8_max`: with ``dynamic=True``
    the floats read from the dict inside :class:`_RoundedCompiled` became symbolic inputs that dynamo cannot lift,
    and a biased layer under autocast failed to compile; ``tests/test_compile_dynamic.py``)."""
    return _ROUNDING[dtype]


def _rounded_in_float32(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``x`` rounded to the nearest ``dtype`` value, ties to even, as ``x.to(dtype)`` rounds, kept in float32:
    float32 values and float32 arithmetic only, which inductor's C++ backend vectorizes (see :func:`rounded_to`).

    Every operation is one correctly rounded float32 operation (ties to even). With ``p`` the significand bits of
    ``dtype`` (8 for bfloat16, 11 for float16) and ``a = |x|``:

    * normal magnitudes, Veltkamp's split: ``c = x * (2**(24 - p) + 1)``; ``c - (c - x)`` is ``x`` rounded to ``p``
      significant bits, ties to even. ``c`` must not overflow: for bfloat16, ``a >= 2**100`` is scaled by
      ``2**-32`` first and the result back by ``2**32`` (exact, powers of two; a rounding up to ``2**128`` gives
      infinity, as the conversion does);
    * below the smallest normal magnitude of ``dtype``, whose subnormals are spaced ``2**e`` apart (``2**-133``,
      ``2**-24``): ``(a + M) - M`` with ``M = 1.5 * 2**(e + 23)``, whose float32 spacing is ``2**e``, signed as ``x``
      (``copysign`` keeps ``-0.0``);
    * infinities are kept; NaN stays NaN; for float16, ``a >= 65520`` (its largest value, 65504, plus half a step)
      is the infinity of ``x``'s sign.

    Checked exhaustively on this CPU: for each of the 2**32 float32 bit patterns, eager and compiled by inductor, and
    for both dtypes, bit for bit ``x.to(dtype).float()`` (NaNs: NaN). ``tests/test_compiled_rounding.py`` samples
    every class.
    """
    split, smallest_normal, magic, overflow = _rounding_constants(dtype)
    a = x.abs()
    if overflow is None:  # bfloat16: the largest magnitudes scaled down, so that the split cannot overflow
        large = a >= 2.0**100
        scaled = torch.where(large, x * 2.0**-32, x)
        c = scaled * split
        rounded = c - (c - scaled)
        rounded = torch.where(a == float("inf"), x, torch.where(large, rounded * 2.0**32, rounded))
    else:
        c = x * split
        rounded = torch.where(a >= overflow, torch.copysign(torch.full_like(x, float("inf")), x), c - (c - x))
    return torch.where(a < smallest_normal, torch.copysign((a + magic) - magic, x), rounded)


class _RoundedCompiled(torch.autograd.Function):
    """:func:`rounded_to` for a tensor that needs a gradient, which is ``x.to(dtype)``'s: the upcast gradient (the
    bit view carries none). Inside the FP8 GEMMs, which compute no gradients of their own, no Function is traced."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, dtype: torch.dtype, store: bool, rounded_gradient: bool
    ) -> torch.Tensor:
        ctx.x_dtype, ctx.rounded_gradient = x.dtype, rounded_gradient
        # stored here, inside the Function, so that the gradient is this backward's: outside, the identity
        # as_strided view would differentiate as as_strided does (a zero-filled buffer, scattered into: a full-size
        # extra pass in the compiled backward, measured on one rowwise layer)
        return _rounded_compiled(x, dtype, store)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        # the incoming gradient as eager has it, rounded (a bias's: a 16-bit sum over the tokens, which inductor
        # would otherwise upcast unrounded), unless the caller's consumer rounded it (rounded_gradient)
        if grad.dtype in SIXTEEN_BIT and not ctx.rounded_gradient:
            grad = _rounded_compiled(grad, grad.dtype)
        return grad.to(ctx.x_dtype), None, None, None
