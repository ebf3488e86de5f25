"""``benchmarks/compiled_saved.py``: what compiled graphs keep for backward on the GPU's GEMM path, forced on a CPU."""

from __future__ import annotations

import ast
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_llama  # noqa: E402
import compiled_saved  # noqa: E402
import docs_tables  # noqa: E402

from lightning_fp8 import gemm, linear  # noqa: E402


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("compiled_saved") / "result.json"
    kinds = "bf16,torchao-tensorwise,ours-tensorwise,ours-delayed"
    assert compiled_saved.main(["--size", "test", "--kinds", kinds, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_the_run_measures_every_variant_on_the_gpu_gemm_path(result):
    """Every variant asked for is measured; the FP8 variants save less than bf16 and keep their FP8 copies in the
    list; the file says which GEMM path was forced, and the forcing is undone after the run."""
    results = result["results"]
    assert list(results) == ["bf16", "torchao-tensorwise", "ours-tensorwise", "ours-delayed"]
    assert all(v["saved_bytes"] > 0 for v in results.values())
    for kind in ("torchao-tensorwise", "ours-tensorwise", "ours-delayed"):
        assert results[kind]["saved_bytes"] < results["bf16"]["saved_bytes"], kind
    assert results["bf16"]["fp8_bytes"] == 0 and results["bf16"]["fp8_tensors"] == {}
    assert "torch._scaled_mm" in result["environment"]["GEMM path"]
    assert result["size"]["tokens"] == bench_llama.SIZES["test"].tokens
    assert gemm.gemm_path("cpu") == "emulated" and not bench_llama.fp8_hardware("cpu")


@pytest.fixture(scope="module")
def copies_kept(tmp_path_factory):
    """``ours-delayed`` with the backward's cast of a saved input turned off (``linear._recast_in_backward``): each
    sibling layer's FP8 copy of the shared input is saved, which the partitioner then keeps (see
    ``tests/test_compiled_saved_casts.py``): a run that keeps FP8 copies."""
    path = tmp_path_factory.mktemp("compiled_saved_copies") / "result.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(linear, "_recast_in_backward", lambda spec: False)
        assert compiled_saved.main(["--size", "test", "--kinds", "ours-delayed", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_the_fp8_copies_kept_are_listed_by_shape(copies_kept):
    """The FP8 tensors a graph keeps are listed by dtype and shape, and their bytes (one per element) add up."""
    kept = copies_kept["results"]["ours-delayed"]["fp8_tensors"]
    assert kept and all(name.startswith("float8_e4m3fn (") for name in kept)
    one_byte_each = sum(n * math.prod(ast.literal_eval(name.split(" ", 1)[1])) for name, n in kept.items())
    assert copies_kept["results"]["ours-delayed"]["fp8_bytes"] == one_byte_each


def test_the_table_compares_with_bf16_and_torchao(result):
    text = docs_tables.compiled_saved(result)
    assert "the GPU's GEMM path forced" in text.splitlines()[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "1.00×" in rows["bf16, compiled"]
    ours = rows["ours tensorwise, compiled"].split(" | ")
    theirs = result["results"]["torchao-tensorwise"]["saved_bytes"]
    assert ours[3] == docs_tables.x(result["results"]["ours-tensorwise"]["saved_bytes"] / theirs)


def test_unknown_variants_are_refused():
    with pytest.raises(SystemExit):
        compiled_saved.main(["--kinds", "ours-mxfp8"])


def test_config_sets_a_partitioner_flag_for_the_run(copies_kept, tmp_path):
    """``--config`` sets a ``torch._functorch.config`` flag for the run only: with the partitioner allowed to recompute
    ops used far apart, ``delayed``'s sibling layers (whose casts of the shared input differ by their history scales),
    saving their FP8 copies (the backward's cast turned off, as in ``copies_kept``), keep fewer of them; the flag is
    back to its value after the run."""
    import torch._functorch.config as functorch_config

    before = functorch_config.ban_recompute_used_far_apart
    path = tmp_path / "flag.json"
    flag = "ban_recompute_used_far_apart=False"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(linear, "_recast_in_backward", lambda spec: False)
        argv = ["--size", "test", "--kinds", "ours-delayed", "--config", flag, "--json", str(path)]
        assert compiled_saved.main(argv) == 0
    flagged = json.loads(path.read_text())
    assert flagged["results"]["ours-delayed"]["fp8_bytes"] < copies_kept["results"]["ours-delayed"]["fp8_bytes"]
    assert flag in flagged["command"]
    assert functorch_config.ban_recompute_used_far_apart == before


@pytest.mark.parametrize("item", ["nonsense=True", "ban_recompute_used_far_apart=no", "ban_recompute_used_far_apart"])
def test_config_refuses_what_is_not_a_boolean_flag(item):
    with pytest.raises(SystemExit):
        compiled_saved.main(["--config", item])
