"""Test utilities: counting device-to-host synchronisations, saved-tensor bytes."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fp8.linear import _torch_version

# Ops that copy a device value to the host (``.item()``, ``bool(tensor)``, ``.tolist()`` go through them).
SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal"}


class SyncCounter(TorchDispatchMode):
    """Counts device-to-host synchronising ops dispatched inside the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in SYNC_OPS:
            self.count += 1
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@functools.cache
def _trainer_dirs() -> str:
    """One temporary folder per process for the Trainers' ``default_root_dir``, removed when the process exits."""
    path = tempfile.mkdtemp(prefix="lightning_fp8_test_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def make_trainer(plugin=None, **kwargs) -> L.Trainer:
    """A quiet CPU Trainer: no progress bar, summary, checkpointing, sanity check, or logger unless given; its
    ``default_root_dir`` is a fresh temporary folder unless given (end-of-fit files never land in the checkout; the
    folders are removed when the test process exits)."""
    defaults = dict(
        default_root_dir=tempfile.mkdtemp(dir=_trainer_dirs()),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    if plugin is not None:
        defaults["plugins"] = [plugin]
    return L.Trainer(**defaults)


def per_layer(fp8_state: dict) -> dict[str, dict]:
    """An ``fp8_state_dict`` export as ``{layer name: {field: tensor}}`` (the rows of its tables)."""
    from lightning_fp8.state import fp8_state_layer_names, layer_state

    return {name: layer_state(fp8_state, name) for name in fp8_state_layer_names(fp8_state)}


def gloo_check_folder(run, check: str) -> Path:
    """The folder of ``check`` in a run of tests/scripts/gloo_checks.py started by conftest's ``gloo_runs`` (an
    ``EarlyResult``): gloo_checks.py's ``folder`` rule."""
    return Path(run.workdir) / "checks" / check.replace("/", "__").replace(",", "-")


def bench_result(tmp_path_factory, name: str, command: str, measure) -> dict:
    """A benchmark's result as its script writes it: ``measure()`` (the script's measurement code, returning the
    result's fields) run on one torch thread (steadier on a loaded machine), then dynamo reset, the fields written with
    the environment by ``benchmarks/harness.py`` under ``command`` and read back from the file."""
    import json

    import harness  # benchmarks/ is on sys.path in the benchmark tests
    import torch

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = measure()
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    path = tmp_path_factory.mktemp(name) / f"{name}.json"
    harness.write_result(str(path), harness.environment(), command, **data)
    return json.loads(path.read_text())


def reference_amax_bins(amax) -> "torch.Tensor":
    """The amax histogram (``lightning_fp8.quantize.amax_bins``) counted in Python, one value at a time, by the
    documented bin rule (of the magnitude: a negative value, which no amax is, lands where its absolute value does)."""
    import math

    import torch

    from lightning_fp8.quantize import AMAX_BIN_HIGH, AMAX_BIN_LOW, N_AMAX_BINS

    counts = [0] * N_AMAX_BINS
    for value in amax.reshape(-1).tolist():
        if not math.isfinite(value):
            counts[-1] += 1
        elif value == 0:
            counts[0] += 1
        else:
            counts[1 + min(max(math.floor(math.log2(abs(value))), AMAX_BIN_LOW), AMAX_BIN_HIGH) - AMAX_BIN_LOW] += 1
    return torch.tensor(counts, dtype=torch.int64)


#: for the tests whose reference for the GPU's row-wise GEMM is torch's own kernel run on the CPU: torch's CPU
#: ``torch._scaled_mm`` takes row-wise scales from torch 2.13 (before: "only supports per-tensor scaling for CPU
#: backend"). By version, not by trying it: a newer torch that broke it must fail these tests, not skip them; a
#: version string with no release in it (a local build's own) counts as new, for the same reason.
needs_cpu_rowwise_scaled_mm = pytest.mark.skipif(
    (_torch_version() or (2, 13)) < (2, 13), reason="torch's CPU _scaled_mm takes row-wise scales from torch 2.13"
)
