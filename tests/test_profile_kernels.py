"""``benchmarks/profile_kernels.py``: kernel time per step by name and class, and the statistics ablation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_kernels  # noqa: E402


@pytest.mark.parametrize(("name", "expected"), [
    ("triton_poi_fused__scaled_mm__to_copy_abs_clamp_7", "fused"),  # a cast feeding a GEMM, named after it
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
    ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata, FusedAdamMathFunctor>", "optimizer"),
    ("void (anonymous namespace)::indexing_backward_kernel_stride_1<long>", "other"),
    ("aten::mm", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("_cast_with_statistics_kernel", "fused"),
    ("graph_3_cpp_fused__to_copy_abs_amax_clamp_mul_reciprocal_t_view_1", "fused"),  # inductor's C++ kernels
    ("cpp_fused_add_mul_0", "fused"),
])
def test_kernel_classes(name, expected):
    assert profile_kernels.kernel_class(name) == expected


def test_profile_on_this_cpu_with_the_statistics_ablation(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    kinds = "bf16,ours-tensorwise,ours-tensorwise:nostats,ours-tensorwise:uncounted,ours-rowwise,ours-rowwise:nostats"
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
    assert "aten::count_nonzero" not in results["ours-tensorwise:nostats"]["kernels_us"]
    # the product's step between two counting steps (statistics_every_n_steps): no counting, no counts recorded
    uncounted = results["ours-tensorwise:uncounted"]["kernels_us"]
    assert "aten::count_nonzero" not in uncounted and uncounted.get("aten::amax", 0) > 0
    assert "aten::count_nonzero" not in results["bf16"]["kernels_us"]
    # the row amax histograms are index_add_ ops: present with the statistics, gone in the ablation
    assert results["ours-rowwise"]["kernels_us"].get("aten::index_add_", 0) > 0
    assert "aten::index_add_" not in results["ours-rowwise:nostats"]["kernels_us"]
    assert "| ours-tensorwise:nostats |" in capsys.readouterr().out


def test_compiled_on_this_cpu_the_fused_kernels_are_profiled(tmp_path):
    """Compiled on a CPU, inductor's C++ kernels are in the profile (class ``fused``, with time), not only the aten
    ops its code calls; the kernel profiling option is inductor's again afterwards."""
    from torch._inductor import config

    before = config.cpp.enable_kernel_profile
    out = tmp_path / "kernels.json"
    assert profile_kernels.main(["--size", "test", "--kinds", "ours-tensorwise", "--steps", "1", "--warmup", "1",
                                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"]["ours-tensorwise"]
    fused = {name: us for name, us in result["kernels_us"].items() if "cpp_fused" in name}
    assert fused and all(profile_kernels.kernel_class(name) == "fused" for name in fused)
    assert result["classes_us"]["fused"] == pytest.approx(sum(fused.values())) and result["classes_us"]["fused"] > 0
    assert "aten::mm" in result["kernels_us"]  # the GEMMs inductor's code calls are still there
    assert config.cpp.enable_kernel_profile == before


def test_a_sigterm_keeps_the_variants_profiled(tmp_path, capsys, monkeypatch):
    """``timeout``'s SIGTERM while the second variant warms up: the first variant's profile is written and printed,
    the table says the run is incomplete, the exit status is 1 and the signal handler is put back."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    real = profile_kernels.bl.make_step
    built = [0]

    def stop_at_the_second(*args):
        built[0] += 1
        step = real(*args)
        if built[0] == 2:
            def stopping():
                signal.raise_signal(signal.SIGTERM)
                return step()
            return stopping
        return step

    monkeypatch.setattr(profile_kernels.bl, "make_step", stop_at_the_second)
    out = tmp_path / "kernels.json"
    assert profile_kernels.main(["--size", "test", "--eager", "--kinds", "bf16,ours-tensorwise,ours-rowwise",
                                 "--steps", "1", "--warmup", "1", "--json", str(out)]) == 1
    assert list(json.loads(out.read_text())["results"]) == ["bf16"]
    text = capsys.readouterr()
    assert "**Incomplete: stopped by SIGTERM while profiling ours-tensorwise; not profiled: ours-tensorwise, " \
        "ours-rowwise.**" in text.out
    assert "| bf16 |" in text.out and signal.getsignal(signal.SIGTERM) is before


def test_an_unknown_ablation_is_an_error():
    with pytest.raises(SystemExit):
        profile_kernels.main(["--size", "test", "--eager", "--kinds", "bf16:nostats"])
    with pytest.raises(SystemExit):
        profile_kernels.main(["--size", "test", "--eager", "--kinds", "ours-tensorwise:fast"])
    with pytest.raises(SystemExit):
        profile_kernels.main(["--size", "test", "--eager", "--kinds", "ours-fast"])


def test_sync_warnings_are_counted_under_their_call_site():
    """``harness.profile_step`` on CUDA counts ``set_sync_debug_mode`` warnings by the innermost frames of this
    project that made them (checked here without a GPU: the counting function, called from a frame of ours)."""
    import harness

    sites: dict[str, int] = {}
    source = "def caller(note, sites, message):\n    note(sites, message)\n"
    namespace: dict = {}
    exec(compile(source, str(Path(harness.__file__).parent / "some_benchmark.py"), "exec"), namespace)
    for _ in range(2):
        namespace["caller"](harness._note_sync, sites, UserWarning("called a synchronizing CUDA operation"))
    namespace["caller"](harness._note_sync, sites, UserWarning("an unrelated warning"))
    assert len(sites) == 1 and list(sites.values()) == [2]
    assert next(iter(sites)).split(" < ")[0].endswith("some_benchmark.py:2")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_the_statistics_ablation_removes_the_compiled_counters_too(recipe):
    """``statistics_off`` (the ``:nostats`` ablation, compiled only) zeroes every path a compiled cast counts on:
    ``cast_statistics``, and the counts a compiled cast takes without it (from the stored FP8 data for casts scaled
    by their own amaxes, from the float32 values for block casts); it missed those two, so the compiled ablation kept
    most counters (found pricing them on a CPU). Outside it the same compiled casts count."""
    from lightning_fp8 import quantize
    from lightning_fp8.recipe import resolve_recipe

    spec = resolve_recipe(recipe).cast_specs().forward[0]
    x = torch.randn(64, 96)
    x[0, :7] = 0.0
    x[1, :5] = 1e-30  # underflows under any scale these amaxes give

    def counts() -> torch.Tensor:
        torch._dynamo.reset()
        q = torch.compile(lambda t: quantize.quantize(t, spec), fullgraph=True)(x)
        return q.stats.counts

    assert counts().tolist()[:1] == [64 * 96 - 7] and counts()[2] >= 5
    with profile_kernels.statistics_off():
        assert counts().tolist() == [0, 0, 0]
