"""What a compiled FP8 layer leaves to be saved for backward.

Under ``torch.compile`` AOTAutograd's partitioner (inductor's) chooses what the forward keeps and what the backward
recomputes. These tests measure it with ``benchmarks/compiled_saved.py``'s ``measure``: partitioned as inductor
does, without its code generation (seconds on a CPU), the saved tensors counted with ``saved_tensors_hooks``; on a
small Llama block that gives the bytes a real inductor compile saves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_llama  # noqa: E402
import compiled_saved  # noqa: E402
from utils import needs_cpu_rowwise_scaled_mm  # noqa: E402

#: bench_llama.py's smallest block: hidden 64, FFN 128, 32 tokens
SIZE = bench_llama.SIZES["test"]


@pytest.mark.parametrize(  # tensorwise's chain is shorter (no histogram, one cast)
    "recipe", [pytest.param("rowwise", marks=needs_cpu_rowwise_scaled_mm), "delayed"]
)
def test_compiled_llama_block_keeps_no_fp8_copy_of_its_swiglu_product(recipe):
    """Compiled with the GPU's GEMM path (``torch._scaled_mm``, which runs on a CPU too), a Llama block
    (``bench_llama.DecoderBlock``) keeps for backward no FP8 copy of its SwiGLU product ``silu(gate(x)) * up(x)``, as
    torchao's does not: the backward recomputes it from the gate and up outputs, which silu's and the product's
    gradients keep anyway.

    The partitioner does not recompute a fusible chain of ops spanning more than 100 forward graph nodes
    (``ban_recompute_long_fusible_chains``), and the chain from silu to the product spans the up projection's whole
    forward: its casts, statistics and table records. ``rowwise`` and ``delayed`` went past it, so the product was
    saved, as the down projection's FP8 input copy (a tiny Llama block compiled with inductor saved 504,712 bytes
    under ``rowwise``, 445,440 under torchao rowwise). Updating a table row's counts with one addition brought both
    just under it (``delayed``'s chain in that block: 98 forward nodes); this test fails if a change to the casts
    lengthens the chain again (it fails with that record reverted alone). For ``delayed`` only the product is checked
    here (its sibling layers' casts: the next test)."""
    torch.manual_seed(0)
    block = bench_llama.DecoderBlock(SIZE)
    x = torch.randn(SIZE.batch, SIZE.seq, SIZE.hidden, generator=torch.Generator().manual_seed(0))
    with compiled_saved.gpu_gemm_path():
        ours = compiled_saved.measure(f"ours-{recipe}", block, x)
        product = f"({SIZE.tokens}, {SIZE.ffn})"
        assert not any(kept.endswith(product) for kept in ours["fp8_tensors"]), ours["fp8_tensors"]
        if recipe == "delayed":
            return
        theirs = compiled_saved.measure(f"torchao-{recipe}", block, x)
    # ours keeps a few small extras (the histogram's zero-initialised bins, bf16 scales): under a twentieth more
    assert ours["saved_bytes"] <= 1.05 * theirs["saved_bytes"], (ours, theirs)


def test_compiled_delayed_sibling_layers_keep_no_fp8_copies_of_their_shared_input():
    """Compiled with the GPU's GEMM path, ``delayed`` keeps for backward what torchao tensorwise keeps on a Llama
    block: no FP8 copy of the input that the q/k/v projections (and gate/up) share.

    Each sibling casts the shared input with its own history scale, so the casts are not one graph node as under
    ``tensorwise``; AOTAutograd's partitioner will not recompute in the backward a cast of a tensor whose earlier
    use went through a GEMM (``ban_recompute_used_far_apart``), so it kept each later sibling's FP8 copy (three
    hidden-size copies per block, about a tenth more than torchao tensorwise in all). Compiled, ``delayed`` saves the
    high-precision input and its scale and casts again in the backward (the same bits): the partitioner then keeps
    the one shared input, or the FP8 copy where that is smaller."""
    torch.manual_seed(0)
    block = bench_llama.DecoderBlock(SIZE)
    x = torch.randn(SIZE.batch, SIZE.seq, SIZE.hidden, generator=torch.Generator().manual_seed(0))
    with compiled_saved.gpu_gemm_path():
        ours = compiled_saved.measure("ours-delayed", block, x)
        theirs = compiled_saved.measure("torchao-tensorwise", block, x)
    assert not ours["fp8_tensors"], ours["fp8_tensors"]
    assert ours["saved_bytes"] <= 1.01 * theirs["saved_bytes"], (ours, theirs)
