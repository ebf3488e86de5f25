"""Deprecated: the casts moved to :mod:`lightning_fp8.quantize` (``quantize(x, spec)`` for every recipe).

This module re-exports the cast functions of lightning-fp8 0.1 and warns on import; it will be removed
in the next minor release. ``quantize_tensorwise`` and ``quantize_rowwise`` are replaced by
``quantize(x, spec)`` with a :class:`~lightning_fp8.recipe.CastSpec`.
"""

import warnings

from lightning_fp8.quantize import cast_statistics, cast_with_statistics, saturated_cast  # noqa: F401

warnings.warn(
    "lightning_fp8.cast is deprecated: import from lightning_fp8.quantize instead", DeprecationWarning, stacklevel=2
)
