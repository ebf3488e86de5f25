"""FP8Precision and FP8StatsCallback through LightningCLI: yaml, command-line flags, --print_config, torch.dtype
values, and the errors for wrong values (which must stop the run before training, naming the field and the valid
values).

The CLI is the one of ``examples/fp8_lm/train.py`` (a real LightningModule and DataModule) with a tiny model;
``fit`` is replaced by a recorder, except in the one test that trains two steps.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lightning_fp8 as lf

ROOT = Path(__file__).resolve().parents[1]

# The yaml of issue 5, verbatim.
ISSUE_YAML = """\
trainer:
  plugins:
    - class_path: lightning_fp8.FP8Precision
      init_args: {recipe: delayed, amax_history_len: 16}
  callbacks:
    - class_path: lightning_fp8.FP8StatsCallback
      init_args: {log_every_n_steps: 10}
"""

TINY = """\
seed_everything: 0
trainer: {accelerator: cpu, devices: 1, logger: false, enable_checkpointing: false, enable_progress_bar: false}
model: {dim: 32, n_layers: 1, n_heads: 2, mlp_ratio: 2}
data: {seq_len: 16, batch_size: 4, val_windows: 8}
"""


@pytest.fixture(scope="module")
def lm():
    name = "fp8_lm_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "fp8_lm" / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def cli(lm, monkeypatch, tmp_path):
    """``cli(*args, yaml=...)``: the example's LightningCLI, ``fit`` subcommand, with ``trainer.fit`` replaced by
    a recorder. Extra yaml documents are written to files and passed with ``--config`` (after TINY)."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    calls = []

    class Recording(lm.LMCLI):
        def fit(self, model, **kwargs):  # LightningCLI runs this instead of trainer.fit when it is defined
            calls.append(model)

        def after_fit(self):
            pass

    def run(*args: str, yaml: str = "", subcommand: str = "fit"):
        tiny = tmp_path / "tiny.yaml"
        tiny.write_text(TINY)
        argv = [subcommand, "--config", str(tiny)]
        if yaml:
            extra = tmp_path / f"extra{len(list(tmp_path.glob('extra*.yaml')))}.yaml"
            extra.write_text(textwrap.dedent(yaml))
            argv += ["--config", str(extra)]
        result = Recording(lm.ByteTransformerLM, lm.StdlibBytes, args=[*argv, *args])
        result.fit_calls = calls
        return result

    run.calls = calls
    return run


def fp8_objects(result):
    plugin = result.trainer.precision_plugin
    stats = [c for c in result.trainer.callbacks if isinstance(c, lf.FP8StatsCallback)]
    return plugin, stats


def cli_error(cli, capsys, *args, yaml="") -> str:
    """Run the CLI expecting it to stop before training; return everything it said about why."""
    try:
        result = cli(*args, yaml=yaml)
    except SystemExit as exit:  # jsonargparse: usage + error on stderr, exit code 2
        assert exit.code == 2
        captured = capsys.readouterr()
        return captured.err + captured.out
    except ValueError as error:  # the class's own check at instantiation (jsonargparse wraps it)
        return str(error)
    finally:
        assert not cli.calls, "training started"
    pytest.fail(f"no error; fit was called {len(result.fit_calls)} time(s)")


# --------------------------------------------------------------------------------------------- the yaml form
def test_issue_yaml_instantiates_plugin_and_callback(cli):
    result = cli(yaml=ISSUE_YAML)
    plugin, stats = fp8_objects(result)
    assert type(plugin) is lf.FP8Precision
    assert plugin.recipe == lf.FP8Recipe(name="delayed", amax_history_len=16)
    assert plugin.compute_dtype is torch.bfloat16 and plugin.exclude == [] and plugin.loss_scaling == "skip_nonfinite"
    assert len(stats) == 1 and stats[0].log_every_n_steps == 10
    assert len(result.fit_calls) == 1


def test_every_plugin_and_callback_argument_from_yaml(cli):
    result = cli(
        yaml="""\
        trainer:
          plugins:
            - class_path: lightning_fp8.FP8Precision
              init_args:
                recipe: delayed
                fp8_format: e4m3
                amax_history_len: 32
                amax_compute_algo: most_recent
                margin: 1
                power_of_2_scale: true
                compute_dtype: torch.float16
                exclude: [lm_head, "blocks.0.*"]
                skip_unaligned: false
                fp8_eval: false
                loss_scaling: true
                init_scale: 1024.0
                growth_factor: 4.0
                backoff_factor: 0.25
                growth_interval: 100
                calibration_batches: 2
                statistics_every_n_steps: 4
          callbacks:
            - class_path: lightning_fp8.FP8StatsCallback
              init_args:
                log_every_n_steps: 5
                include: ["blocks.*"]
                exclude: ["*.proj"]
                histograms: false
                heatmap_every_n_logs: 3
                heatmap_max_points: 50
                overflow_alert_threshold: null
                alert_patience: 2
                summary: false
        """
    )
    plugin, (stats,) = fp8_objects(result)
    assert plugin.recipe == lf.FP8Recipe(
        name="delayed", fp8_format="e4m3", amax_history_len=32, amax_compute_algo="most_recent", margin=1,
        power_of_2_scale=True,
    )  # fmt: skip
    assert plugin.compute_dtype is torch.float16
    assert plugin.exclude == ["lm_head", "blocks.0.*"]
    # loss_scaling: true is the explicit form of "dynamic"
    assert (plugin.skip_unaligned, plugin.fp8_eval, plugin.loss_scaling) == (False, False, "dynamic")
    assert plugin.statistics_every_n_steps == 4
    assert plugin.calibration_batches == 2
    assert plugin.scaler.state_dict() == {
        "scale": 1024.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 100,
        "_growth_tracker": 0,
    }
    assert (stats.log_every_n_steps, stats.include, stats.exclude, stats.histograms) == (
        5,
        ["blocks.*"],
        ["*.proj"],
        False,
    )
    assert (stats.heatmap_every_n_logs, stats.heatmap_max_points, stats.overflow_alert_threshold) == (3, 50, None)
    assert (stats.alert_patience, stats.summary) == (2, False)


@pytest.mark.parametrize(("spelling", "dtype"), [("torch.float16", torch.float16), ("torch.bfloat16", torch.bfloat16)])
def test_compute_dtype_is_written_as_in_python(cli, spelling, dtype):
    yaml = ISSUE_YAML.replace("amax_history_len: 16}", f"amax_history_len: 16, compute_dtype: {spelling}}}")
    plugin, _ = fp8_objects(cli(yaml=yaml))
    assert plugin.compute_dtype is dtype
    plugin, _ = fp8_objects(cli("--trainer.plugins.compute_dtype", spelling, yaml=ISSUE_YAML))
    assert plugin.compute_dtype is dtype


def test_issue_yaml_trains_in_fp8(lm, monkeypatch, tmp_path):
    """The yaml form drives a real fit: the Trainer uses the instantiated plugin and callback (float16 compute)."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    (tmp_path / "tiny.yaml").write_text(TINY)
    (tmp_path / "fp8.yaml").write_text(
        ISSUE_YAML.replace("amax_history_len: 16}", "amax_history_len: 16, compute_dtype: torch.float16}")
    )
    result = lm.main(
        ["fit", "--config", str(tmp_path / "tiny.yaml"), "--config", str(tmp_path / "fp8.yaml"),
         "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
         "--trainer.default_root_dir", str(tmp_path), "--data.max_train_bytes", "200000"]
    )  # fmt: skip
    plugin, (stats,) = fp8_objects(result)
    assert result.trainer.global_step == 2
    assert isinstance(result.model.blocks[0].qkv, lf.FP8Linear) and plugin.report is not None
    assert plugin.compute_dtype is torch.float16 and len(plugin.report.fp8_layers) == 5
    assert int(result.model.blocks[0].fc.fp8_amax_history[0].count_nonzero()) == 2  # delayed: one entry per step
    assert stats.log_every_n_steps == 10 and result.trainer.callbacks.count(stats) == 1


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_recipe_from_a_flag_trains_the_example_with_statistics(lm, monkeypatch, tmp_path, recipe):
    """``--trainer.plugins.recipe blockwise`` (issue 10's acceptance): the example trains with a block recipe and
    the stats callback, which logs the block amax median next to the usual statistics."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    (tmp_path / "tiny.yaml").write_text(TINY.replace("logger: false", "logger: {class_path: CSVLogger, init_args: {save_dir: %s}}" % tmp_path))
    (tmp_path / "fp8.yaml").write_text(ISSUE_YAML.replace("log_every_n_steps: 10", "log_every_n_steps: 1"))
    result = lm.main(
        ["fit", "--config", str(tmp_path / "tiny.yaml"), "--config", str(tmp_path / "fp8.yaml"),
         "--trainer.plugins.recipe", recipe, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
         "--trainer.num_sanity_val_steps", "0", "--trainer.default_root_dir", str(tmp_path),
         "--data.max_train_bytes", "200000"]
    )  # fmt: skip
    plugin, (stats,) = fp8_objects(result)
    assert plugin.recipe == lf.FP8Recipe(name=recipe, amax_history_len=16)
    assert result.trainer.global_step == 2 and len(plugin.report.fp8_layers) == 5
    fc = result.model.blocks[0].fc
    assert isinstance(fc, lf.FP8Linear) and int(fc.fp8_counts[0, 0]) > 0  # the layers really cast
    header = (Path(result.trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "fp8/blocks.0.fc/input/block_amax_median" in header and "fp8/blocks.0.fc/grad_output/overflow_frac" in header


# --------------------------------------------------------------------------------------------- command-line flags
def test_plugins_and_callbacks_from_command_line_flags(cli):
    result = cli(
        "--trainer.plugins", "lightning_fp8.FP8Precision",
        "--trainer.plugins.recipe", "delayed",
        "--trainer.plugins.amax_history_len", "16",
        "--trainer.plugins.exclude", '["lm_head"]',
        "--trainer.callbacks", "lightning_fp8.FP8StatsCallback",
        "--trainer.callbacks.log_every_n_steps", "10",
    )  # fmt: skip
    plugin, (stats,) = fp8_objects(result)
    assert type(plugin) is lf.FP8Precision
    assert plugin.recipe == lf.FP8Recipe(name="delayed", amax_history_len=16)
    assert plugin.exclude == ["lm_head"] and stats.log_every_n_steps == 10


def test_plugins_as_one_json_flag(cli):
    value = '[{"class_path": "lightning_fp8.FP8Precision", "init_args": {"recipe": "rowwise", "margin": 0}}]'
    plugin, stats = fp8_objects(cli("--trainer.plugins", value))
    assert plugin.recipe.name == "rowwise" and stats == []


def test_flags_override_the_yaml(cli):
    result = cli(
        "--trainer.plugins.recipe", "tensorwise", "--trainer.callbacks.log_every_n_steps", "3", yaml=ISSUE_YAML
    )
    plugin, (stats,) = fp8_objects(result)
    assert plugin.recipe == lf.FP8Recipe(name="tensorwise", amax_history_len=16)  # the yaml's history length kept
    assert stats.log_every_n_steps == 3


# --------------------------------------------------------------------------------------------- --print_config
def test_print_config_round_trips(cli, capsys, tmp_path):
    args = ("--trainer.plugins.compute_dtype", "torch.float16", "--trainer.plugins.exclude", '["lm_head"]')

    def printed(*extra, yaml=ISSUE_YAML) -> str:
        with pytest.raises(SystemExit) as exit:
            cli(*extra, "--print_config", yaml=yaml)
        assert exit.value.code == 0
        return capsys.readouterr().out

    first = printed(*args)
    assert "class_path: lightning_fp8.FP8Precision" in first and "compute_dtype: torch.float16" in first
    assert "class_path: lightning_fp8.FP8StatsCallback" in first and "log_every_n_steps: 10" in first
    saved = tmp_path / "printed.yaml"
    saved.write_text(first)

    # Printing the printed config again gives the same text: nothing is lost or changed on the way.
    assert printed("--config", str(saved), yaml="") == first

    # And it instantiates the same objects as the original arguments.
    original, fed_back = cli(*args, yaml=ISSUE_YAML), cli("--config", str(saved))
    (a, (sa,)), (b, (sb,)) = fp8_objects(original), fp8_objects(fed_back)
    settings = [(p.recipe, p.compute_dtype, p.exclude, p.scaler.state_dict(), p.fp8_eval, p.loss_scaling) for p in (a, b)]
    assert settings[0] == settings[1]
    assert b.compute_dtype is torch.float16 and b.recipe.name == "delayed"
    assert vars(sa).keys() == vars(sb).keys()
    assert (sa.log_every_n_steps, sa.include, sa.exclude) == (sb.log_every_n_steps, sb.include, sb.exclude)
    assert dict(original.model.hparams) == dict(fed_back.model.hparams)


# --------------------------------------------------------------------------------------------- wrong values
PLUGIN = "trainer:\n  plugins:\n    - class_path: lightning_fp8.FP8Precision\n      init_args: {{{}}}\n"
CALLBACK = "trainer:\n  callbacks:\n    - class_path: lightning_fp8.FP8StatsCallback\n      init_args: {{{}}}\n"


@pytest.mark.parametrize(
    ("yaml", "expected"),
    [
        # Rejected while parsing (jsonargparse, from the type hints): exit code 2, message on stderr.
        (PLUGIN.format("recipe: fp9"), ['"recipe"', "fp9", "'tensorwise', 'delayed', 'rowwise'"]),
        (PLUGIN.format("fp8_format: e5m2"), ['"fp8_format"', "e5m2", "'hybrid', 'e4m3'"]),
        (PLUGIN.format("amax_compute_algo: mean"), ['"amax_compute_algo"', "'max', 'most_recent'"]),
        (PLUGIN.format("amax_history_len: sixteen"), ['"amax_history_len"', "sixteen", "int"]),
        # Rejected by FP8Precision / FP8StatsCallback when LightningCLI instantiates them, still before fit.
        (PLUGIN.format("amax_history_len: -1"), ["amax_history_len must be >= 1, got -1"]),
        (PLUGIN.format("amax_history_len: 0"), ["amax_history_len must be >= 1, got 0"]),
        (PLUGIN.format("margin: -2"), ["margin must be an int >= 0, got -2"]),
        (PLUGIN.format("compute_dtype: torch.float32"), ["compute_dtype=torch.float32", "[torch.bfloat16, torch.float16]"]),
        (PLUGIN.format("backoff_factor: 2.0"), ["backoff_factor must be in (0, 1), got 2.0"]),
        (PLUGIN.format("calibration_batches: 2"), ["calibration_batches=2 has no effect with recipe='tensorwise'"]),
        (CALLBACK.format("log_every_n_steps: 0"), ["log_every_n_steps must be None or an int >= 1, got 0"]),
        (CALLBACK.format("overflow_alert_threshold: 5"), ["overflow_alert_threshold must be in [0, 1) or None, got 5"]),
    ],
)  # fmt: skip
def test_wrong_values_fail_before_training_naming_field_and_valid_values(cli, capsys, yaml, expected):
    message = cli_error(cli, capsys, yaml=yaml)
    for text in expected:
        assert text in message, f"{text!r} not in:\n{message}"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--trainer.plugins.recipe", "fp9"), ['"recipe"', "'tensorwise', 'delayed', 'rowwise'"]),
        (("--trainer.plugins.amax_history_len", "-4"), ["amax_history_len must be >= 1, got -4"]),
        (("--trainer.callbacks.log_every_n_steps", "-1"), ["log_every_n_steps must be None or an int >= 1"]),
    ],
)
def test_wrong_values_from_flags_fail_before_training(cli, capsys, args, expected):
    message = cli_error(cli, capsys, *args, yaml=ISSUE_YAML)
    for text in expected:
        assert text in message, f"{text!r} not in:\n{message}"


@pytest.mark.parametrize(
    "yaml",
    [PLUGIN.format("amax_histroy_len: 16"), CALLBACK.format("log_every_n_step: 10")],
    ids=["plugin", "callback"],
)
def test_misspelled_key_fails_before_training_naming_the_key(cli, capsys, yaml):
    wrong, right = ("amax_histroy_len", "amax_history_len") if "histroy" in yaml else ("log_every_n_step", "log_every_n_steps")
    message = cli_error(cli, capsys, yaml=yaml)
    assert f"Option '{wrong}' is not accepted" in message, message
    # FP8ArgumentParser: the closest accepted argument and the full list.
    assert f"does not accept {wrong!r}; did you mean {right!r}? Accepted: " in message, message
    accepted = message.split("Accepted: ")[-1]
    assert right in accepted and ("growth_interval" in accepted or "overflow_alert_threshold" in accepted)


def test_dtype_without_torch_prefix_fails_before_training(cli, capsys):
    message = cli_error(cli, capsys, yaml=PLUGIN.format("compute_dtype: bfloat16"))
    assert '"compute_dtype"' in message and "bfloat16" in message
    assert "write it as torch.bfloat16" in message, message


def test_explain_parse_error_leaves_other_messages_alone():
    from lightning_fp8.cli import explain_parse_error

    assert explain_parse_error("Parser key \"x\": something else") == "Parser key \"x\": something else"
    unknown = "Problem with given class_path 'not_a_module.Thing':\n  Option 'a' is not accepted"
    assert explain_parse_error(unknown) == unknown  # unimportable class: no guess
    assert "torch.float16" in explain_parse_error("Expected a dot import path string: float16")
    assert explain_parse_error("Expected a dot import path string: notadtype").count("\n") == 0


def test_help_lists_the_plugin_arguments(cli, capsys):
    with pytest.raises(SystemExit) as exit:
        cli("--trainer.plugins.help", "lightning_fp8.FP8Precision")
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for key in ("recipe", "fp8_format", "amax_history_len", "compute_dtype", "exclude", "growth_interval"):
        assert f"--trainer.plugins.init_args.{key}" in out or f"--trainer.plugins.{key}" in out, key
