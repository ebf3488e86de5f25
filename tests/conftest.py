import os

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
