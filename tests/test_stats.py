"""FP8Stats: one snapshot, one reduction, one host copy -> named metrics; usable without the Trainer."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

import lightning_fp8 as lf
from lightning_fp8 import FP8Stats
from lightning_fp8.fabric import FP8Precision


def _model():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    lf.convert_to_fp8(model, recipe="delayed")
    return model


def _seeded_model(recipe="delayed"):
    """:func:`_model`'s layers with the same weights at every call (a run and its resumed twin)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    lf.convert_to_fp8(model, recipe=recipe)
    return model


def _steps(model, n, scale=1.0):
    for _ in range(n):
        x = torch.randn(8, 32) * scale
        with lf.fp8_autocast():
            y = model(x)
        y.square().mean().backward()


def test_metrics_of_a_model_and_their_intervals():
    model = _model()
    stats = FP8Stats(model)
    stats.take_baseline()
    _steps(model, 2)
    first = stats.metrics()
    assert stats.fetches == 2 and stats.layer_names == ["0", "2"]
    layer = model[0]
    assert first["fp8/0/input/amax"] == float(layer.fp8_amax_history[0, 0])
    assert first["fp8/0/weight/scale"] == float(layer.fp8_scale[1])
    assert first["fp8/0/input/overflow_frac"] == 0.0
    assert "fp8/loss_scale" not in first and first["fp8/skipped_steps"] == 0.0  # no plugin: no loss scaler
    assert first["fp8/scale_min"] <= first["fp8/scale_max"]
    # the next interval: a step whose input outgrows the delayed scale saturates (only this interval counts)
    _steps(model, 1, scale=100.0)
    second = stats.metrics()
    over = second["fp8/0/input/overflow_frac"]
    assert 0 < over < 1 and second["fp8/worst/overflow_frac"] >= over
    seen, _, overflow, _ = stats.total_counts["0"][0]
    assert seen == 3 * 8 * 32 and overflow == round(over * 8 * 32)
    # nothing ran: no fractions, only the levels
    third = stats.metrics()
    assert "fp8/0/input/overflow_frac" not in third and "fp8/0/input/amax" in third


def test_counter_restart_takes_a_new_baseline():
    """Counters that restart from zero (a multi-rank resume) must not give negative interval counts."""
    model = _model()
    stats = FP8Stats(model)
    _steps(model, 3)
    stats.metrics()
    for table in lf.state.state_tables(model):
        table.reset_counters()
    _steps(model, 1, scale=100.0)
    metrics = stats.metrics()
    assert 0 < metrics["fp8/0/input/overflow_frac"] < 1
    assert all(v >= 0 for role in stats.total_counts["0"] for v in role)
    assert stats.total_counts["0"][0][0] == 4 * 8 * 32


@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
def test_a_checkpoint_carries_its_unread_interval_to_counters_that_restart(recipe):
    """Steps recorded after the last reading and before a checkpoint: resumed where the counters restart from zero (more
    than one rank saved or loads), the first interval and the totals include them; resumed with the counters restored
    exactly (one rank), they are not counted twice. Both give the straight run's metrics and totals."""
    straight = _seeded_model(recipe)
    stats = FP8Stats(straight)
    stats.take_baseline()
    _steps(straight, 1)
    lf.roll_amax_history(straight)
    stats.metrics()
    _steps(straight, 2, scale=30.0)  # recorded, not read before the checkpoint
    saved_stats, saved_fp8 = copy.deepcopy(stats.state_dict()), lf.fp8_state_dict(straight)
    assert stats.total_counts["0"][0][0] == 8 * 32  # saving read nothing into the run's own totals
    torch.manual_seed(1)
    _steps(straight, 1, scale=30.0)
    expected, expected_totals = stats.metrics(), copy.deepcopy(stats.total_counts)
    assert expected_totals["0"][0][0] == 4 * 8 * 32
    if recipe == "delayed":  # inputs 30 times larger than the history's: the interval saturates
        assert expected["fp8/0/input/overflow_frac"] > 0
    else:  # an interval's histogram of the row amaxes
        assert "fp8/0/input/block_amax_median" in expected
    for counters in (True, False):
        resumed = _seeded_model(recipe)
        lf.load_fp8_state_dict(resumed, saved_fp8, counters=counters)
        again = FP8Stats(resumed)
        again.load_state_dict(copy.deepcopy(saved_stats))
        torch.manual_seed(1)
        _steps(resumed, 1, scale=30.0)
        assert again.metrics() == expected, counters
        assert again.total_counts == expected_totals, counters


@pytest.mark.parametrize("first, second", [(False, True), (False, False), (True, False), (True, True)])
def test_resumes_in_a_row_keep_the_unread_counts(first, second):
    """A checkpoint, a resume, a second checkpoint before any reading, a second resume, each resume restoring the
    counters (``True``: one rank) or restarting them (``False``): the straight run's metrics and totals. (Restarted
    then restored lost the first checkpoint's unread counts.)"""
    def steps(m, seed):
        torch.manual_seed(seed)
        _steps(m, 1 if seed else 2, scale=30.0)

    straight = _seeded_model()
    stats = FP8Stats(straight)
    _steps(straight, 1)
    lf.roll_amax_history(straight)
    stats.metrics()
    for seed in (0, 1, 2):
        steps(straight, seed)
    expected, expected_totals = stats.metrics(), stats.total_counts

    run = _seeded_model()
    stats = FP8Stats(run)
    _steps(run, 1)
    lf.roll_amax_history(run)
    stats.metrics()
    for seed, counters in ((0, first), (1, second)):
        steps(run, seed)
        saved_stats, saved_fp8 = copy.deepcopy(stats.state_dict()), lf.fp8_state_dict(run)
        run = _seeded_model()
        lf.load_fp8_state_dict(run, saved_fp8, counters=counters)
        stats = FP8Stats(run)
        stats.load_state_dict(saved_stats)
    steps(run, 2)
    assert stats.metrics() == expected
    assert stats.total_counts == expected_totals


def test_include_exclude_and_several_models():
    a, b = _model(), nn.Sequential(nn.Linear(32, 32))
    lf.convert_to_fp8(b, recipe="delayed")
    stats = FP8Stats([a, b])  # two models of the same class: named by their index
    assert stats.read() is not None and stats.layer_names == ["0.0", "0.2", "1.0"]
    assert FP8Stats([a, b], exclude=["0.*"]).read().layers.keys() == {"1.0"}
    assert FP8Stats([a, b], include=["*.2"]).read().layers.keys() == {"0.2"}

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

    head = Head()
    lf.convert_to_fp8(head)
    assert FP8Stats([a, head]).read().layers.keys() == {"Sequential.0", "Sequential.2", "Head.proj"}
    assert FP8Stats(nn.Linear(4, 4)).read() is None and FP8Stats(nn.Linear(4, 4)).metrics() == {}


def test_fabric_loop_reads_the_plugin(tmp_path):
    plugin = FP8Precision(recipe="tensorwise", loss_scaling="dynamic")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    stats = FP8Stats(plugin)
    for _ in range(2):
        optimizer.zero_grad()
        fabric.backward(model(torch.randn(8, 32)).float().square().mean())
        optimizer.step()
    metrics = stats.metrics()
    assert metrics["fp8/loss_scale"] == 2.0**16 and metrics["fp8/skipped_steps"] == 0
    assert math.isfinite(metrics["fp8/0/grad_output/amax"]) and metrics["fp8/0/grad_output/amax"] > 0
    state = stats.state_dict()
    fresh = FP8Stats(plugin)
    fresh.load_state_dict(state)
    assert fresh.total_counts == stats.total_counts and fresh.has_baseline


def test_snapshot_is_constant_work_per_table():
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    def ops(n_layers):
        model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(n_layers)))
        lf.convert_to_fp8(model)
        with Ops() as counter:
            FP8Stats(model).snapshot()
        return counter.n

    assert ops(4) == ops(64)


def test_counters_loaded_back_in_time_give_a_new_baseline_not_negative_fractions():
    """Loading an older FP8 state into a running job sets the counters back: the next interval must not be negative,
    and the totals must not shrink."""
    model = _model()
    stats = FP8Stats(model)
    _steps(model, 1)
    old = lf.fp8_state_dict(model)
    _steps(model, 3, scale=100.0)
    stats.metrics()
    totals = [list(role) for role in stats.total_counts["0"]]
    lf.load_fp8_state_dict(model, old)
    metrics = stats.metrics()
    assert "fp8/0/input/overflow_frac" not in metrics  # no interval to report: the counters went back
    assert stats.total_counts["0"] == totals
    _steps(model, 1)
    assert 0 <= stats.metrics()["fp8/0/input/overflow_frac"] <= 1


def test_plugin_restores_counters_only_from_a_single_rank_checkpoint():
    """A checkpoint written by 2 ranks holds one rank's counters: resumed on 1 device they restart from zero (with a
    new counts_epoch), so the statistics re-baseline instead of dropping the other rank's counts."""
    def fitted():
        plugin = FP8Precision(recipe="delayed")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = fabric.setup(nn.Sequential(nn.Linear(32, 32)))
        with plugin.forward_context():
            model(torch.randn(4, 32))
        return plugin, model

    plugin, model = fitted()
    state = plugin.state_dict()
    assert state["world_size"] == 1
    counts = model.module[0].fp8_counts.clone()
    for world, restored in ((1, True), (2, False)):
        fresh, fresh_model = fitted()
        epoch_before = int(fresh_model.module[0].fp8_state.table.counts_epoch[0])
        fresh.load_state_dict({**state, "world_size": world})
        layer = fresh_model.module[0]
        epoch = int(layer.fp8_state.table.counts_epoch[0])
        if restored:
            assert torch.equal(layer.fp8_counts, counts) and epoch == 0
        else:
            assert int(layer.fp8_counts.sum()) == 0 and epoch == max(0, epoch_before) + 1


def test_counters_set_back_and_grown_past_the_baseline_are_not_an_interval():
    """An older state loaded in place whose counters grew past the old baseline by the next reading: the interval is
    not measurable; fractions above 1 must not be reported."""
    model = _model()
    stats = FP8Stats(model)
    _steps(model, 1)
    old = lf.fp8_state_dict(model)
    _steps(model, 4)
    stats.metrics()
    lf.load_fp8_state_dict(model, old)
    _steps(model, 7, scale=100.0)  # saturating steps: the counters grow past the reading's baseline
    metrics = stats.metrics()
    assert all(v <= 1 for k, v in metrics.items() if k.endswith("_frac"))


def test_names_do_not_change_when_a_model_is_set_up_later():
    a = _model()
    stats = FP8Stats([a])
    _steps(a, 1)
    stats.metrics()
    b = nn.Sequential(nn.Linear(32, 32))
    lf.convert_to_fp8(b)
    stats.source = [a, b]
    _steps(a, 1)
    names = list(stats.read().layers)
    assert names == ["0", "2", "1.0"]  # two Sequentials: the later one is named by its index
    stats.metrics()
    assert set(stats.total_counts) == {"0", "2", "1.0"}
    assert stats.total_counts["0"][0][0] == 2 * 8 * 32  # one series, not restarted under a new name
    layer = lf.FP8Linear(16, 16)  # a bare layer as the source: its class name, not an empty one
    assert list(FP8Stats(layer).read().layers) == ["FP8Linear"]


def test_a_pattern_that_matches_no_fp8_layer_fails_at_the_first_reading():
    """In a Fabric loop there is no callback to check the patterns at the start: the first reading does."""
    import pytest

    plugin = FP8Precision(recipe="tensorwise")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    fabric.backward(model(torch.randn(8, 32)).float().sum())
    with pytest.raises(ValueError, match=r"FP8Stats\(include=\['3'\].*include pattern '3' matches no FP8 layer") as err:
        FP8Stats(plugin, include=["3"]).metrics()
    assert "'0'" in str(err.value) or "'2'" in str(err.value)  # the layers there are
    with pytest.raises(ValueError, match="exclude pattern 'O' matches no FP8 layer"):
        FP8Stats(plugin, exclude=["O"]).read()
    assert FP8Stats(plugin, include=["2"]).metrics()  # a pattern that matches is fine
