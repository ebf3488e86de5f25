"""``benchmarks/bench_convergence.py`` for real, on a tiny configuration: the runs, the result file, the merge.

The benchmark itself takes half an hour; this runs its code path (the example's model and data through a real
``lightning.Trainer``, ``FP8Precision``, the planted outliers, ``sensitivity_report``'s exclude list, the merge of a
later run and its refusal of another configuration) with a few steps of a one-block model, in-process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_convergence as bc
import docs_tables

TINY = ["--workers", "1", "--steps", "4", "--val-every", "2", "--dim", "32", "--layers", "1", "--heads", "2",
        "--seq-len", "32", "--batch-size", "4", "--val-windows", "8", "--seeds", "0", "--sensitivity-batches", "1",
        "--no-torchao"]


def test_massive_tokens_is_the_identity_in_bf16():
    torch.manual_seed(0)
    linear = nn.Linear(32, 48, bias=False)
    wrapped = bc.MassiveTokens(linear, 2.0**17, [0])
    x = torch.randn(2, 8, 32)
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(wrapped(x), linear(x))
        seen = {}
        handle = linear.register_forward_hook(lambda m, args, out: seen.setdefault("x", args[0]))
        wrapped(x)
        handle.remove()
    assert torch.equal(seen["x"][:, 0], x[:, 0] * 2.0**17) and torch.equal(seen["x"][:, 1:], x[:, 1:])
    with pytest.raises(ValueError, match="power of two"):
        bc.MassiveTokens(linear, 1e5, [0])


def test_runs_write_the_result_merge_new_recipes_and_refuse_another_config(tmp_path, capsys):
    out = ["--json", str(tmp_path / "convergence.json"), "--plot", str(tmp_path / "convergence.png")]
    data = bc.main([*TINY, *out, "--recipes", "tensorwise"])
    saved = json.loads((tmp_path / "convergence.json").read_text())
    assert saved["scenarios"] == data["scenarios"]
    assert saved["environment"]["torch"] == torch.__version__ and saved["command"].startswith("python benchmarks/")
    assert saved["config"]["steps"] == 4 and saved["config"]["seeds"] == [0]
    assert (tmp_path / "convergence.png").stat().st_size > 0

    plain, outliers = (saved["scenarios"][s]["variants"] for s in ("plain", "outliers"))
    assert list(plain) == ["bf16", "fp8-tensorwise"]
    assert list(outliers) == ["bf16", "fp8-tensorwise", "fp8-tensorwise+exclude"]
    for runs in (*plain.values(), *outliers.values()):
        run = runs["0"]
        assert [step for step, _ in run["val_curve"]] == [2, 4]
        assert run["final_val_loss"] == run["val_curve"][-1][1] and 0 < run["final_val_loss"] < 10
        assert len(run["train_curve"]["mean_loss"]) == 1
    # same initial weights, same batches: bf16 sees the planted outliers as the identity
    assert len({runs["0"]["data_checksum"] for runs in (*plain.values(), *outliers.values())}) == 1
    assert outliers["bf16"]["0"]["final_val_loss"] == plain["bf16"]["0"]["final_val_loss"]
    assert outliers["bf16"]["0"]["identical_to_plain"]["bitwise_equal_losses"]
    assert plain["fp8-tensorwise"]["0"]["final_val_loss_bf16_eval"] > 0
    assert outliers["bf16"]["0"]["planted"] == ["blocks.0.qkv"]
    # the sensitivity report finds the planted layer; the FP8 statistics show what it does to tensorwise
    assert "blocks.0.qkv.linear" in outliers["fp8-tensorwise+exclude"]["0"]["exclude"]
    assert outliers["fp8-tensorwise+exclude"]["0"]["fp8_layers"] == plain["fp8-tensorwise"]["0"]["fp8_layers"] - 1
    stats = outliers["fp8-tensorwise"]["0"]["fp8_stats"]
    assert stats["fp8/blocks.0.qkv.linear/input/underflow_frac"] > 0.1
    summary = saved["summary"]["outliers"]
    assert summary["fp8-tensorwise"]["most_underflow"]["where"] == "blocks.0.qkv.linear input"
    assert set(summary["fp8-tensorwise"]["gap_pct"]) == {"mean", "std", "min", "max"}
    table = docs_tables.convergence_table(saved, "plain")
    assert table.startswith("*Measured ") and "emulated" in table and "| `fp8-tensorwise` | 1 |" in table

    # a later run adds a recipe to both scenarios, reusing the baselines
    bc.main([*TINY, *out, "--recipes", "delayed"])
    merged = json.loads((tmp_path / "convergence.json").read_text())
    assert list(merged["scenarios"]["plain"]["variants"]) == ["bf16", "fp8-tensorwise", "fp8-delayed"]
    assert merged["scenarios"]["plain"]["variants"]["bf16"] == plain["bf16"]
    assert merged["additions"][0]["variants"] == {"plain": ["fp8-delayed"], "outliers": ["fp8-delayed"]}
    assert "fp8-delayed" in merged["summary"]["plain"]

    # another configuration is refused before anything runs, and the file is left alone
    before = (tmp_path / "convergence.json").read_text()
    capsys.readouterr()
    with pytest.raises(bc.ConfigMismatch, match="steps: 4 vs 6"):
        bc.main([*TINY, *out, "--recipes", "rowwise", "--steps", "6"])
    assert "runs (" not in capsys.readouterr().out
    assert (tmp_path / "convergence.json").read_text() == before
