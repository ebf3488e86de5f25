"""Device-side FP8 state: the state table and its per-layer views, export/import, amax history, delayed scaling."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import lightning_fp8 as lf
from lightning_fp8.recipe import RECIPES
from lightning_fp8 import FP8Linear, FP8Recipe
from lightning_fp8 import quantize as cast_module
from lightning_fp8.recipe import GRAD_OUTPUT, INPUT, WEIGHT
from lightning_fp8.state import COUNT_FIELDS, fp8_state_layer_names, layer_state

#: The per-layer views of a layer's row in its state table (the buffer names of lightning-fp8 0.1).
STATE_BUFFERS = ("fp8_scale", "fp8_amax_history", "fp8_amax_pending", "fp8_counts", "fp8_initialized")
#: The same, as fields of an fp8_state_dict export.
FIELDS = {"fp8_scale": "scale", "fp8_amax_history": "amax_history", "fp8_amax_pending": "amax_pending",
          "fp8_counts": "counts", "fp8_initialized": "initialized"}  # fmt: skip

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _scale(fp8_max: float, amax: torch.Tensor | float, margin: int = 0) -> float:
    """fp8_max / amax / 2**margin in float64, rounded toward zero to float32 (the documented formula)."""
    value = fp8_max / float(amax.detach() if isinstance(amax, torch.Tensor) else amax) / 2.0**margin
    t = torch.tensor(value, dtype=torch.float64).to(torch.float32)
    if t.item() > value:
        t = torch.nextafter(t, torch.tensor(0.0))
    return t.item()


def _step(model, x, grad, **autocast_kwargs):
    x = x.detach().clone().requires_grad_()
    with lf.fp8_autocast(**autocast_kwargs):
        y = model(x)
    y.backward(grad)
    return y.detach()


@pytest.fixture
def used_scales(monkeypatch):
    """The scales actually used by every cast, in call order (input, weight, then grad_output)."""
    seen: list[torch.Tensor] = []
    original = cast_module.cast_with_statistics

    def spy(x, scale, fp8_dtype, *args):
        seen.append(scale.detach().clone())
        return original(x, scale, fp8_dtype, *args)

    monkeypatch.setattr(cast_module, "cast_with_statistics", spy)
    return seen


def _model(recipe="tensorwise"):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    lf.convert_to_fp8(model, recipe=recipe)
    return model


# --- the state table and its views ----------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_state_is_not_in_state_dict_nor_buffers(recipe):
    plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    model = copy.deepcopy(plain)
    lf.convert_to_fp8(model, recipe=FP8Recipe(name=recipe, amax_history_len=5))
    layer = model[0]
    shapes = {name: tuple(getattr(layer, name).shape) for name in STATE_BUFFERS}
    assert shapes == {
        "fp8_scale": (3,),
        "fp8_amax_history": (3, 5),
        "fp8_amax_pending": (3,),
        "fp8_counts": (3, len(COUNT_FIELDS)),
        "fp8_initialized": (3,),
    }
    assert [str(getattr(layer, n).dtype) for n in STATE_BUFFERS] == [
        "torch.float32",
        "torch.float32",
        "torch.float32",
        "torch.int64",
        "torch.bool",
    ]
    assert list(model.state_dict()) == list(plain.state_dict())
    assert list(model.buffers()) == []  # nothing for DDP to broadcast
    # one table for the whole model, each layer a row of it
    assert model[0].fp8_state.table is model[2].fp8_state.table
    assert [model[0].fp8_state.index, model[2].fp8_state.index] == [0, 1]
    # checkpoints move both ways between plain and converted models
    plain.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(plain.state_dict(), strict=True)


def test_state_keeps_dtype_and_follows_device():
    layer = FP8Linear(32, 16, recipe="delayed")
    for convert in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(), lambda m: m.float()):
        convert(layer)
        assert [getattr(layer, n).dtype for n in STATE_BUFFERS] == [
            torch.float32,
            torch.float32,
            torch.float32,
            torch.int64,
            torch.bool,
        ]
    layer.to(torch.bfloat16)
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    _step(layer, x, torch.randn(8, 16, dtype=torch.bfloat16))
    # the scale is the recipe's float32 scale, not a bf16-rounded one
    assert layer.fp8_scale[INPUT].item() == _scale(E4M3_MAX, x.float().abs().max())
    meta = copy.deepcopy(layer).to(device="meta", dtype=torch.float16)
    assert all(getattr(meta, n).device.type == "meta" for n in STATE_BUFFERS)
    assert meta.weight.dtype == torch.float16 and meta.fp8_scale.dtype == torch.float32


# --- export / import -------------------------------------------------------------------------------------


def _plain_values_only(obj) -> bool:
    if isinstance(obj, torch.Tensor) or obj is None or isinstance(obj, (bool, int, float, str)):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_plain_values_only(v) for v in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _plain_values_only(v) for k, v in obj.items())
    return False


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_state_dict_round_trip(recipe):
    model = _model(recipe)
    for i in range(3):
        x = torch.randn(8, 32) * (i + 1)
        x[0, 0] = 1e9  # some overflow for the counters
        _step(model, x, torch.randn(8, 16))
    state = lf.fp8_state_dict(model)
    assert _plain_values_only(state)
    assert fp8_state_layer_names(state) == ["0", "2"]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    fresh = _model(recipe)
    fresh.load_state_dict(model.state_dict())
    lf.load_fp8_state_dict(fresh, loaded)
    for name in ("0", "2"):
        for b in STATE_BUFFERS:
            got, want = getattr(fresh[int(name)], b), getattr(model[int(name)], b)
            assert got.dtype == want.dtype and torch.equal(got, want), (name, b)
    assert model[0].fp8_counts.sum() > 0 and (model[0].fp8_amax_history != 0).any()
    # the export is a snapshot, not a view of the live buffers
    _step(model, torch.randn(8, 32), torch.randn(8, 16))
    assert not torch.equal(layer_state(state, "0")["counts"], model[0].fp8_counts)
    # after loading, both models continue identically
    x, g = torch.randn(8, 32), torch.randn(8, 16)
    lf.load_fp8_state_dict(model, loaded)
    assert torch.equal(_step(model, x, g), _step(fresh, x, g))


def test_a_layer_replaced_by_its_compiled_wrapper_is_one_layer():
    """An FP8 layer compiled on its own and put back in its model (``model[0] = torch.compile(model[0])``): the
    wrapper forwards attribute reads to the layer, so it was taken for a second FP8 layer: the state listed the layer
    twice ("0" and "0._orig_mod": metrics logged twice, and after a re-bind, such as FSDP2's, a row of its own that
    the layer never updates). Now the layer is listed once, under the name its parameters have."""
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    plugin = lf.fabric.FP8Precision(recipe="delayed")
    plugin.convert_module(model)
    model[0] = torch.compile(model[0], backend="eager")
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        with plugin.forward_context():
            out = model(torch.randn(8, 32))
        out.square().mean().backward()
        plugin.optimizer_step(optimizer)
        optimizer.zero_grad()
    (table,) = lf.fp8_state_dict(model)["tables"]
    assert table["layers"] == ["0._orig_mod", "2"]
    assert "0._orig_mod.weight" in model.state_dict()
    assert table["amax_history"].shape[0] == 2 and bool((table["amax_history"][:, :, :2] > 0).all())
    assert [name for name, _ in lf.state.fp8_layers(model)] == ["0._orig_mod", "2"]


def test_fp8_state_moves_between_a_compiled_and_an_eager_model():
    """A run resumed with ``torch.compile`` switched on or off: the compiled model's layer names carry ``_orig_mod``
    (a block compiled on its own, or the whole model). The FP8 state loads across, matched by the names without it,
    as torch's distributed checkpoint helpers match the weights (before: strict loading failed with "missing",
    "unexpected" and advice about ``exclude`` patterns)."""

    def model():
        torch.manual_seed(0)
        fp8 = nn.Sequential(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)), nn.Linear(16, 16))
        lf.convert_to_fp8(fp8, recipe="delayed", log_summary=False)
        return fp8

    eager = model()
    with lf.fp8_autocast():
        eager(torch.randn(4, 16)).sum().backward()
    saved = lf.fp8_state_dict(eager)
    assert saved["tables"][0]["layers"] == ["0.0", "0.1", "1"]
    block = model()
    block[0] = torch.compile(block[0])
    whole = torch.compile(model())
    for compiled, names in ((block, ["0._orig_mod.0", "0._orig_mod.1", "1"]), (whole, ["_orig_mod.0.0", "_orig_mod.0.1", "_orig_mod.1"])):
        lf.load_fp8_state_dict(compiled, saved)
        state = lf.fp8_state_dict(compiled)
        assert state["tables"][0]["layers"] == names
        assert torch.equal(state["tables"][0]["amax_history"], saved["tables"][0]["amax_history"])
        back = model()
        lf.load_fp8_state_dict(back, state)
        assert torch.equal(lf.fp8_state_dict(back)["tables"][0]["scale"], saved["tables"][0]["scale"])
    with pytest.raises(ValueError, match=r"missing \['1'\]"):  # names still have to match, without _orig_mod
        lf.load_fp8_state_dict(model(), {
            **saved, "tables": [{**saved["tables"][0], "layers": ["0.0", "0.1", "2"]}]})


def test_load_fp8_state_dict_recipe_mismatch():
    state = lf.fp8_state_dict(_model("delayed"))
    for other in ("tensorwise", FP8Recipe(name="delayed", margin=1), FP8Recipe(name="delayed", amax_history_len=4)):
        model = _model(other)
        before = copy.deepcopy(model)
        with pytest.raises(ValueError, match="recipe"):
            lf.load_fp8_state_dict(model, state)
        for b in STATE_BUFFERS:
            assert torch.equal(getattr(model[0], b), getattr(before[0], b))


def test_load_fp8_state_dict_strict():
    source = _model()
    state = lf.fp8_state_dict(source)
    missing = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16), nn.Linear(16, 32))
    lf.convert_to_fp8(missing)
    with pytest.raises(ValueError, match=r"missing \['3'\]"):
        lf.load_fp8_state_dict(missing, state)
    lf.load_fp8_state_dict(missing, state, strict=False)

    unexpected = _model()
    lf.convert_from_fp8(unexpected[2])
    with pytest.raises(ValueError, match=r"unexpected \['2'\]"):
        lf.load_fp8_state_dict(unexpected, state)
    _step(source, torch.randn(4, 32), torch.randn(4, 16))
    lf.load_fp8_state_dict(unexpected, lf.fp8_state_dict(source), strict=False)
    assert torch.equal(unexpected[0].fp8_counts, source[0].fp8_counts)


def test_load_fp8_state_dict_unknown_version():
    model = _model()
    state = lf.fp8_state_dict(model)
    with pytest.raises(ValueError, match="version"):
        lf.load_fp8_state_dict(model, {**state, "version": 99})
    with pytest.raises(ValueError):
        lf.load_fp8_state_dict(model, [])  # type: ignore[arg-type]


# --- amax history ----------------------------------------------------------------------------------------


def test_standalone_region_rolls_once_on_exit():
    """Outside the plugin, the outermost fp8_autocast() rolls the histories of the layers that ran inside it when it
    exits, once. The backward usually runs after the exit: its grad_output amax rolls at the next exit."""
    layer = FP8Linear(32, 16, recipe=FP8Recipe(amax_history_len=3))
    forward, grads = [], []
    for i in range(4):
        x, g = torch.randn(8, 32) * (i + 1), torch.randn(8, 16) / (i + 1)
        _step(layer, x, g)
        forward.insert(0, [x.abs().max().item(), layer.weight.abs().max().item()])
        grads.insert(0, g.abs().max().item())
        expected_fwd = torch.tensor(forward[:3] + [[0.0] * 2] * (3 - len(forward[:3]))).t()
        expected_grad = torch.tensor((grads[1:4] + [0.0] * 3)[:3])
        assert torch.equal(layer.fp8_amax_history[:2], expected_fwd), i
        assert torch.equal(layer.fp8_amax_history[GRAD_OUTPUT], expected_grad), i
        assert torch.equal(layer.fp8_amax_pending, torch.tensor([0.0, 0.0, grads[0]]))
    counts = layer.fp8_counts
    assert counts[:, 0].tolist() == [4 * 8 * 32, 4 * 32 * 16, 4 * 8 * 16]
    assert counts[:, 1].tolist() == counts[:, 0].tolist()  # random data has no zeros


def test_nested_regions_roll_once_at_the_outermost_exit():
    layer = FP8Linear(32, 16)
    with lf.fp8_autocast():
        with lf.fp8_autocast():
            layer(torch.randn(4, 32))
        assert (layer.fp8_amax_history == 0).all()  # the inner exit does not roll
        with lf.fp8_autocast(enabled=False):
            layer(torch.randn(4, 32))
    assert (layer.fp8_amax_history[:2, 0] > 0).all() and (layer.fp8_amax_history[:, 1] == 0).all()
    with lf.fp8_autocast(defer_amax_history_roll=True):
        layer(torch.randn(4, 32))
    assert (layer.fp8_amax_history[:, 1] == 0).all() and (layer.fp8_amax_pending[:2] > 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_deferred_roll_keeps_max_pending(recipe):
    model = _model(recipe)
    xs = [torch.randn(8, 32) * s for s in (1.0, 4.0, 2.0)]
    gs = [torch.randn(8, 16) * s for s in (3.0, 1.0, 2.0)]
    for x, g in zip(xs, gs):
        _step(model, x, g, defer_amax_history_roll=True)
    layer = model[0]
    assert torch.equal(layer.fp8_amax_history, torch.zeros_like(layer.fp8_amax_history))
    assert layer.fp8_amax_pending[INPUT] == max(x.abs().max() for x in xs)
    assert layer.fp8_amax_pending[WEIGHT] == layer.weight.abs().max()
    assert (model[2].fp8_amax_pending[GRAD_OUTPUT] == max(g.abs().max() for g in gs)).item()
    pending = layer.fp8_amax_pending.clone()
    lf.roll_amax_history(model)
    assert torch.equal(layer.fp8_amax_history[:, 0], pending)
    assert torch.equal(layer.fp8_amax_history[:, 1:], torch.zeros_like(layer.fp8_amax_history[:, 1:]))
    assert torch.equal(layer.fp8_amax_pending, torch.zeros(3))
    assert layer.fp8_counts[INPUT, 0] == 3 * 8 * 32


def test_deferred_delayed_window_shares_one_scale(used_scales):
    layer = FP8Linear(32, 16, recipe="delayed")
    window1 = [torch.randn(8, 32) * s for s in (1.0, 3.0)]
    for x in window1:
        _step(layer, x, torch.randn(8, 16), defer_amax_history_roll=True)
    # empty history: each micro-batch uses its own current amax
    assert [used_scales[i].item() for i in (0, 3)] == [_scale(E4M3_MAX, x.abs().max()) for x in window1]
    assert not layer.fp8_initialized.any()
    lf.roll_amax_history(layer)
    assert layer.fp8_initialized.all()
    used_scales.clear()
    for s in (0.5, 0.25):
        _step(layer, torch.randn(8, 32) * s, torch.randn(8, 16), defer_amax_history_roll=True)
    expected = _scale(E4M3_MAX, max(x.abs().max() for x in window1))
    assert used_scales[0].item() == used_scales[3].item() == expected


# --- delayed scaling -------------------------------------------------------------------------------------


def test_delayed_first_step_uses_current_amax(used_scales):
    x, g = torch.randn(8, 32) * 7, torch.randn(8, 16) * 1e-3
    delayed = FP8Linear(32, 16, recipe="delayed")
    tensorwise = copy.deepcopy(delayed)
    tensorwise.fp8_recipe = FP8Recipe()
    y = _step(delayed, x, g)
    input_scale, weight_scale, grad_scale = (s.item() for s in used_scales[:3])
    assert input_scale == _scale(E4M3_MAX, x.abs().max()) != 1.0
    assert weight_scale == _scale(E4M3_MAX, delayed.weight.abs().max())
    assert grad_scale == _scale(E5M2_MAX, g.abs().max())
    assert torch.equal(y, _step(tensorwise, x, g))


@pytest.mark.parametrize(
    ("algo", "length", "expected_amax_index"),
    [
        # amaxes of steps 0..3: a, 0.3a, 0.2a, 0.1a; the scale of step i comes from steps < i
        ("max", 16, [0, 0, 0, 0]),
        ("most_recent", 16, [0, 0, 1, 2]),
        ("max", 2, [0, 0, 0, 1]),
        ("max", 1, [0, 0, 1, 2]),
    ],
)
def test_delayed_uses_history(used_scales, algo, length, expected_amax_index):
    layer = FP8Linear(32, 16, recipe=FP8Recipe(name="delayed", amax_compute_algo=algo, amax_history_len=length))
    base = torch.randn(8, 32)
    factors = [1.0, 0.3, 0.2, 0.1]
    amaxes = [(base * f).abs().max() for f in factors]
    for f in factors:
        _step(layer, base * f, torch.randn(8, 16))
    used_input = [used_scales[3 * i].item() for i in range(4)]
    assert used_input == [_scale(E4M3_MAX, amaxes[j]) for j in expected_amax_index]
    # the stored scale is the one the next step will use
    next_index = {"max": 0, "most_recent": 3}[algo] if length >= 4 else (2 if length == 2 else 3)
    assert layer.fp8_scale[INPUT].item() == _scale(E4M3_MAX, amaxes[next_index])


@pytest.mark.parametrize("margin", [1, 3])
def test_delayed_margin(used_scales, margin):
    layer = FP8Linear(32, 16, recipe=FP8Recipe(name="delayed", margin=margin))
    x, g = torch.randn(8, 32), torch.randn(8, 16)
    _step(layer, x, g)
    _step(layer, x * 0.5, g)
    for step in range(2):
        assert used_scales[3 * step].item() == _scale(E4M3_MAX, x.abs().max(), margin)
        assert used_scales[3 * step + 2].item() == _scale(E5M2_MAX, g.abs().max(), margin)
    assert layer.fp8_scale[WEIGHT].item() == _scale(E4M3_MAX, layer.weight.abs().max(), margin)


def test_tensorwise_ignores_history_and_refuses_margin(used_scales):
    with pytest.raises(ValueError, match="margin"):
        FP8Recipe(name="tensorwise", margin=2)
    layer = FP8Linear(32, 16, recipe=FP8Recipe(name="tensorwise"))
    x, g = torch.randn(8, 32), torch.randn(8, 16)
    _step(layer, x, g)
    _step(layer, x * 0.3, g)
    assert used_scales[3].item() == _scale(E4M3_MAX, (x * 0.3).abs().max())


@pytest.mark.parametrize(("algo", "length"), [("most_recent", 16), ("max", 1)])
def test_delayed_zero_amax_keeps_previous_scale(used_scales, algo, length):
    layer = FP8Linear(32, 16, recipe=FP8Recipe(name="delayed", amax_compute_algo=algo, amax_history_len=length))
    x, g = torch.randn(8, 32), torch.randn(8, 16)
    _step(layer, x, g)
    previous = layer.fp8_scale.clone()
    y = _step(layer, torch.zeros(8, 32), torch.zeros(8, 16))
    assert torch.equal(y, layer.bias.detach().expand(8, 16))
    assert torch.equal(layer.fp8_scale, previous)
    used_scales.clear()
    _step(layer, x * 0.5, g)
    assert used_scales[0].item() == previous[INPUT].item() == _scale(E4M3_MAX, x.abs().max())
    assert used_scales[2].item() == previous[GRAD_OUTPUT].item()
    assert torch.isfinite(layer.fp8_scale).all()


def test_delayed_all_zero_first_step_does_not_initialize():
    layer = FP8Linear(32, 16, recipe="delayed")
    _step(layer, torch.zeros(4, 32), torch.zeros(4, 16))
    assert layer.fp8_initialized.tolist() == [False, True, False]  # the weight is not zero
    x = torch.randn(4, 32)
    _step(layer, x, torch.randn(4, 16))
    lf.roll_amax_history(layer)  # the backward's grad_output amax rolls at the next exit (or here)
    assert layer.fp8_initialized.all()
    assert layer.fp8_scale[INPUT].item() == _scale(E4M3_MAX, x.abs().max())


def test_counts_accumulate_overflow_and_underflow():
    layer = FP8Linear(32, 16, recipe="delayed")
    x = torch.randn(8, 32)
    _step(layer, x, torch.randn(8, 16))
    x2 = x.clone()
    x2[0, :4] = x.abs().max() * 100  # beyond the history's range: saturates
    x2[1, :3] = x.abs().max() * 1e-6  # flushed to zero
    x2[2, :2] = 0.0
    before = layer.fp8_counts.clone()
    _step(layer, x2, torch.randn(8, 16))
    delta = (layer.fp8_counts - before)[INPUT].tolist()
    assert delta == [256, 254, 4, 3]  # seen, nonzero, overflow, underflow


def test_modules_of_version_0_1_are_deprecated_aliases():
    import importlib
    import sys

    for name, attr, target in (
        ("lightning_fp8.scaling", "fp8_state_dict", lf.fp8_state_dict),
        ("lightning_fp8.cast", "saturated_cast", cast_module.saturated_cast),
    ):
        sys.modules.pop(name, None)
        with pytest.warns(DeprecationWarning, match=name.replace(".", r"\.")):
            module = importlib.import_module(name)
        assert getattr(module, attr) is target


def test_a_layer_kept_in_high_precision_stays_so_when_resumed_with_compile_toggled():
    """A layer switched to high precision by name in a run compiled block by block (its name carries ``_orig_mod``),
    resumed uncompiled: the plugin switches the same layer and its FP8 state loads (before: the saved name matched no
    layer, the layer stayed in FP8 and loading failed with "missing ['0']")."""

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))

    compiled, plugin = model(), lf.fabric.FP8Precision(recipe="delayed")
    plugin.convert_module(compiled)
    compiled[0] = torch.compile(compiled[0], backend="eager")
    with plugin.forward_context():
        compiled(torch.randn(4, 16)).sum().backward()
    plugin.keep_in_high_precision("0._orig_mod", "sensitive")
    assert type(compiled[0]._orig_mod) is nn.Linear
    state = plugin.state_dict()
    plain, plugin2 = model(), lf.fabric.FP8Precision(recipe="delayed")
    plugin2.convert_module(plain)
    plugin2.load_state_dict(state)
    assert type(plain[0]) is nn.Linear and isinstance(plain[1], FP8Linear)
    assert plugin2.high_precision_layers == {"0": "sensitive"}
    assert torch.equal(lf.fp8_state_dict(plain)["tables"][0]["amax_history"], state["models"][0]["tables"][0]["amax_history"])
    again, plugin3 = model(), lf.fabric.FP8Precision(recipe="delayed")  # and back into a compiled block
    plugin3.convert_module(again)
    again[0] = torch.compile(again[0], backend="eager")
    plugin3.load_state_dict(plugin2.state_dict())
    assert type(again[0]._orig_mod) is nn.Linear and plugin3.high_precision_layers == {"0._orig_mod": "sensitive"}
