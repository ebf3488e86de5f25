"""lightning-fp8: FP8 training for PyTorch Lightning.

Public API:

* :class:`FP8Precision`: the Trainer precision plugin (``lightning_fp8.fabric.FP8Precision`` for Fabric);
* :class:`FP8StatsCallback`: FP8 health statistics to any Lightning logger; :class:`FP8Stats`: the same
  statistics for a Fabric or plain PyTorch loop;
* :class:`FP8FallbackCallback`: switch layers that keep overflowing to high precision for the rest of a run;
* :class:`FP8Linear`, :func:`fp8_autocast`: the FP8 layer and the region it computes in FP8;
  :func:`weights_may_have_changed`: after changing weights through ``.data`` within an optimizer step;
* :func:`convert_to_fp8`, :func:`convert_from_fp8`, :class:`ConversionReport`: swapping layers;
* :func:`sensitivity_report`, :class:`FP8SensitivityCallback`: which layers should stay in high precision;
* :class:`FP8Recipe`: the scaling recipes (``tensorwise``, ``delayed``, ``rowwise``) and formats;
  :func:`calibrate`: fill the ``delayed`` amax histories from a few batches before training;
* :func:`prepare_for_sharding`: convert a model before FSDP2 / tensor parallelism shards it, with FP8 weight all-gather;
  :class:`FP8ColwiseParallel`, :class:`FP8RowwiseParallel`: torch's tensor-parallel styles for FP8 layers;
* :func:`fp8_state_dict`, :func:`load_fp8_state_dict`, :func:`roll_amax_history`: the device-side
  FP8 state of a model (:mod:`lightning_fp8.state`).
"""

from lightning_fp8.calibration import calibrate
from lightning_fp8.callbacks import FP8StatsCallback
from lightning_fp8.convert import ConversionReport, convert_from_fp8, convert_to_fp8
from lightning_fp8.distributed import FP8ColwiseParallel, FP8RowwiseParallel
from lightning_fp8.fabric import prepare_for_sharding
from lightning_fp8.fallback import FP8FallbackCallback
from lightning_fp8.gemm import gemm_path
from lightning_fp8.linear import FP8Linear, weights_may_have_changed
from lightning_fp8.precision import FP8Precision
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.region import fp8_autocast, is_fp8_autocast_enabled
from lightning_fp8.sensitivity import FP8SensitivityCallback, SensitivityReport, sensitivity_report
from lightning_fp8.state import fp8_state_dict, load_fp8_state_dict, roll_amax_history
from lightning_fp8.stats import FP8Stats

__version__ = "0.1.0"

__all__ = [
    "ConversionReport",
    "FP8ColwiseParallel",
    "FP8FallbackCallback",
    "FP8Linear",
    "FP8Precision",
    "FP8RowwiseParallel",
    "FP8Stats",
    "FP8StatsCallback",
    "FP8Recipe",
    "FP8SensitivityCallback",
    "SensitivityReport",
    "calibrate",
    "convert_from_fp8",
    "convert_to_fp8",
    "fp8_autocast",
    "fp8_state_dict",
    "gemm_path",
    "is_fp8_autocast_enabled",
    "load_fp8_state_dict",
    "prepare_for_sharding",
    "roll_amax_history",
    "sensitivity_report",
    "weights_may_have_changed",
]

#: the oldest torch the test suite passes on (pyproject.toml's requirement)
_OLDEST_TESTED_TORCH = (2, 11)


def _warn_if_torch_is_untested(version: str | None = None) -> None:
    """Warn when torch (or ``version``) is older than :data:`_OLDEST_TESTED_TORCH`, installed against pip's
    requirement: the suite fails there, loudly or worse (torch 2.10: ``torch.compile`` of FP8 layers fails with
    dynamic shapes and for blocks compiled one by one; torch 2.8: a compiled ``rowwise`` layer crashed the process in
    inductor's code). Compares the release numbers only: a pre-release or vendor build of 2.11 (``2.11.0a0+...``, as
    NVIDIA's containers ship) counts as 2.11; a version that does not parse is not warned about."""
    import warnings

    import torch

    from lightning_fp8.linear import _torch_version

    version = str(torch.__version__) if version is None else version
    release = _torch_version(version)
    if release is not None and release < _OLDEST_TESTED_TORCH:  # None: a local build's own string, nothing to compare
        oldest = ".".join(map(str, _OLDEST_TESTED_TORCH))
        warnings.warn(
            f"lightning-fp8 is tested with torch {oldest} and newer, and this is torch {version}: on older torch, "
            "torch.compile of FP8 layers fails (torch 2.10) or crashes (torch 2.8, rowwise). "
            f"Upgrade torch to {oldest} or newer.",
            stacklevel=2,
        )


_warn_if_torch_is_untested()
