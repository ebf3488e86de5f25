"""``benchmarks/profile_kernels.py``: kernel time per step by name and class, and the counters ablation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_kernels  # noqa: E402


@pytest.mark.parametrize(("name", "expected"), [
    ("triton_poi_fused__scaled_mm__to_copy_abs_clamp_7", "fused"),  # a cast feeding a GEMM, named after it
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
    ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata, FusedAdamMathFunctor>", "optimizer"),
    ("void (anonymous namespace)::indexing_backward_kernel_stride_1<long>", "other"),
    ("aten::mm", "gemm"),
])
def test_kernel_classes(name, expected):
    assert profile_kernels.kernel_class(name) == expected


def test_profile_on_this_cpu_with_the_counters_ablation(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    kinds = "bf16,ours-tensorwise,ours-tensorwise:nocounters"
    assert profile_kernels.main(["--size", "test", "--eager", "--kinds", kinds, "--steps", "1", "--warmup", "1",
                                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    results = data["results"]
    assert list(results) == kinds.split(",") and data["size"]["blocks"] == 1
    for r in results.values():
        assert r["total_us"] == pytest.approx(sum(r["kernels_us"].values()))
        assert r["total_us"] == pytest.approx(sum(r["classes_us"].values()))
    # the eager counters are count_nonzero ops: present with the statistics, gone in the ablation
    assert results["ours-tensorwise"]["kernels_us"].get("aten::count_nonzero", 0) > 0
    assert "aten::count_nonzero" not in results["ours-tensorwise:nocounters"]["kernels_us"]
    assert "aten::count_nonzero" not in results["bf16"]["kernels_us"]
    assert "| ours-tensorwise:nocounters |" in capsys.readouterr().out


def test_an_unknown_ablation_is_an_error():
    with pytest.raises(SystemExit):
        profile_kernels.main(["--size", "test", "--eager", "--kinds", "bf16:nocounters"])
    with pytest.raises(SystemExit):
        profile_kernels.main(["--size", "test", "--eager", "--kinds", "ours-tensorwise:fast"])
    with pytest.raises(SystemExit):
        profile_kernels.main(["--size", "test", "--eager", "--kinds", "ours-fast"])
