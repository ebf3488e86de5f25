"""The examples, run in a shortened form (a few steps) so they cannot rot.

* ``examples/fp8_lm/train.py`` with ``configs/cpu.yaml``: run exactly as a user runs it (a subprocess), with
  command-line overrides that shorten it; its logs, heatmap, saved config and checkpoint are read back.
* ``configs/bf16.yaml`` and ``configs/gpu.yaml``: in-process through the example's LightningCLI.
* ``examples/fabric_fp8.py``: a few steps, then a resume from its checkpoint.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import lightning_fp8 as lf
from lightning_fp8.state import fp8_state_layer_names, layer_state

ROOT = Path(__file__).resolve().parents[1]
LM_DIR = ROOT / "examples" / "fp8_lm"
CONFIGS = LM_DIR / "configs"

# Shortens the 300-step cpu.yaml / bf16.yaml runs to a few steps with a validation at the end.
SHORT = [
    "--trainer.max_steps", "4",
    "--trainer.val_check_interval", "4",
    "--trainer.limit_val_batches", "2",
    "--trainer.num_sanity_val_steps", "1",
    "--trainer.log_every_n_steps", "1",
    "--trainer.enable_progress_bar", "false",
    "--data.val_windows", "64",
]  # fmt: skip


def load_example(path: Path, name: str):
    """Import an example file as a module (examples/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def lm_example(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI(args=...) warns when pytest's argv is there too
    return load_example(LM_DIR / "train.py", "fp8_lm_train")


def parse_only(module, args: list[str]):
    """The example's LightningCLI with ``fit`` replaced by a no-op: parses and instantiates everything."""

    class ParseOnly(module.LMCLI):
        def fit(self, model, **kwargs):  # LightningCLI calls this instead of trainer.fit when defined
            pass

        def after_fit(self):
            pass

    return ParseOnly(module.ByteTransformerLM, module.StdlibBytes, args=args)


def plugin_settings(plugin) -> tuple:
    return (
        plugin.recipe,
        plugin.compute_dtype,
        plugin.exclude,
        plugin.scaler.state_dict() if plugin.scaler is not None else None,
        plugin.fp8_eval,
        plugin.loss_scaling,
    )


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _headline_run(workdir: Path) -> dict:
    cmd = [
        sys.executable, str(LM_DIR / "train.py"), "fit", "--config", str(CONFIGS / "cpu.yaml"), *SHORT,
        "--trainer.callbacks.log_every_n_steps", "2",  # the FP8StatsCallback (the last callback in the list)
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return {"args": cmd, "cwd": workdir, "env": env, "timeout": 600}


# started when collection ends and run while other tests run (tests/conftest.py, "subprocesses started early")
EARLY_RUNS = {"headline_run": _headline_run}


@pytest.fixture
def headline_run(early_runs):
    return early_runs.result(__name__, "headline_run")


@pytest.mark.slow
def test_headline_example_runs_end_to_end(headline_run, monkeypatch):
    """`python examples/fp8_lm/train.py fit --config examples/fp8_lm/configs/cpu.yaml`, shortened to 4 steps (run in
    its own folder, started early: tests/conftest.py)."""
    monkeypatch.setattr(sys, "argv", ["train.py"])  # for the in-process parsing at the end
    cmd, proc, tmp_path = headline_run.args, headline_run, headline_run.workdir
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout

    # The run says where things are, and they are there.
    log_dir = tmp_path / "lightning_logs" / "fp8_cpu" / "version_0"
    assert f"Logs:       {log_dir}" in out, out[-2000:]
    assert f"Heatmap:    {log_dir / 'fp8_amax_heatmap.png'}" in out
    assert f"tensorboard --logdir {tmp_path / 'lightning_logs'}" in out
    assert "Finished 4 steps" in out and "FP8Precision" in out
    assert "FP8 active: recipe=delayed" in out + proc.stderr
    assert "Data: " in out and "validation files" in out
    heatmap = log_dir / "fp8_amax_heatmap.png"
    assert heatmap.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and heatmap.stat().st_size > 10_000

    # Metrics were written: read the TensorBoard event files back.
    metrics = scalars(log_dir)
    assert [step for step, _ in metrics["train_loss"]] == [0, 1, 2, 3]
    assert all(math.isfinite(v) for _, v in metrics["train_loss"])
    assert metrics["train_loss"][0][1] == pytest.approx(math.log(256), abs=0.3)  # uniform over bytes at init
    ((val_step, val_loss),) = metrics["val_loss"]
    ((_, val_ppl),) = metrics["val_ppl"]
    assert val_step == 3 and val_ppl == pytest.approx(math.exp(val_loss), rel=1e-3)  # torchmetrics Perplexity
    fp8_tags = [t for t in metrics if t.startswith("fp8/")]
    assert "fp8/loss_scale" in metrics and "fp8/blocks.0.qkv/input/amax" in metrics, fp8_tags[:10]
    assert len(metrics["fp8/skipped_steps"]) == 2 and metrics["fp8/skipped_steps"][-1][1] == 0  # logged at steps 2, 4

    # The checkpoint holds the FP8 plugin state as plain tensors (weights_only loads it).
    (ckpt,) = (log_dir / "checkpoints").glob("*.ckpt")
    state = torch.load(ckpt, weights_only=True, map_location="cpu")
    assert state["FP8Precision"]["recipe"]["name"] == "delayed"
    (model_state,) = state["FP8Precision"]["models"]
    assert "blocks.0.fc" in fp8_state_layer_names(model_state)
    assert "blocks.0.fc.weight" in state["state_dict"]  # model keys are the plain model's

    # The saved config (the text --print_config prints), fed back, configures the same run.
    saved = log_dir / "config.yaml"
    assert "class_path: lightning_fp8.FP8Precision" in saved.read_text()
    lm = load_example(LM_DIR / "train.py", "fp8_lm_train")
    original = parse_only(lm, ["fit", "--config", str(CONFIGS / "cpu.yaml"), *cmd[cmd.index("fit") + 3 :]])
    fed_back = parse_only(lm, ["fit", "--config", str(saved)])
    a, b = original.trainer.precision_plugin, fed_back.trainer.precision_plugin
    assert isinstance(b, lf.FP8Precision) and b.recipe.name == "delayed" and b.recipe.amax_history_len == 16
    assert plugin_settings(a) == plugin_settings(b)
    assert dict(original.model.hparams) == dict(fed_back.model.hparams)
    assert fed_back.trainer.max_steps == 4
    (sa,), (sb,) = (
        [c for c in cli.trainer.callbacks if isinstance(c, lf.FP8StatsCallback)] for cli in (original, fed_back)
    )
    assert sa.log_every_n_steps == sb.log_every_n_steps == 2


@pytest.mark.slow
def test_bf16_config_runs(lm_example, tmp_path):
    """bf16.yaml: the same model in plain bf16-mixed, no FP8 anywhere; here logged with a CSV logger instead."""
    cli = lm_example.main(
        ["fit", "--config", str(CONFIGS / "bf16.yaml"), *SHORT,
         "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path)]
    )  # fmt: skip
    trainer = cli.trainer
    assert trainer.global_step == 4 and trainer.precision == "bf16-mixed"
    assert not isinstance(trainer.precision_plugin, lf.FP8Precision)
    assert not any(isinstance(m, lf.FP8Linear) for m in cli.model.modules())
    assert not any(isinstance(c, lf.FP8StatsCallback) for c in trainer.callbacks)
    assert not (Path(trainer.log_dir) / "fp8_amax_heatmap.png").exists()
    rows = (Path(trainer.log_dir) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert {"train_loss", "val_loss", "val_ppl"} <= set(header)
    val = [dict(zip(header, r.split(","))) for r in rows[1:]]
    val = [r for r in val if r["val_ppl"]]
    assert len(val) == 1 and float(val[0]["val_ppl"]) == pytest.approx(math.exp(float(val[0]["val_loss"])), rel=1e-3)
    # Same model hyperparameters as cpu.yaml, so the loss curves are comparable.
    fp8 = lm_example.main(["--config", str(CONFIGS / "cpu.yaml"), "--trainer.logger", "false"], run=False)
    assert dict(fp8.model.hparams) == dict(cli.model.hparams)
    assert {**fp8.datamodule.hparams, "val_windows": 64} == dict(cli.datamodule.hparams)  # 64: SHORT


def test_gpu_config_parses(lm_example):
    """gpu.yaml parses and builds the FP8 plugin as written (checked on a CPU: accelerator overridden)."""
    cli = lm_example.main(
        ["--config", str(CONFIGS / "gpu.yaml"), "--trainer.accelerator", "cpu", "--trainer.logger", "false"], run=False
    )
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, lf.FP8Precision)
    assert plugin.compute_dtype is torch.bfloat16 and plugin.exclude == ["lm_head"]
    assert plugin.recipe.name == "delayed"
    (stats,) = [c for c in cli.trainer.callbacks if isinstance(c, lf.FP8StatsCallback)]
    assert (stats.log_every_n_steps, stats.heatmap_every_n_logs) == (25, 20)
    hp = cli.model.hparams
    assert hp.dim % 16 == 0 and hp.seq_len == cli.datamodule.hparams.seq_len == 512  # linked
    assert hp.fused is True


def test_stdlib_split_is_deterministic_and_disjoint(lm_example):
    files = lm_example.stdlib_files()
    assert files == lm_example.stdlib_files() and len(files) > 100
    rel = [f.relative_to(sysconfig.get_paths()["stdlib"]).as_posix() for f in files]
    assert not any({"site-packages", "test", "tests"} & set(r.split("/")) or "_sysconfigdata" in r for r in rel)
    assert "json/decoder.py" in rel and "asyncio/tasks.py" in rel
    data = lm_example.StdlibBytes(seq_len=32, batch_size=4)
    data.setup("fit")
    again = lm_example.StdlibBytes(seq_len=32, batch_size=4)
    again.setup("fit")
    assert torch.equal(data.train_data, again.train_data) and torch.equal(data.val_data, again.val_data)
    assert len(data.val_data) > 100_000 and len(data.train_data) > 10 * len(data.val_data)
    x, y = next(iter(data.val_dataloader()))
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    text = bytes(data.train_data[:2000].tolist()).decode("utf-8", "replace")
    assert "import" in text or "def " in text  # real Python source, not random bytes


@pytest.mark.slow
def test_fabric_example_runs_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fabric_example = load_example(ROOT / "examples" / "fabric_fp8.py", "fabric_fp8_example")
    # the default checkpoint name, which `python examples/fabric_fp8.py --resume fabric_fp8.ckpt` (examples/README.md)
    # relies on
    out = fabric_example.main(["--steps", "6", "--batch-size", "64", "--log-every", "3"])
    assert len(out["losses"]) == 6 and all(math.isfinite(x) for x in out["losses"])
    assert out["losses"][0] == pytest.approx(math.log(256), abs=0.3)
    model = out["model"].module
    assert all(isinstance(m, lf.FP8Linear) for m in model.net if isinstance(m, torch.nn.Linear))
    state = torch.load(tmp_path / "fabric_fp8.ckpt", weights_only=True, map_location="cpu")
    assert state["step"] == 6 and state["fp8"]["recipe"]["name"] == "delayed"
    (model_state,) = state["fp8"]["models"]
    assert set(fp8_state_layer_names(model_state)) == {"net.0", "net.2", "net.4"}
    assert state["fp8"]["loss_scaling"] == "skip_nonfinite" and state["fp8"]["loss_scaler"]["scale"] == 1.0
    # the stats reader is saved with its baseline (the reading at step 6): resumed, its first interval starts there,
    # not at the start of the run (without it, a resumed run's first reading reported every skipped step and
    # underflow since step 0)
    assert state["stats"]["has_baseline"] and set(state["stats"]["last_counts"]) == {"net.0", "net.2", "net.4"}
    # FP8Stats through fabric.log_dict: the CSV logger wrote the statistics at steps 3 and 6
    import csv

    with open(tmp_path / "fabric_fp8_logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [3, 6]
    for row in rows:
        assert float(row["fp8/net.0/input/amax"]) > 0 and 0 <= float(row["fp8/net.2/grad_output/overflow_frac"]) <= 1
        assert float(row["fp8/loss_scale"]) == 1.0 and float(row["fp8/skipped_steps"]) == 0

    # Resume: the FP8 state comes back with the weights and training continues from step 6.
    resumed = fabric_example.main(
        ["--steps", "2", "--batch-size", "64", "--resume", "fabric_fp8.ckpt", "--checkpoint", "b.ckpt"]
    )
    history = layer_state(lf.fp8_state_dict(resumed["model"].module), "net.0")["amax_history"]
    assert int((history != 0).sum()) > 0
    assert torch.load(tmp_path / "b.ckpt", weights_only=True)["step"] == 8
