"""convert_to_fp8 / convert_from_fp8: in-place swapping, skip rules, the report and its log line."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import lightning_fp8 as lf
from lightning_fp8 import ConversionReport, FP8Linear, FP8Recipe

#: The per-layer views of the FP8 state (none may survive convert_from_fp8).
STATE_BUFFERS = ("fp8_scale", "fp8_amax_history", "fp8_amax_pending", "fp8_counts", "fp8_initialized")


class MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.odd = nn.Linear(32, 10)
        self.custom = MyLinear(32, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        h = self.enc(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.custom(h)), self.odd(h)


def _run(model, x):
    with lf.fp8_autocast():
        return model(x)


def test_report_contents():
    net = Net()
    report = lf.convert_to_fp8(net, recipe="delayed", exclude=["head"])
    assert isinstance(report, ConversionReport)
    assert report.converted == ["enc.0", "enc.2"]
    assert report.already_fp8 == []
    assert report.fp8_layers == ["enc.0", "enc.2"]
    assert set(report.skipped) == {"attn.out_proj", "odd", "custom", "head"}
    assert "MultiheadAttention" in report.skipped["attn.out_proj"]
    assert "10" in report.skipped["odd"] and "16" in report.skipped["odd"]
    assert "skip_unaligned=False" in report.skipped["odd"]
    assert "MyLinear" in report.skipped["custom"] and "subclass" in report.skipped["custom"]
    assert "'head'" in report.skipped["head"] and "exclude" in report.skipped["head"]
    assert report.recipe == FP8Recipe(name="delayed")
    assert report.gemm_path == "emulated" and report.device == "cpu"
    assert type(net.enc[0]) is FP8Linear and type(net.enc[2]) is FP8Linear
    assert type(net.odd) is nn.Linear and type(net.head) is nn.Linear and type(net.custom) is MyLinear
    assert not isinstance(net.attn.out_proj, FP8Linear)
    assert net.enc[0].fp8_recipe == FP8Recipe(name="delayed")
    out, odd = _run(net, torch.randn(2, 5, 32))
    assert out.shape == (2, 5, 16) and odd.shape == (2, 5, 10)
    assert net.enc[0].fp8_counts[0, 0] == 2 * 5 * 32

    summary = report.summary()
    assert "recipe=delayed" in summary and "2 Linear layer(s) in FP8" in summary and "4 skipped" in summary
    assert "emulated" in summary
    assert str(report) == summary


def test_second_call_is_idempotent():
    net = Net()
    first = lf.convert_to_fp8(net, exclude=["head"])
    layer = net.enc[0]
    _run(net, torch.randn(2, 3, 32))
    counts = layer.fp8_counts.clone()
    second = lf.convert_to_fp8(net, exclude=["head"])
    assert second.converted == []
    assert second.already_fp8 == first.converted == ["enc.0", "enc.2"]
    assert second.fp8_layers == first.fp8_layers
    assert second.skipped == first.skipped
    assert net.enc[0] is layer and torch.equal(layer.fp8_counts, counts)  # state untouched


def test_converting_with_another_recipe_raises_and_changes_nothing():
    net = Net()
    lf.convert_to_fp8(net, recipe="tensorwise")
    net.extra = nn.Linear(32, 32)  # a plain layer that a second call would convert
    with pytest.raises(ValueError, match="enc.0") as err:
        lf.convert_to_fp8(net, recipe="rowwise")
    assert "convert_from_fp8" in str(err.value)
    assert type(net.extra) is nn.Linear
    assert all(m.fp8_recipe.name == "tensorwise" for m in net.modules() if isinstance(m, FP8Linear))
    with pytest.raises(ValueError):
        lf.convert_to_fp8(net, recipe=FP8Recipe(name="tensorwise", amax_history_len=4))
    # a plain layer *before* the mismatching FP8 layer is not converted either (no half-converted model)
    seq = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    lf.convert_to_fp8(seq[1], recipe="delayed")
    with pytest.raises(ValueError, match="'1'"):
        lf.convert_to_fp8(seq, recipe="tensorwise")
    assert type(seq[0]) is nn.Linear


@pytest.mark.parametrize(
    ("patterns", "converted"),
    [
        (["enc.*"], ["head"]),
        (["*.2"], ["enc.0", "head"]),
        ("head", ["enc.0", "enc.2"]),  # a single string is one pattern, not a list of characters
        (["enc.0", "h*"], ["enc.2"]),
        ([], ["enc.0", "enc.2", "head"]),
    ],
)
def test_exclude_globs(patterns, converted):
    net = Net()
    report = lf.convert_to_fp8(net, exclude=patterns)
    assert report.converted == converted
    for name in {"enc.0", "enc.2", "head"} - set(converted):
        assert "excluded by pattern" in report.skipped[name]


def test_skip_unaligned_false_converts_with_padding():
    net = Net()
    ref = copy.deepcopy(net)
    report = lf.convert_to_fp8(net, skip_unaligned=False)
    assert "odd" in report.converted and "odd" not in report.skipped
    assert type(net.odd) is FP8Linear
    x = torch.randn(2, 7, 32)
    out, odd = _run(net, x)
    out_ref, odd_ref = ref(x)
    assert odd.shape == (2, 7, 10)
    err = (odd - odd_ref).pow(2).sum() / odd_ref.pow(2).sum()
    assert err < 0.01 and not torch.equal(odd, odd_ref)


def test_mha_still_works_and_is_untouched():
    net = Net()
    ref = copy.deepcopy(net)
    lf.convert_to_fp8(net, exclude=["enc.*", "head"])
    x = torch.randn(2, 5, 32)
    with lf.fp8_autocast():
        a = net.attn(x, x, x, need_weights=False)[0]
    b = ref.attn(x, x, x, need_weights=False)[0]
    assert torch.equal(a, b)


def test_root_linear_is_converted():
    lin = nn.Linear(32, 16)
    weight = lin.weight
    report = lf.convert_to_fp8(lin, recipe="rowwise")
    assert report.converted == [""]
    assert isinstance(lin, FP8Linear) and lin.weight is weight
    assert lin.fp8_recipe.name == "rowwise"
    assert _run(lin, torch.randn(4, 32)).shape == (4, 16)
    odd = nn.Linear(3, 5)
    report = lf.convert_to_fp8(odd)
    assert report.converted == [] and "" in report.skipped
    assert "<root>" in report.summary()


def test_shared_layer_converted_once():
    shared = nn.Linear(32, 32)
    net = nn.Sequential(shared, nn.ReLU(), shared)
    report = lf.convert_to_fp8(net)
    assert report.converted == ["0"]
    assert net[0] is net[2] and isinstance(shared, FP8Linear)
    x = torch.randn(4, 32, requires_grad=True)
    with lf.fp8_autocast():
        net(x).sum().backward()
    assert shared.fp8_counts[0, 0] == 2 * 4 * 32  # both uses recorded on one state


def test_parameters_keep_identity_and_optimizer_keeps_working():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = {n: p for n, p in net.named_parameters()}
    keys = list(net.state_dict())
    lf.convert_to_fp8(net)
    assert {n: id(p) for n, p in net.named_parameters()} == {n: id(p) for n, p in before.items()}
    assert list(net.state_dict()) == keys
    w = net.enc[0].weight.detach().clone()
    with lf.fp8_autocast():
        out, odd = net(torch.randn(2, 3, 32))
    (out.sum() + odd.sum()).backward()
    opt.step()
    assert not torch.equal(net.enc[0].weight, w)


def test_convert_from_fp8_restores_plain_linear():
    net = Net()
    ref = copy.deepcopy(net)
    params = {n: p for n, p in net.named_parameters()}
    lf.convert_to_fp8(net, recipe="delayed")
    _run(net, torch.randn(2, 3, 32))
    names = lf.convert_from_fp8(net)
    assert sorted(names) == ["enc.0", "enc.2", "head"]
    for name in names:
        layer = net.get_submodule(name)
        assert type(layer) is nn.Linear
        assert not hasattr(layer, "fp8_recipe")
        assert all(not hasattr(layer, b) for b in STATE_BUFFERS)
        assert dict(layer.named_buffers()) == {}
        assert not [k for k in vars(layer) if "fp8" in k]  # no attribute of the FP8 layer left behind
        assert vars(layer).keys() == vars(nn.Linear(1, 1)).keys()
    assert {n: id(p) for n, p in net.named_parameters()} == {n: id(p) for n, p in params.items()}
    assert list(net.state_dict()) == list(ref.state_dict())
    assert not any(n.split(".")[-1].startswith("fp8") for n, _ in net.named_buffers())
    x = torch.randn(2, 3, 32)
    with lf.fp8_autocast():  # plain layers now, even inside the region
        got = net(x)
    want = ref(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert lf.convert_from_fp8(net) == []
    # and it can be converted again, with another recipe
    assert lf.convert_to_fp8(net, recipe="rowwise").converted == ["enc.0", "enc.2", "head"]


def test_conversion_logs_summary(caplog):
    net = Net()
    with caplog.at_level(logging.INFO, logger="lightning_fp8"):
        report = lf.convert_to_fp8(net, exclude=["head"])
    records = [r for r in caplog.records if r.name.startswith("lightning_fp8")]
    assert [r.getMessage() for r in records] == [report.summary()]
    msg = records[0].getMessage()
    assert "recipe=tensorwise" in msg and "emulated" in msg
    for name in ("attn.out_proj", "odd", "custom", "head"):
        assert name in msg


# --- the registry ----------------------------------------------------------------------------------------


class Scaled(nn.Linear):
    """A high-precision layer type of 'another library': a Linear whose output is doubled."""

    def forward(self, x):
        return 2 * super().forward(x)


class FP8Scaled(FP8Linear, Scaled):
    def forward(self, x):
        return 2 * FP8Linear.forward(self, x)


def _to_fp8_scaled(module, recipe):
    module.__class__ = FP8Scaled
    module.init_fp8_state(recipe, module.weight.device)
    return module


def test_registering_a_layer_type_converts_it(monkeypatch):
    from lightning_fp8 import convert

    monkeypatch.setattr(convert, "_REGISTRY", dict(convert._REGISTRY))  # leave the global registry as it was
    net = nn.Sequential(nn.Linear(32, 32), Scaled(32, 32))
    before = lf.convert_to_fp8(copy.deepcopy(net))
    assert "1" in before.skipped and "subclass of nn.Linear" in before.skipped["1"]

    convert.register_fp8_module(convert.FP8ModuleRule(Scaled, FP8Scaled, _to_fp8_scaled))
    reference = copy.deepcopy(net)
    report = lf.convert_to_fp8(net, recipe="delayed")
    assert report.converted == ["0", "1"] and type(net[1]) is FP8Scaled
    assert net[0].fp8_state.table is net[1].fp8_state.table  # one table for every registered type
    x = torch.randn(4, 32)
    with lf.fp8_autocast():
        y = net(x)
    torch.testing.assert_close(y, reference(x), rtol=0.15, atol=0.15)
    assert int(net[1].fp8_counts[0, 0]) == 4 * 32
    assert lf.convert_from_fp8(net) == ["0", "1"] and type(net[1]) is Scaled and type(net[0]) is nn.Linear

    with pytest.raises(ValueError, match="registered already"):
        convert.register_fp8_module(convert.FP8ModuleRule(Scaled, FP8Scaled, _to_fp8_scaled))
    with pytest.raises(ValueError, match="must subclass both FP8Module and Conv1d"):
        convert.register_fp8_module(convert.FP8ModuleRule(nn.Conv1d, FP8Scaled, _to_fp8_scaled))


# --- exclude patterns that match nothing ----------------------------------------------------------------


def test_exclude_typo_raises_with_the_closest_names_and_changes_nothing():
    net = Net()
    with pytest.raises(ValueError, match="'haed' matches no layer") as err:
        lf.convert_to_fp8(net, exclude=["enc.*", "haed"])
    message = str(err.value)
    assert "closest layer names: 'head'" in message and "allow_unmatched_exclude=True" in message
    assert "pattern 'enc.*'" not in message  # only the pattern that matches nothing is named
    assert not any(isinstance(m, FP8Linear) for m in net.modules())  # nothing converted
    report = lf.convert_to_fp8(net, exclude=["enc.*", "haed"], allow_unmatched_exclude=True)
    assert report.converted == ["head"]


def test_exclude_matches_layers_by_their_own_name_only():
    """`enc` names a Sequential, not its Linear layers: a no-op, so an error that points at `enc.*`."""
    with pytest.raises(ValueError, match=r"it matches 'enc', which is not a layer.*use 'enc\.\*'"):
        lf.convert_to_fp8(Net(), exclude=["enc"])
    assert lf.convert_to_fp8(Net(), exclude=["enc.*"]).converted == ["head"]
    # layers skipped for another reason still count as matched (the pattern is not a no-op then)
    assert lf.convert_to_fp8(Net(), exclude=["odd", "custom", "attn.out_proj"]).converted == ["enc.0", "enc.2", "head"]


def test_exclude_without_the_prefix_suggests_a_glob():
    wrapper = nn.Sequential()
    wrapper.model = Net()
    with pytest.raises(ValueError, match=r"the glob '\*head' would match 'model.head'.*closest layer names: 'model"):
        lf.convert_to_fp8(wrapper, exclude=["head"])
    assert "model.head" not in lf.convert_to_fp8(wrapper, exclude=["*head"]).converted


def test_exclude_of_a_layer_that_is_fp8_already_raises():
    net = Net()
    lf.convert_to_fp8(net)
    with pytest.raises(ValueError, match="'head', which is FP8 already.*convert_from_fp8"):
        lf.convert_to_fp8(net, exclude=["head"])
    assert isinstance(net.head, FP8Linear)
