"""``lightning_fp8.compare``: bf16-mixed against FP8 recipes on the user's own model, in a shortened form.

The command line runs once as a user runs it (a subprocess, on the example's ``gpu.yaml``, whose FP8 plugin
keeps ``lm_head`` in bf16), the Python function once (the example's model on a plain ``DataLoader``). The FP8
share of the Linear FLOPs is checked against a value computed here from the model's layer shapes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_fp8 import compare

ROOT = Path(__file__).resolve().parents[1]
LM = ROOT / "examples" / "fp8_lm" / "train.py"
VOCAB = 256
TINY = ["--model.dim=32", "--model.n_heads=2", "--model.n_layers=1", "--data.seq_len=32", "--data.batch_size=4",
        "--data.num_workers=0"]  # fmt: skip
EMULATED = "no speedup possible here; FP8 GEMMs need an NVIDIA GPU with compute capability >= 8.9"


def linear_flops_per_token(dim: int, n_layers: int) -> dict[str, int]:
    """2 * in * out of every Linear of the example's transformer (per block: qkv, proj, fc, out; then lm_head)."""
    per_block = {"qkv": (dim, 3 * dim), "proj": (dim, dim), "fc": (dim, 4 * dim), "out": (4 * dim, dim)}
    flops = {f"blocks.{i}.{n}": 2 * a * b for i in range(n_layers) for n, (a, b) in per_block.items()}
    return {**flops, "lm_head": 2 * dim * VOCAB}


def table_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ") and not line.startswith("| run ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def _command_line_run(workdir: Path) -> dict:
    out = workdir / "report"
    cmd = [sys.executable, "-m", "lightning_fp8.compare", "--config", "examples/fp8_lm/configs/gpu.yaml",
           "--model-class", f"{LM}:ByteTransformerLM", "--data-class", f"{LM}:StdlibBytes",
           "--recipes", "tensorwise", "delayed", "--steps", "3", "--warmup", "1", "--out", str(out), *TINY]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return {"args": cmd, "cwd": ROOT, "env": env, "timeout": 240}


# started when collection ends and run while other tests run (tests/conftest.py, "subprocesses started early")
EARLY_RUNS = {"command_line_run": _command_line_run}


@pytest.fixture
def command_line_run(early_runs):
    return early_runs.result(__name__, "command_line_run")


def test_command_line_on_the_example_config(command_line_run):
    """The command line as a user runs it (started early: tests/conftest.py)."""
    proc, out = command_line_run, command_line_run.workdir / "report"
    assert proc.returncode == 0, proc.stderr[-4000:]

    markdown = (out / "compare.md").read_text()
    assert markdown in proc.stdout
    assert EMULATED in markdown.splitlines()[0]  # the first line, on CPU
    rows = table_rows(markdown)
    assert [row[0] for row in rows] == ["bf16-mixed", "fp8-tensorwise", "fp8-delayed"]
    assert all(row[5] == "n/a on CPU" for row in rows)

    report = json.loads((out / "compare.json").read_text())
    assert report["emulated"] is True and report["gemm_path"] == "emulated" and report["device"] == "cpu"
    assert report["same_data"] is True and (report["steps"], report["warmup"]) == (3, 1)
    flops = linear_flops_per_token(dim=32, n_layers=1)
    expected_share = 1 - flops["lm_head"] / sum(flops.values())  # gpu.yaml: exclude: [lm_head]
    assert expected_share == pytest.approx(0.6)
    tokens = 4 * 32
    for run, row in zip(report["runs"], rows):
        for key in ("step_time_s", "samples_per_s", "tokens_per_s", "saved_for_backward_bytes", "final_loss",
                    "mean_abs_rel_loss_diff_vs_bf16", "fp8_flops_share", "skipped_layers", "losses"):  # fmt: skip
            assert key in run, key
        assert len(run["losses"]) == 3 and all(v > 0 for v in run["losses"])
        assert run["tokens_per_s"] == pytest.approx(run["samples_per_s"] * 32)
        assert run["linear_flops_per_step"] == 3 * tokens * sum(flops.values())
        assert run["saved_for_backward_bytes"] > 0
        if run["name"] == "bf16-mixed":
            assert run["fp8_flops_share"] == 0 and run["mean_abs_rel_loss_diff_vs_bf16"] == 0
        else:
            assert run["fp8_flops_share"] == pytest.approx(expected_share)
            assert row[9] == "60.0%" and row[10] == "4 / 1"
            assert run["skipped_layers"] == {"lm_head": "excluded by pattern 'lm_head'"}
            assert 0 < run["mean_abs_rel_loss_diff_vs_bf16"] < 0.01  # FP8 numerics, the same training
    assert "- `lm_head`: excluded by pattern 'lm_head'" in markdown
    assert (out / "compare_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_function_on_a_dataloader(tmp_path):
    model_class = compare.load_class(f"{LM}:ByteTransformerLM")
    seq_len, dim, n_layers = 32, 32, 2
    idx = torch.randint(0, VOCAB, (64, seq_len + 1))
    dataset = torch.utils.data.TensorDataset(idx[:, :-1], idx[:, 1:])
    data = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)

    result = compare.compare_precisions(
        lambda: model_class(dim=dim, n_layers=n_layers, n_heads=2, seq_len=seq_len, warmup_steps=1),
        data,
        recipes=["rowwise"],
        steps=3,
        warmup=1,
        fp8_kwargs={"exclude": ["*.fc"]},
        trainer_kwargs={"accelerator": "cpu"},
    )
    assert [run.name for run in result.runs] == ["bf16-mixed", "fp8-rowwise"]
    assert result.emulated and result.same_data
    flops = linear_flops_per_token(dim, n_layers)
    fp8 = sum(f for name, f in flops.items() if not name.endswith(".fc"))
    assert result.runs[1].fp8_flops_share == pytest.approx(fp8 / sum(flops.values()))
    assert result.runs[1].fp8_flops_share == pytest.approx(0.75)  # (2 * 8 + 8) / (2 * 12 + 8) in units of 2*dim^2
    assert result.runs[1].skipped_layers == {f"blocks.{i}.fc": "excluded by pattern '*.fc'" for i in range(n_layers)}
    assert len(result.runs[1].fp8_layers) == 4 * n_layers - n_layers + 1
    base = result.runs[0]
    assert base.samples_per_s == pytest.approx(8 / base.step_time_s)
    assert base.tokens_per_s == pytest.approx(8 * seq_len / base.step_time_s)
    assert result.runs[1].losses != result.runs[0].losses  # the FP8 run did compute in FP8

    paths = result.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare.json", "compare.md", "compare_loss.png"]
    assert json.loads(paths["json"].read_text())["runs"][1]["fp8_flops_share"] == pytest.approx(0.75)
    # a saved comparison comes back whole (the docs render their example report from one)
    assert compare.PrecisionComparison.from_dict(json.loads(paths["json"].read_text())) == result
    assert result.to_markdown().splitlines()[0].startswith("**FP8 GEMMs are emulated on cpu")
    assert len(table_rows(result.to_markdown())) == 2


def test_bad_inputs_fail_with_a_clear_message(capsys):
    valid = r"choose from \['tensorwise', 'delayed', 'rowwise', 'blockwise', 'mxfp8'\]"
    with pytest.raises(ValueError, match=r"unknown recipe\(s\) \['fp16'\]; " + valid):
        compare.compare_precisions(lambda: None, None, recipes=["fp16"], steps=3, warmup=1)
    with pytest.raises(ValueError, match="steps must be larger than warmup"):
        compare.compare_precisions(lambda: None, None, recipes=["tensorwise"], steps=2, warmup=2)
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        compare.compare_precisions(lambda: None, None, steps=2, warmup=0)
    for args, message in [(["--recipes", "delayd"], "unknown recipe(s) ['delayd']"),
                          (["--steps", "5", "--warmup", "5"], "steps must be larger than warmup"),
                          ([], "model: has no class_path"),
                          (["--model-class", f"{LM}:ByteTransformerLM"], "--data-class package.module.Class")]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            compare.main(["--config", "examples/fp8_lm/configs/cpu.yaml", *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_recipe_tuning_of_a_config_applies_to_its_own_recipe_only():
    config = {"recipe": "delayed", "margin": 1, "amax_compute_algo": "most_recent", "exclude": ["lm_head"]}
    assert compare._fp8_kwargs_for(config, "delayed") == {"margin": 1, "amax_compute_algo": "most_recent",
                                                          "exclude": ["lm_head"]}  # fmt: skip
    assert compare._fp8_kwargs_for(config, "tensorwise") == {"exclude": ["lm_head"]}
    assert compare._fp8_kwargs_for(None, "rowwise") == {}


MODULE = '''
import lightning as L
import torch
from torch import nn


class TinyLM(L.LightningModule):
    def __init__(self, dim: int = 32, vocab: int = 64):
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, vocab)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(torch.relu(self.body(self.emb(x))))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Tokens(L.LightningDataModule):
    def __init__(self, vocab: int = 64, seq_len: int = 16):
        super().__init__()
        self.vocab, self.seq_len = vocab, seq_len

    def train_dataloader(self):
        idx = torch.randint(0, self.vocab, (32, self.seq_len + 1), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(idx[:, :-1], idx[:, 1:]), batch_size=4)
'''

CONFIG = """
seed_everything: 3
trainer:
  max_steps: 1000
  logger: false
  plugins:
    - class_path: lightning_fp8.FP8Precision
      init_args: {recipe: delayed, margin: 1, exclude: [head]}
model:
  class_path: tiny_compare_models.TinyLM
  init_args: {dim: 32}
data:
  class_path: tiny_compare_models.Tokens
"""


def test_command_line_with_class_paths_in_the_config(tmp_path, monkeypatch, capsys):
    """The yaml of ``LightningCLI()`` with subclass mode (class_path / init_args), run in-process."""
    (tmp_path / "tiny_compare_models.py").write_text(MODULE)
    (tmp_path / "config.yaml").write_text(CONFIG)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = compare.main(["--config", str(tmp_path / "config.yaml"), "--recipes", "delayed", "tensorwise",
                           "--steps", "3", "--warmup", "1", "--out", str(tmp_path / "out"),
                           "--model.init_args.vocab=32", "--data.init_args.vocab=32"])  # fmt: skip
    assert [run.name for run in result.runs] == ["bf16-mixed", "fp8-delayed", "fp8-tensorwise"]
    assert result.seed == 3 and result.same_data
    body, head = 2 * 32 * 64, 2 * 64 * 32  # the head is excluded in the config; vocab 32 from the override
    for run in result.runs[1:]:
        assert run.fp8_flops_share == pytest.approx(body / (body + head))
        assert run.skipped_layers == {"head": "excluded by pattern 'head'"}
    assert (tmp_path / "out" / "compare.md").read_text() in capsys.readouterr().out
