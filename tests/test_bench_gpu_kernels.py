"""``benchmarks/gpu_kernels.py``: the Triton kernels inductor writes for a GPU, counted and sized on a CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_llama  # noqa: E402
import docs_tables  # noqa: E402
import gpu_kernels  # noqa: E402

from lightning_fp8 import gemm  # noqa: E402


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_kernels") / "result.json"
    assert gpu_kernels.main(["--size", "test", "--kinds", "bf16,ours-tensorwise:uncounted", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_each_graph_is_described_from_the_triton_code_inductor_wrote(result):
    """A forward and a backward per variant, with Triton launches and inductor's byte estimates; the GEMMs are extern
    calls: bf16's ``mm`` and our FP8 layers' ``_scaled_mm`` (the GPU's GEMM path), one per linear layer in the
    forward and two in the backward."""
    linears = 7 * bench_llama.SIZES["test"].blocks
    bf16, ours = result["results"]["bf16"], result["results"]["ours-tensorwise:uncounted"]
    for graphs in (bf16, ours):
        for graph in graphs.values():
            assert graph["launches"] > 0 and graph["gb"] > 0
            assert sum(graph["kinds"].values()) == graph["launches"]
    assert bf16["forward"]["extern"]["extern_kernels.mm"] == linears
    assert bf16["backward"]["extern"]["extern_kernels.mm"] == 2 * linears
    assert "extern_kernels._scaled_mm" not in bf16["forward"]["extern"]
    assert ours["forward"]["extern"]["extern_kernels._scaled_mm"] == linears
    assert ours["backward"]["extern"]["extern_kernels._scaled_mm"] == 2 * linears
    assert "H100" in result["environment"]["code generation"]


def test_everything_patched_is_restored(result):
    """After the run the CPU computes for real again: ``_scaled_mm`` and flash attention give values, inductor's
    settings and device properties are the CPU's, and our GEMM path is the emulated one."""
    import torch._inductor.config as inductor_config
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.runtime.hints import DeviceProperties

    a = torch.eye(16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    assert torch.equal(torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.float32), torch.eye(16))
    q = torch.randn(1, 1, 4, 8)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert torch.isfinite(out).all() and out.abs().sum() > 0
    assert inductor_config.cpu_backend != "triton"
    assert AsyncCompile.triton.__name__ == "triton"
    assert DeviceProperties.create(torch.device("cpu")).multi_processor_count != gpu_kernels.H100["multi_processor_count"]
    assert gemm.gemm_path("cpu") == "emulated"


def test_the_table_compares_bytes_with_bf16(result):
    text = docs_tables.gpu_kernels(result)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    ours = result["results"]["ours-tensorwise:uncounted"]
    assert rows["bf16"][5] == "1.00×"
    assert rows["ours tensorwise:uncounted"][1] == str(ours["forward"]["launches"])
    bf16 = result["results"]["bf16"]
    expected = (ours["forward"]["gb"] + ours["backward"]["gb"]) / (bf16["forward"]["gb"] + bf16["backward"]["gb"])
    assert rows["ours tensorwise:uncounted"][5] == docs_tables.x(expected)
    assert rows["bf16"][6].strip(" |") == "n/a"  # torchao not run


def test_unknown_variants_are_refused():
    with pytest.raises(SystemExit):
        gpu_kernels.main(["--kinds", "ours-mxfp8"])
