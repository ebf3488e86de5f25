"""DDP with a branch that runs on one rank only (issue 9): no hang, and every rank's FP8 scales are the same, with the
branch's amaxes (recorded on rank 1 only) in every rank's history; 2 CPU processes on gloo."""

from __future__ import annotations

import pytest
import torch

from lightning_fp8.recipe import GRAD_OUTPUT, INPUT, WEIGHT
from lightning_fp8.state import fp8_state_layer_names, layer_state


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe", [pytest.param(r, marks=pytest.mark.gloo(f"ddp_unused_branch/{r}")) for r in ["delayed"]]
)
def test_a_branch_on_one_rank_neither_hangs_nor_corrupts_scales(recipe, gloo_runs):
    """tests/scripts/ddp_unused_branch.py, run by tests/scripts/gloo_checks.py (a hang fails there: the collectives time
    out after 5 minutes, the run is killed after 15)."""
    tmp_path = gloo_runs.folder(f"ddp_unused_branch/{recipe}")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    names = fp8_state_layer_names(ranks[0]["fp8"])
    assert names == ["inp", "branch", "out"]
    for name in names:
        zero, one = layer_state(ranks[0]["fp8"], name), layer_state(ranks[1]["fp8"], name)
        for key in ("amax_history", "scale", "initialized"):
            assert torch.equal(zero[key], one[key]), (name, key)
        scale = zero["scale"]
        assert torch.isfinite(scale).all() and (scale > 0).all(), (name, scale)
    # the branch ran on rank 1 only: its histories hold rank 1's amaxes on both ranks (a MAX over ranks, rank 0's zeros
    # do not erase them), and the output layer's input history carries the branch's large values on rank 0 too
    branch = layer_state(ranks[0]["fp8"], "branch")
    assert bool(branch["initialized"].all())
    for role in (INPUT, WEIGHT, GRAD_OUTPUT):
        assert (branch["amax_history"][role] > 0).any() and torch.isfinite(branch["amax_history"][role]).all()
    out = layer_state(ranks[0]["fp8"], "out")
    inp = layer_state(ranks[0]["fp8"], "inp")
    assert out["amax_history"][INPUT].max() > 10 * inp["amax_history"][INPUT].max()
    # DDP kept the weights identical (the branch's gradient is rank 1's, averaged with rank 0's zeros)
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][key]), key
