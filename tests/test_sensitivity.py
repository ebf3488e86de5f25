"""The FP8 sensitivity report (issue 12): a planted massive-activation layer is found, ranked first and excluded.

The planted model multiplies the rows of a few fixed token positions by 1e5 before one layer (and divides its output
back), as the massive activations of large language models do: per-tensor FP8 scaling then flushes the other tokens
of that layer's input (DESIGN.md: a few large *channels* would not do, E4M3's range absorbs them).
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from utils import make_trainer

import lightning_fp8 as lf
from lightning_fp8.sensitivity import EXCLUDE_FILE, MARKDOWN_FILE, PLOT_FILE, sqnr_db

DIM, TOKENS, PLANTED = 64, 16, "fc3"


class Planted(nn.Module):
    """Five Linear layers; the input of ``fc3`` carries massive activations at two token positions."""

    def __init__(self, dim: int = DIM, outlier: float = 1e5, positions: tuple[int, ...] = (0, 7)) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.fc3 = nn.Linear(dim, dim)
        self.fc4 = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 32)
        gain = torch.ones(TOKENS, 1)
        gain[list(positions)] = outlier
        self.register_buffer("gain", gain)

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        if shift is not None:
            x = x + shift
        h = self.fc2(F.gelu(self.fc1(x)))
        h = self.fc3(h * self.gain) / self.gain  # massive-activation tokens in fc3's input only
        return self.head(F.gelu(self.fc4(h)))


def square_loss(output: torch.Tensor, batch) -> torch.Tensor:
    return output.float().pow(2).mean()


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(0)
    model = Planted()
    batches = [torch.randn(4, TOKENS, DIM) for _ in range(3)]
    return model, batches


@pytest.fixture(scope="module")
def report(data):
    model, batches = data
    return lf.sensitivity_report(model, batches, loss_fn=square_loss)


def test_planted_layer_is_ranked_first_and_excluded(report, capsys):
    assert report.names[0] == PLANTED
    assert set(report.names) == {"fc1", "fc2", "fc3", "fc4", "head"}
    planted = report.layer(PLANTED)
    others = [e for e in report.layers if e.name != PLANTED]
    assert planted.output_token_sqnr_db < 15
    assert all(e.output_token_sqnr_db > 20 for e in others)
    # per tensor, the planted layer looks like any other: the ruined tokens hold almost no energy
    assert planted.output_sqnr_db > 20
    assert all(e.score_db > 20 for e in others)
    assert planted.underflow["input"] > 0.1 and all(e.underflow["input"] < 0.01 for e in others)
    assert planted.baseline_score_db > 40  # bf16 alone is fine
    # gradients were measured
    assert all(e.grad_input_token_sqnr_db is not None and e.grad_weight_sqnr_db is not None for e in report.layers)
    assert all(e.grad_weight_sqnr_db > 15 for e in others)
    assert report.exclude(top=1) == [PLANTED]
    assert report.exclude() == [PLANTED]  # the default threshold
    assert report.exclude(threshold_db=-1000) == [] and report.exclude(top=0) == []
    assert report.exclude(top=2, prefix="net") == ["net." + n for n in report.names[:2]]
    table = report.to_markdown()
    assert table.index(f"`{PLANTED}`") < min(table.index(f"`{e.name}`") for e in others)
    with capsys.disabled():
        print(
            f"\nplanted {PLANTED}: per-token output SQNR {planted.output_token_sqnr_db:.1f} dB, others "
            + ", ".join(f"{e.name} {e.output_token_sqnr_db:.1f}" for e in others)
            + f"; scores: {', '.join(f'{e.name} {e.score_db:.1f}' for e in report.layers)}"
        )


def test_the_exclude_list_brings_the_layer_back_to_the_bf16_level(data, report, capsys):
    model, _ = data
    torch.manual_seed(1)
    x = torch.randn(8, TOKENS, DIM)
    reference = copy.deepcopy(model).double()(x.double())
    inputs = {}
    handle = model.fc3.register_forward_hook(lambda m, args, out: inputs.setdefault("fc3", args[0].detach()))
    model(x)
    handle.remove()
    fc3_ref = F.linear(inputs["fc3"].double(), model.fc3.weight.double(), model.fc3.bias.double())

    def measure(candidate: nn.Module, fp8: bool) -> tuple[float, float]:
        """(model output SQNR, fc3's per-token output SQNR on the high-precision input) against float64."""
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), lf.fp8_autocast(enabled=fp8):
            out = candidate(x)
            fc3 = candidate.fc3(inputs["fc3"])
        return sqnr_db(out, reference).item(), sqnr_db(fc3, fc3_ref, per_row=True).mean().item()

    bf16 = measure(model, fp8=False)
    all_fp8 = copy.deepcopy(model)
    lf.convert_to_fp8(all_fp8, log_summary=False)
    excluded = copy.deepcopy(model)
    lf.convert_to_fp8(excluded, exclude=report.exclude(top=1), log_summary=False)
    assert type(excluded.fc3) is nn.Linear and isinstance(excluded.fc4, lf.FP8Linear)
    without, with_exclude = measure(all_fp8, fp8=True), measure(excluded, fp8=True)
    assert without[1] < 15
    assert abs(with_exclude[1] - bf16[1]) < 0.5  # the layer's error is bf16's again
    assert abs(with_exclude[1] - report.layer(PLANTED).baseline["output_token_sqnr_db"]) < 3
    assert with_exclude[0] > without[0] + 6  # and the model's output is much closer to float64
    # a training step with the exclude list runs and gives finite gradients
    excluded.train()
    with torch.autocast("cpu", dtype=torch.bfloat16), lf.fp8_autocast():
        loss = square_loss(excluded(x), x)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in excluded.parameters() if p.requires_grad)
    with capsys.disabled():
        print(
            f"\nmodel output SQNR vs float64: all FP8 {without[0]:.1f} dB, FP8 with exclude={report.exclude(top=1)} "
            f"{with_exclude[0]:.1f} dB, bf16 {bf16[0]:.1f} dB; {PLANTED} per-token: {without[1]:.1f} / "
            f"{with_exclude[1]:.1f} / {bf16[1]:.1f} dB"
        )


def _snapshot(model: nn.Module) -> dict:
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "classes": {name: type(m) for name, m in model.named_modules()},
        "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "training": {name: m.training for name, m in model.named_modules()},
        "grads": {name: p.grad for name, p in model.named_parameters()},
    }


def _assert_same(before: dict, model: nn.Module) -> None:
    after = _snapshot(model)
    assert before["params"].keys() == after["params"].keys()
    assert all(torch.equal(before["params"][k], after["params"][k]) for k in before["params"])
    for key in ("classes", "requires_grad", "training", "grads"):
        assert before[key] == after[key], key


def test_the_users_model_is_unchanged_and_batches_may_be_tuples_or_dicts(data, report):
    model, batches = data
    model.train()
    model.fc1.eval()
    model.fc2.weight.requires_grad_(False)
    rng = torch.random.get_rng_state()
    before = _snapshot(model)
    try:
        shift = torch.zeros(DIM)
        as_tuples = lf.sensitivity_report(model, [(b, shift) for b in batches], loss_fn=square_loss)
        _assert_same(before, model)
        as_dicts = lf.sensitivity_report(model, ({"x": b, "shift": shift} for b in batches), num_batches=2)
        _assert_same(before, model)
    finally:
        model.fc2.weight.requires_grad_(True)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert as_tuples.names[0] == as_dicts.names[0] == PLANTED
    assert as_dicts.num_batches == 2 and not as_dicts.gradients
    assert as_dicts.layer("fc1").grad_weight_sqnr_db is None and "grad_output" not in as_dicts.layer("fc1").overflow
    # the frozen weight's gradient GEMM is measured anyway (on the copy)
    assert as_tuples.layer("fc2").grad_weight_sqnr_db is not None
    assert as_tuples.layer(PLANTED).output_token_sqnr_db == pytest.approx(report.layer(PLANTED).output_token_sqnr_db)

    # an FP8 model is measured as its high-precision twin, and stays FP8 with its state
    fp8_model = copy.deepcopy(model)
    lf.convert_to_fp8(fp8_model, exclude=["head"], log_summary=False)
    state = lf.fp8_state_dict(fp8_model)
    before = _snapshot(fp8_model)
    again = lf.sensitivity_report(fp8_model, batches[:1], loss_fn=square_loss, loss_delta=True)
    _assert_same(before, fp8_model)
    after = lf.fp8_state_dict(fp8_model)
    assert all(torch.equal(a, b) for a, b in zip(state["tables"][0].values(), after["tables"][0].values())
               if isinstance(a, torch.Tensor))
    assert again.names[0] == PLANTED and "head" in again.names  # excluded layers are measured too
    assert all(e.loss_delta is not None for e in again.layers)


def test_save_writes_the_table_the_chart_and_a_yaml_that_parses_to_the_exclude_list(report, tmp_path):
    paths = report.save(tmp_path / "out", top=1)
    assert {p.name for p in paths.values()} == {MARKDOWN_FILE, PLOT_FILE, EXCLUDE_FILE}
    assert paths["markdown"].read_text() == report.to_markdown()
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert yaml.safe_load(paths["exclude"].read_text()) == {"exclude": [PLANTED]}
    paths = report.save(tmp_path / "thr", threshold_db=-1000)
    assert yaml.safe_load(paths["exclude"].read_text()) == {"exclude": []}
    # the names are exact fnmatch patterns the plugin accepts
    lf.FP8Precision(exclude=yaml.safe_load(report.exclude_yaml(top=2))["exclude"])


def test_bad_inputs_raise_clear_errors(data, report):
    model, batches = data
    with pytest.raises(ValueError, match="empty"):
        lf.sensitivity_report(model, [])
    with pytest.raises(ValueError, match="no nn.Linear layer"):
        lf.sensitivity_report(nn.Sequential(nn.ReLU()), batches)
    with pytest.raises(ValueError, match="would run in FP8"):
        lf.sensitivity_report(nn.Linear(10, 10), [torch.randn(2, 10)])
    with pytest.raises(ValueError, match="not both"):
        report.exclude(threshold_db=10, top=1)
    with pytest.raises(ValueError, match="top must be"):
        report.exclude(top=-1)
    with pytest.raises(ValueError, match="loss_delta"):
        lf.sensitivity_report(model, batches, loss_delta=True)
    with pytest.raises(ValueError, match="not both"):
        lf.sensitivity_report(model, batches, loss_fn=square_loss, step_fn=lambda m, b: m(b).sum())
    with pytest.raises(ValueError, match="wrap one batch"):
        lf.sensitivity_report(model, batches[0])
    with pytest.raises(ValueError, match="recipe"):
        lf.sensitivity_report(model, batches, recipe="nope")


class LitPlanted(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Planted()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class RngProbe(L.Callback):
    def __init__(self) -> None:
        self.states = []

    def on_train_start(self, trainer, pl_module):
        self.states.append(torch.random.get_rng_state())


def test_callback_on_a_trainer_with_fp8_precision(tmp_path):
    torch.manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(24, TOKENS, DIM), torch.randn(24, TOKENS, 32))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)
    callback = lf.FP8SensitivityCallback(num_batches=2, top=1)
    before, after = RngProbe(), RngProbe()
    trainer = make_trainer(
        lf.FP8Precision(), callbacks=[before, callback, after], max_steps=2, default_root_dir=tmp_path
    )
    module = LitPlanted()
    trainer.fit(module, loader)
    assert trainer.global_step == 2
    report = callback.report
    assert report is not None and report.num_batches == 2 and report.gradients
    assert report.recipe == trainer.precision_plugin.recipe
    assert report.names[0] == f"net.{PLANTED}"  # the LightningModule's names: what the plugin matches
    assert report.exclude(top=1) == [f"net.{PLANTED}"]
    folder = tmp_path / "fp8_sensitivity"
    assert {p.name for p in folder.iterdir()} == {MARKDOWN_FILE, PLOT_FILE, EXCLUDE_FILE}
    assert callback.paths["exclude"].parent == folder
    assert yaml.safe_load((folder / EXCLUDE_FILE).read_text()) == {"exclude": [f"net.{PLANTED}"]}
    assert torch.equal(before.states[0], after.states[0])  # the data order and dropout are not shifted
    assert isinstance(module.net.fc3, lf.FP8Linear)  # the trained model is still the plugin's
    # the written list is accepted by the plugin on the next run
    excluded = make_trainer(lf.FP8Precision(exclude=report.exclude(top=1)), max_steps=1, default_root_dir=tmp_path)
    module = LitPlanted()
    excluded.fit(module, loader)
    assert type(module.net.fc3) is torch.nn.Linear and isinstance(module.net.fc4, lf.FP8Linear)


def test_callback_with_input_fn_and_loss_fn_without_the_plugin(tmp_path):
    dataset = torch.utils.data.TensorDataset(torch.randn(8, TOKENS, DIM), torch.randn(8, TOKENS, 32))
    callback = lf.FP8SensitivityCallback(
        num_batches=1, recipe="rowwise", input_fn=lambda batch: batch[0],
        loss_fn=lambda output, batch: F.mse_loss(output, batch[1]), folder="report",
    )
    trainer = make_trainer(callbacks=[callback], max_steps=1, default_root_dir=tmp_path)
    trainer.fit(LitPlanted(), torch.utils.data.DataLoader(dataset, batch_size=4))
    report = callback.report
    assert report.recipe.name == "rowwise" and report.gradients and report.num_batches == 1
    assert report.names[0] == f"net.{PLANTED}"
    # row-wise scales give each token its own scale: the forward GEMM keeps the ordinary tokens
    assert report.layer(f"net.{PLANTED}").output_token_sqnr_db > 20
    assert (tmp_path / "report" / EXCLUDE_FILE).is_file()
    with pytest.raises(ValueError, match="not both"):
        lf.FP8SensitivityCallback(threshold_db=10, top=1)
    with pytest.raises(ValueError, match="needs input_fn"):
        lf.FP8SensitivityCallback(loss_fn=square_loss)


def test_delayed_layer_called_twice_per_forward_rolls_its_history_once_per_batch():
    """Training rolls a delayed layer's history once per step, for all its calls: the second call of a shared layer
    must not be cast with a scale taken from the first call of the same batch (here 100 times smaller)."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return self.fc(100 * self.fc(x))

    torch.manual_seed(0)
    report = lf.sensitivity_report(Twice(), [torch.randn(8, 32)], "delayed", loss_fn=lambda out, batch: out.pow(2).mean())
    entry = report.layer("fc")
    assert entry.calls == 2
    assert entry.overflow == {"input": 0.0, "weight": 0.0, "grad_output": 0.0}
