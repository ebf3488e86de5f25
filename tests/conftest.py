import json
import os
import signal
import subprocess
import sys
from pathlib import Path

# Keep the suite deterministic and light on a 2-core CPU machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Idle OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning threads slow steps ~6x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def assert_cuda_scaled_mm_contract(a, b, scale_a, scale_b, out_dtype):
    """CUDA ``torch._scaled_mm``'s operand rules, written independently of ``lightning_fp8.gemm``."""
    assert a.dim() == 2 and b.dim() == 2, "operands must be 2-D"
    assert a.dtype in _FP8 and b.dtype in _FP8, (a.dtype, b.dtype)
    assert not (a.dtype == b.dtype == torch.float8_e5m2), "e5m2 x e5m2"
    m, k = a.shape
    assert b.shape[0] == k, (a.shape, b.shape)
    n = b.shape[1]
    assert a.stride(1) == 1 and (m <= 1 or a.stride(0) == k), f"a not row-major: {a.stride()}"
    assert b.stride(0) == 1 and (n <= 1 or b.stride(1) == k), f"b not column-major: {b.stride()}"
    assert k % 16 == 0 and n % 16 == 0, f"K={k}, N={n} not multiples of 16"
    assert scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        assert scale_a.dim() <= 1 and scale_b.dim() <= 1
    else:
        assert tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n), (scale_a.shape, scale_b.shape)
        assert a.dtype == b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
        assert scale_a.is_contiguous() and scale_b.is_contiguous()


@pytest.fixture(autouse=True)
def _check_every_emulated_gemm(monkeypatch):
    """Every emulated FP8 GEMM in the suite must satisfy the CUDA contract (checked independently of the
    library's own check), so CPU runs catch what the CUDA kernel would reject."""
    from lightning_fp8 import gemm

    original = gemm.emulated_scaled_mm

    def checked(a, b, inv_a, inv_b, out_dtype):
        assert_cuda_scaled_mm_contract(a, b, inv_a, inv_b, out_dtype)
        return original(a, b, inv_a, inv_b, out_dtype)

    monkeypatch.setattr(gemm, "emulated_scaled_mm", checked)
    yield


# ------------------------------------------------------------------------- the 2-process checks, one launch per session

GLOO_CHECKS = Path(__file__).parent / "scripts" / "gloo_checks.py"
GLOO_TIMEOUT_S = 900


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gloo(*checks): checks of tests/scripts/gloo_checks.py the test reads through the gloo_runs fixture (all the "
        "checks of a session's tests run in one 2-process launch)",
    )


def _gloo_checks(session) -> list[str]:
    return list(dict.fromkeys(c for item in session.items for mark in item.iter_markers("gloo") for c in mark.args))


class GlooRuns:
    """The folders of the checks run by tests/scripts/gloo_checks.py, and that run's output."""

    def __init__(self, out: Path, checks: list[str], returncode: int | None, output: str) -> None:
        self.out, self.checks, self.returncode, self.output = out, checks, returncode, output

    def folder(self, check: str) -> Path:
        """The check's folder; fails with the check's traceback, or the run's output, unless every rank completed it."""
        assert check in self.checks, f"{check!r} did not run: mark the test with @pytest.mark.gloo({check!r})"
        path = self.out / check.replace("/", "__").replace(",", "-")  # gloo_checks.py's folder()
        tail = f"\n--- gloo_checks.py (exit code {self.returncode}), output tail ---\n{self.output[-6000:]}"
        errors = sorted(path.glob("error_rank*.txt"))
        if errors:
            pytest.fail(
                f"{check} raised:\n" + "\n".join(f"{e.name}:\n{e.read_text()}" for e in errors) + tail, pytrace=False
            )
        plan = json.loads((self.out / "plan.json").read_text()) if (self.out / "plan.json").exists() else {}
        ranks = (0,) if check in plan.get("single", ()) else (0, 1)
        missing = [rank for rank in ranks if not (path / f"done_rank{rank}").exists()]
        if missing:
            pytest.fail(f"{check} did not complete on rank(s) {missing}" + tail, pytrace=False)
        return path


@pytest.fixture(scope="session")
def gloo_runs(request, tmp_path_factory) -> GlooRuns:
    """Every check named by a ``gloo`` mark of the session's tests, run in one launch of tests/scripts/gloo_checks.py
    (2 processes on gloo); the tests read the results from the checks' folders."""
    checks = _gloo_checks(request.session)
    out = tmp_path_factory.mktemp("gloo_checks")
    proc = subprocess.Popen(
        [sys.executable, str(GLOO_CHECKS), str(out), *checks],
        cwd=out,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a timeout kills both ranks
    )
    try:
        output, _ = proc.communicate(timeout=GLOO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[killed after {GLOO_TIMEOUT_S} s: a hang]"
    return GlooRuns(out, checks, proc.returncode, output)
