"""Messages quoted in the docs are the messages the code prints.

Every paragraph of a ```` ```text ```` block in README.md, examples/README.md or docs/ that starts like one of our
messages (an alert, an error, the setup line, a parse-error hint) must match a message that the code really
produces here: each is triggered below through the public API (a real Trainer, Fabric or LightningCLI where that is
where the message comes from). Whitespace may be re-wrapped and ``...`` elides any text. A quote that matches no
message (stale wording, wrong advice, a changed number format) fails the test, and so does a new quote whose kind
of message is not triggered here.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_fp8 import FP8Precision, FP8StatsCallback
from lightning_fp8.cli import FP8ArgumentParser
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# How our messages start; a quoted paragraph starting otherwise (a table, a formula, a diagram) is not checked.
MESSAGE_STARTS = ("FP8:", "ValueError:", "lightning_fp8:", "FP8 active:", "Parser key", "lightning_fp8.FP8Precision does")
TEXT_BLOCK = re.compile(r"^( *)```text[^\n]*\n(.*?)^\1```", re.DOTALL | re.MULTILINE)


def quoted_messages() -> list[tuple[str, str]]:
    """(where, text) of every quoted message on the pages: a paragraph, or one ``ValueError:`` line of several."""
    found = []
    for page in PAGES:
        source = page.read_text()
        for block in TEXT_BLOCK.finditer(source):
            line = source[: block.start()].count("\n") + 1
            for paragraph in re.split(r"\n\s*\n", block.group(2)):
                parts = re.split(r"\n(?=\s*ValueError:)", paragraph.strip())
                for part in parts:
                    if part.strip().startswith(MESSAGE_STARTS):
                        found.append((f"{page.relative_to(ROOT)}:{line}", part.strip()))
    return found


def as_pattern(quote: str) -> re.Pattern[str]:
    """The quote as a regex: any run of whitespace matches any whitespace, ``...`` matches anything."""
    pieces = []
    for piece in re.split(r"(\.\.\.|\s+)", quote):
        if piece == "...":
            pieces.append(r".*?")
        elif piece and piece.isspace():
            pieces.append(r"\s+")
        elif piece:
            pieces.append(re.escape(piece))
    return re.compile("".join(pieces), re.DOTALL)


def _value_error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return f"ValueError: {info.value}"


def _alerts() -> list[str]:
    """The stats callback's two alerts, as it words them for a ``delayed`` layer."""
    callback = FP8StatsCallback(overflow_alert_threshold=0.01, alert_patience=3)
    callback.last_metrics = {"fp8/blocks.0.fc/input/overflow_frac": 0.025}
    layer = SimpleNamespace(recipe="delayed", history=[[1.0], [1.0], [1.0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            callback._alerts({"blocks.0.fc": layer})
        callback._alerts({"blocks.0.fc": SimpleNamespace(recipe="delayed", history=[[float("nan")], [1.0], [1.0]])})
    return [str(w.message) for w in caught]


def _setup_lines() -> list[str]:
    """The plugin's setup line for models like the ones the pages show."""
    models = [
        nn.Sequential(*(nn.Linear(32, 32) for _ in range(17))),  # installation.md: the example LM's 17 layers
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)),  # quickstart.md
        nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 50257)),  # troubleshooting.md: an unaligned head
    ]
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        for model in models:
            fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision()])
            fabric.setup(model)(torch.randn(2, 32))  # the line is logged at the first forward
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    lines = [r.getMessage() for r in records if "FP8 active" in r.getMessage()]
    assert len(lines) == len(models), lines
    return lines


def _trainer_errors(tmp_path) -> list[str]:
    from lightning.pytorch.strategies import FSDPStrategy

    class NoLinear(BoringModel):
        def __init__(self):
            super().__init__()
            self.layer = nn.Conv1d(32, 2, 1)

    def fit(model, **kwargs):
        trainer = L.Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, **kwargs)
        trainer.fit(model)

    messages = [_value_error(lambda: fit(NoLinear(), plugins=[FP8Precision()]))]
    # The Trainer refuses FSDP on a CPU before the plugin is asked; on a GPU the plugin's check runs at
    # convert_module, with the module attached to the Trainer: ask it that way.
    model = BoringModel()
    model._trainer = SimpleNamespace(strategy=FSDPStrategy())
    messages.append(_value_error(lambda: FP8Precision().convert_module(model)))
    return messages


def _checkpoint_error() -> str:
    saved = FabricFP8Precision(recipe="delayed").state_dict()
    return _value_error(lambda: FabricFP8Precision(recipe="tensorwise").load_state_dict(saved))


def _cli_errors(capsys, tmp_path) -> list[str]:
    messages = []
    for args in (["--trainer.plugins=lightning_fp8.FP8Precision", "--trainer.plugins.recipe=delayd"],
                 ["--trainer.plugins=lightning_fp8.FP8Precision", "--trainer.plugins.amax_histroy_len=16"]):
        with pytest.raises(SystemExit):
            LightningCLI(BoringModel, run=False, parser_class=FP8ArgumentParser, save_config_callback=None,
                         trainer_defaults={"default_root_dir": str(tmp_path), "logger": False}, args=args)
        messages.append(capsys.readouterr().err)
    return messages


def test_every_quoted_message_is_what_the_code_prints(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["main.py"])  # LightningCLI(args=...) warns when the command line has arguments too
    messages = _alerts() + _setup_lines() + _trainer_errors(tmp_path)
    messages += [_checkpoint_error()]
    messages += [_value_error(lambda: FP8Precision(recipe="delayd")),
                 _value_error(lambda: FP8Precision(compute_dtype=torch.float64)),
                 _value_error(lambda: FP8Precision(amax_history_len=0))]
    messages += _cli_errors(capsys, tmp_path)
    quotes = quoted_messages()
    assert len(quotes) >= 12, quotes  # the pages quote alerts, errors and setup lines: the scan must find them
    stale = [f"{where}:\n{quote}" for where, quote in quotes
             if not any(as_pattern(quote).search(message) for message in messages)]
    assert not stale, "quoted in the docs but not printed by the code:\n\n" + "\n\n".join(stale) + (
        "\n\nwhat the code prints:\n\n" + "\n\n".join(messages))


def test_the_pattern_rewraps_and_elides_but_checks_every_word():
    pattern = as_pattern("FP8: layer 'a' (input) has\noverflowed ... logs")
    assert pattern.search("FP8: layer 'a' (input) has overflowed on 2.50% of its elements for 3 logs")
    assert not pattern.search("FP8: layer 'a' (input) has underflowed on 2.50% of its elements for 3 logs")


def test_quoted_summary_tables_have_the_code_s_title_columns_and_number_formats():
    """The end-of-fit summary table quoted on the pages: its title and columns are the code's, and each row has the
    code's shape (layer, tensor, two percentages with three decimals, amax, scale). The numbers come from a run."""
    title, header = FP8StatsCallback().summary_table().splitlines()
    row = re.compile(r"^\S+\s+(input|weight|grad_output)\s+\d+\.\d{3}%\s+\d+\.\d{3}%\s+\S+\s+\S+$")
    tables = []
    for page in PAGES:
        source = page.read_text()
        for block in TEXT_BLOCK.finditer(source):
            lines = block.group(2).strip().splitlines()
            if lines and lines[0].strip().startswith("FP8 summary"):
                tables.append((page.relative_to(ROOT), lines))
    assert tables, "the pages quote the summary table: the scan must find it"
    for where, lines in tables:
        assert lines[0].strip() == title, where
        assert lines[1].split() == header.split(), where
        rows = [line for line in lines[2:] if line.strip() not in ("...", "") and not line.startswith("FP8 amax heatmap")]
        assert rows and all(row.match(line.strip()) for line in rows), (where, rows)
