"""Deprecated: the FP8 state moved to :mod:`lightning_fp8.state` (one state table per model).

This module re-exports the names of lightning-fp8 0.1 that still exist and warns on import; it will be
removed in the next minor release. The per-layer buffer helpers of 0.1 (``init_state``, ``state_of``,
``record_cast``, ``STATE_BUFFERS``) are gone: a layer's state is a row of its table (``layer.fp8_state``).
"""

import warnings

from lightning_fp8.state import (  # noqa: F401
    COUNT_FIELDS,
    NONZERO,
    OVERFLOW,
    SEEN,
    UNDERFLOW,
    fp8_modules,
    fp8_state_dict,
    load_fp8_state_dict,
    roll_amax_history,
)

warnings.warn(
    "lightning_fp8.scaling is deprecated: import from lightning_fp8 or lightning_fp8.state instead",
    DeprecationWarning,
    stacklevel=2,
)
