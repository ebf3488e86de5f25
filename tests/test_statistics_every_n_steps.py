"""``statistics_every_n_steps``: the plugins count (nonzero / overflow / underflow elements, slice-amax histograms) on
one training step in n and record the amaxes and scales on every step.

What must hold: training is bit-identical whatever n (the counts never feed the numerics); the counters are exactly
the sums over the counting steps; a resume counts on the steps the uninterrupted run counts on; the stats callback
logs fractions for the intervals that hold a counting step and none for the others; compiled, the counting and the
other steps run one graph each and count what eager counts.
"""

from __future__ import annotations

import csv

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from models import TinyDecoder, loader
from torch import nn
from utils import make_trainer, per_layer

import lightning_fp8 as lf
from lightning_fp8 import FP8Precision, FP8StatsCallback
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision
from lightning_fp8.quantize import quantize
from lightning_fp8.recipe import INPUT, RECIPES, resolve_recipe
from lightning_fp8.state import FP8StateTable

STEPS, ACCUMULATE = 5, 2
COUNTED = ("counts", "amax_bins")  # the fields a step that does not count leaves alone


def _model():
    torch.manual_seed(0)
    return TinyDecoder(dim=32, heads=2, layers=1, seq_len=16)


def _data():
    return loader(seq_len=16, batch_size=4, n=STEPS * ACCUMULATE * 4 * 16 + 1)


class _StateAfterEachStep(Callback):
    """The FP8 state after every optimizer step."""

    def __init__(self):
        self.states = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % ACCUMULATE == 0:
            layers = per_layer(lf.fp8_state_dict(pl_module)).items()
            self.states.append({k: {f: v.clone() for f, v in e.items() if isinstance(v, torch.Tensor)} for k, e in layers})


def _fit(every, recipe, **kwargs):
    model, states = _model(), _StateAfterEachStep()
    plugin = FP8Precision(recipe=recipe, statistics_every_n_steps=every)
    trainer = make_trainer(plugin, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, callbacks=[states], **kwargs)
    trainer.fit(model, _data())
    return model, plugin, states.states


@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
def test_counting_every_third_step_trains_identically_and_counts_the_counting_steps_alone(recipe):
    every_step, _, each = _fit(1, recipe)
    third, plugin, _ = _fit(3, recipe)
    assert [t.statistics_step for t in plugin.state_tables] == [STEPS]
    for name, a in every_step.state_dict().items():  # the counts never feed the numerics
        assert torch.equal(a, third.state_dict()[name]), name
    counting = [k for k in range(STEPS) if k % 3 == 0]  # steps 0 and 3
    got = per_layer(lf.fp8_state_dict(third))
    assert got
    for name, entry in per_layer(lf.fp8_state_dict(every_step)).items():
        for field, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            if field in COUNTED:
                # the sum over the counting steps of what each step added in the run that counts on every step
                expected = sum(each[k][name][field] - (each[k - 1][name][field] if k else 0) for k in counting)
                assert torch.equal(got[name][field], expected), (name, field)
                if value.numel():  # per-tensor recipes keep no histogram
                    assert int(value.sum()) > int(expected.sum()) > 0, (name, field)  # it counted, and less
            else:
                assert torch.equal(got[name][field], value), (name, field)  # amaxes, histories, scales: every step


def test_a_resumed_run_counts_on_the_steps_of_the_uninterrupted_one(tmp_path):
    epoch = loader(seq_len=16, batch_size=4, n=2 * ACCUMULATE * 4 * 16 + 1)  # two optimizer steps per epoch

    def fit(model, epochs, plugin, **kwargs):
        trainer = make_trainer(plugin, max_epochs=epochs, accumulate_grad_batches=ACCUMULATE)
        trainer.fit(model, epoch, **kwargs)
        return trainer

    straight = _model()
    fit(straight, 3, FP8Precision(statistics_every_n_steps=3))  # steps 0 to 5: 0 and 3 count
    trainer = fit(_model(), 1, FP8Precision(statistics_every_n_steps=3))
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    assert torch.load(tmp_path / "two.ckpt", weights_only=True)["FP8Precision"]["statistics_steps"] == [[2]]
    resumed, plugin = _model(), FP8Precision(statistics_every_n_steps=3)
    fit(resumed, 3, plugin, ckpt_path=tmp_path / "two.ckpt")
    assert [t.statistics_step for t in plugin.state_tables] == [6]
    s, r = per_layer(lf.fp8_state_dict(straight)), per_layer(lf.fp8_state_dict(resumed))
    for name, entry in s.items():
        for field, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, r[name][field]), (name, field)
    # and a resume that forgot the step count would count on other steps: the counters would differ
    assert int(s["blocks.0.fc"]["counts"][INPUT, 0]) == 2 * ACCUMULATE * 4 * 16 * 32


def test_the_stats_callback_logs_fractions_for_intervals_with_a_counting_step_alone(tmp_path):
    model = _model()
    logger = CSVLogger(tmp_path, name="run")
    trainer = make_trainer(
        FP8Precision(statistics_every_n_steps=2),
        max_steps=4,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[FP8StatsCallback(summary=False, histograms=False)],
    )
    trainer.fit(model, loader(seq_len=16, batch_size=4, n=4 * 4 * 16 + 1))
    layer = "blocks.0.fc"
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get(f"fp8/{layer}/input/amax")]
    logged = {int(r["step"]): r for r in rows}
    assert len(logged) == 4, sorted(logged)
    first = min(logged)
    for step, row in logged.items():  # one reading after each optimizer step: steps 0 and 2 counted
        assert row[f"fp8/{layer}/input/scale"] != ""
        fraction = row.get(f"fp8/{layer}/input/underflow_frac", "")
        assert (fraction != "") == ((step - first) % 2 == 0), (step, fraction)


def test_compiled_counting_and_other_steps_run_one_graph_each_and_count_as_eager():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    eager = _model()
    make_trainer(FP8Precision(statistics_every_n_steps=2), max_steps=STEPS).fit(eager, _data())
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    model = _model()
    model.blocks[0] = torch.compile(model.blocks[0], backend=backend)
    # one micro-batch per step: compiled, a weight's cast (and its counts) is per micro-batch, not per optimizer step
    trainer = make_trainer(FP8Precision(statistics_every_n_steps=2), max_steps=STEPS, val_check_interval=1,
                           limit_val_batches=1, check_val_every_n_epoch=None)  # fmt: skip
    trainer.fit(model, _data(), _data())
    # the counting steps' graph, the others', and one for evaluation (which records nothing: its graph reads no flag)
    assert backend.frame_count == 3
    assert dict(counters["graph_break"]) == {}
    e, c = per_layer(lf.fp8_state_dict(eager)), per_layer(lf.fp8_state_dict(model))
    assert {n.replace("._orig_mod", "") for n in c} == set(e)
    for name, entry in c.items():
        twin = e[name.replace("._orig_mod", "")]
        assert torch.equal(entry["counts"], twin["counts"]), name
    # steps 0, 2 and 4 of five counted: 3 batches of 4 x 16 tokens of width 32
    assert int(c["blocks.0._orig_mod.fc"]["counts"][INPUT, 0]) == 3 * 4 * 16 * 32


def test_the_overflow_alert_sees_a_streak_across_logs_that_counted_nothing(tmp_path):
    import warnings

    from test_fallback import Planted
    from test_fallback import loader as planted_data

    torch.manual_seed(0)
    stats = FP8StatsCallback(log_every_n_steps=1, overflow_alert_threshold=0.01, alert_patience=2, summary=False,
                             histograms=False)  # fmt: skip
    trainer = make_trainer(FP8Precision(recipe="delayed", statistics_every_n_steps=2), max_steps=10, callbacks=[stats])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Planted(), planted_data())
    # the input of `mid` overflows from step 4 on; every other log counted nothing and must not reset the streak
    assert any("'mid' (input) has overflowed" in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_without_counters_keeps_amax_scale_and_bits(recipe):
    spec = resolve_recipe(recipe).cast_specs().forward[0]
    x = torch.randn(64, 96) * 3
    x[0, 0] = 0.0
    history = {}
    if spec.scale_source == "history":  # no usable history yet: the current amax gives the scale
        history = {"history_scale": torch.tensor(1.0), "history_ready": torch.tensor(False)}
    counted = quantize(x, spec, **history)
    q = quantize(x, spec, counters=False, **history)
    assert torch.equal(q.data.view(torch.uint8), counted.data.view(torch.uint8))
    assert torch.equal(q.scale, counted.scale)
    assert q.stats is not None and q.stats.counts is None and q.stats.amax_bins is None
    assert torch.equal(q.stats.amax, counted.stats.amax) and torch.equal(q.stats.scale, counted.stats.scale)
    table = FP8StateTable(resolve_recipe(recipe), num_layers=1)
    table.record(0, INPUT, counted.stats.amax, counted.stats.scale, counted.stats.numel, counted.stats.counts,
                 counted.stats.amax_bins)  # fmt: skip
    counts, bins = table.role_counts[INPUT].clone(), table.role_amax_bins[INPUT].clone()
    table.record(0, INPUT, q.stats.amax * 2, q.stats.scale, q.stats.numel, None)
    assert torch.equal(table.role_counts[INPUT], counts) and torch.equal(table.role_amax_bins[INPUT], bins)
    assert float(table.role_amax_pending[INPUT][0]) == float(counted.stats.amax) * 2  # the amax is recorded


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", None])
def test_statistics_every_n_steps_must_be_a_positive_int(value):
    for plugin in (FP8Precision, FabricFP8Precision):
        with pytest.raises(ValueError, match=r"statistics_every_n_steps must be an int >= 1, got"):
            plugin(statistics_every_n_steps=value)


def _fabric(every):
    from lightning.fabric import Fabric

    return Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision(statistics_every_n_steps=every)])


def _two_models(fabric):
    """Two Linear layers set up as two models, each with its own SGD."""
    torch.manual_seed(0)
    return [fabric.setup(m, torch.optim.SGD(m.parameters(), lr=0.01)) for m in (nn.Linear(32, 32), nn.Linear(32, 32))]


def test_fabric_counts_every_nth_step_of_each_model_and_once_for_two_optimizers_of_one_step():
    fabric = _fabric(2)
    (first, opt1), (second, opt2) = _two_models(fabric)
    seen = []
    for _ in range(4):  # one step: one forward through both models, both optimizers step
        fabric.backward(second(first(torch.randn(8, 32))).float().square().mean())
        for optimizer in (opt1, opt2):
            optimizer.step()
            optimizer.zero_grad()
        seen.append((int(first.module.fp8_counts[INPUT, 0]), int(second.module.fp8_counts[INPUT, 0])))
    assert seen == [(256, 256), (256, 256), (512, 512), (512, 512)]  # steps 0 and 2 counted, for both


def test_models_taking_turns_each_count_on_their_own_steps():
    # A GAN's schedule in a Fabric loop: each model does its own forward, backward and optimizer step, in turn. One
    # step count for the plugin would alias with n=2 (the second model's steps always odd: it would never count).
    fabric = _fabric(2)
    (a, opt_a), (b, opt_b) = _two_models(fabric)
    for _ in range(4):
        for model, optimizer in ((a, opt_a), (b, opt_b)):
            fabric.backward(model(torch.randn(8, 32)).float().square().mean())
            optimizer.step()
            optimizer.zero_grad()
    # each model's steps 0 and 2 counted: two steps of 8 x 32 inputs; the amaxes on every step
    assert int(a.module.fp8_counts[INPUT, 0]) == int(b.module.fp8_counts[INPUT, 0]) == 2 * 8 * 32
    assert int((b.module.fp8_amax_history[INPUT] > 0).sum()) == 4


def test_a_standalone_region_that_does_not_count_records_amaxes_alone_and_inner_regions_follow_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    lf.convert_to_fp8(model, recipe="delayed")
    x = torch.randn(8, 32)
    with lf.fp8_autocast(count_statistics=False):
        with lf.fp8_autocast():  # an inner region follows the outermost one
            model(x).square().mean().backward()
    assert int(model[0].fp8_counts.sum()) == 0 and int(model[2].fp8_counts.sum()) == 0
    assert bool((model[0].fp8_amax_history[:, 0] > 0).all())  # input, weight and grad_output amaxes rolled in
    with lf.fp8_autocast():
        model(x).square().mean().backward()
    assert int(model[0].fp8_counts[INPUT, 0]) == 8 * 32


class _BodyHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x, which="body"):
        return getattr(self, which)(x)


def test_a_nested_forward_leaves_the_outer_regions_decision_alone():
    # the wrapped model called inside fabric.autocast() enters the plugin's region a second time; on its exit the
    # outer region must still not count on the steps in between (a review found it counting on every step)
    fabric = _fabric(2)
    torch.manual_seed(0)
    net = _BodyHead()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    seen = []
    for _ in range(4):
        with fabric.autocast():
            out = model.module.head(model(torch.randn(8, 32)))
        fabric.backward(out.float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
        seen.append(int(net.head.fp8_counts[INPUT, 0]))
    assert seen == [256, 256, 512, 512]


def test_optimizers_taking_turns_over_parts_of_one_model_count_one_step_per_round():
    # one table, two optimizers taking turns (a generator and a discriminator in one module): the first optimizer
    # keeps time; with one step per optimizer step the second part would never count with n=2
    fabric = _fabric(2)
    torch.manual_seed(0)
    net = _BodyHead()
    opt_body = torch.optim.SGD(net.body.parameters(), lr=0.01)
    opt_head = torch.optim.SGD(net.head.parameters(), lr=0.01)
    model, opt_body, opt_head = fabric.setup(net, opt_body, opt_head)
    for _ in range(4):
        for which, optimizer in (("body", opt_body), ("head", opt_head)):
            fabric.backward(model(torch.randn(8, 32), which).float().square().mean())
            optimizer.step()
            optimizer.zero_grad()
    assert int(net.body.fp8_counts[INPUT, 0]) == int(net.head.fp8_counts[INPUT, 0]) == 2 * 8 * 32
    assert [t.statistics_step for t in fabric._precision.state_tables] == [4]
