"""FP8Linear: drop-in behaviour, numerics against torchao and float64, and bad inputs."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import pytest
import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import lightning_fp8 as lf
from lightning_fp8 import FP8Linear, FP8Recipe
from lightning_fp8.recipe import INPUT, WEIGHT
from lightning_fp8.state import OVERFLOW, SEEN

RECIPES = list(lf.recipe.RECIPES)


def _step(model, x, grad=None, autocast=False, fp8=True):
    """One forward + backward; returns (output, grad_input, grad_weight, grad_bias)."""
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), lf.fp8_autocast(enabled=fp8):
        y = model(x)
    y.backward(grad.to(y.dtype) if grad is not None else torch.ones_like(y))
    lin = model if isinstance(model, nn.Linear) else model[0]
    return y.detach(), x.grad, lin.weight.grad, None if lin.bias is None else lin.bias.grad


def _buffers(m):
    """Every FP8 state tensor of ``m`` (and any module buffer), as copies keyed by layer and field."""
    state = {k: v.clone() for k, v in m.named_buffers()}
    for table in lf.fp8_state_dict(m)["tables"]:
        for row, layer in enumerate(table["layers"]):
            for field, value in table.items():
                if isinstance(value, torch.Tensor):
                    state[f"{layer}:{field}"] = value[row].clone()
    assert state, "no FP8 state found"
    return state


def _same_buffers(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- drop-in ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_is_a_linear_with_the_same_parameters_and_keys(bias):
    lin = nn.Linear(32, 48, bias=bias)
    params = dict(lin.named_parameters())
    keys = list(lin.state_dict())
    model = nn.Sequential(lin)
    lf.convert_to_fp8(model)
    assert model[0] is lin and isinstance(lin, FP8Linear) and isinstance(lin, nn.Linear)
    assert {k: id(v) for k, v in lin.named_parameters()} == {k: id(v) for k, v in params.items()}
    assert list(lin.state_dict()) == keys
    assert (lin.bias is None) == (not bias)
    direct = FP8Linear(32, 48, bias=bias)
    assert list(direct.state_dict()) == keys
    assert [n for n, _ in direct.named_parameters()] == list(params)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("autocast", [False, True])
def test_outside_fp8_autocast_equals_nn_linear(recipe, autocast):
    ref = nn.Linear(64, 32)
    fp8 = copy.deepcopy(ref)
    lf.convert_to_fp8(fp8, recipe=recipe)
    x, g = torch.randn(3, 5, 64), torch.randn(3, 5, 32)
    before = _buffers(fp8)
    for enabled in (False, None):
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y1 = ref(x1)
            if enabled is None:
                y2 = fp8(x2)  # no fp8_autocast region at all
            else:
                with lf.fp8_autocast(enabled=False):
                    y2 = fp8(x2)
        y1.backward(g.to(y1.dtype))
        y2.backward(g.to(y2.dtype))
        assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
        assert torch.equal(ref.weight.grad, fp8.weight.grad) and torch.equal(ref.bias.grad, fp8.bias.grad)
        ref.zero_grad(), fp8.zero_grad()
    assert _same_buffers(before, _buffers(fp8))


def test_fp8_autocast_nesting_restores_state():
    assert not lf.is_fp8_autocast_enabled()
    with lf.fp8_autocast():
        assert lf.is_fp8_autocast_enabled()
        with lf.fp8_autocast(enabled=False):
            assert not lf.is_fp8_autocast_enabled()
        assert lf.is_fp8_autocast_enabled()
        with pytest.raises(RuntimeError), lf.fp8_autocast(enabled=False):
            raise RuntimeError
        assert lf.is_fp8_autocast_enabled()
    assert not lf.is_fp8_autocast_enabled()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_layer_actually_quantizes(recipe):
    # inside the region the result must differ from nn.Linear (no silent high-precision fallback)
    ref = nn.Linear(64, 32)
    fp8 = copy.deepcopy(ref)
    lf.convert_to_fp8(fp8, recipe=recipe)
    x = torch.randn(16, 64)
    y_ref, y = _step(ref, x, fp8=False), _step(fp8, x)
    for a, b in zip(y_ref[:3], y[:3]):
        assert not torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=0.2, atol=0.1 * a.abs().max().item())
    assert fp8.fp8_counts[:, SEEN].tolist() == [16 * 64, 64 * 32, 16 * 32]


# --- numerics: SQNR against float64, torchao as the reference implementation -----------------------------


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


@pytest.fixture(scope="module")
def sqnr_setup():
    gen = torch.Generator().manual_seed(1234)
    base = nn.Linear(512, 1024)
    with torch.no_grad():
        base.weight.copy_(torch.empty(1024, 512).uniform_(-1, 1, generator=gen) / math.sqrt(512))
        base.bias.copy_(torch.empty(1024).uniform_(-1, 1, generator=gen) / math.sqrt(512))
    x = torch.randn(4, 256, 512, generator=gen)
    x_warmup = torch.randn(4, 256, 512, generator=gen)
    grad = torch.randn(4, 256, 1024, generator=gen)
    ref = copy.deepcopy(base).double()
    xd = x.double().requires_grad_()
    yd = ref(xd)
    yd.backward(grad.double())
    reference = (yd.detach(), xd.grad, ref.weight.grad)
    return base, x, x_warmup, grad, reference


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("recipe", [r for r in RECIPES if r not in lf.recipe.BLOCK_RECIPES])  # blocks: test_block_recipes
def test_sqnr_at_least_torchao(sqnr_setup, recipe, autocast):
    base, x, x_warmup, grad, reference = sqnr_setup
    ours = copy.deepcopy(base)
    lf.convert_to_fp8(ours, recipe=recipe)
    if recipe == "delayed":
        # delayed scaling takes its scales from the history: warm it up on another batch of the same
        # distribution, so the measured step really runs on history scales (torchao no longer has a
        # delayed recipe; its tensorwise recipe, the current-scaling limit of delayed, is the reference)
        _step(ours, x_warmup, grad, autocast)
        lf.roll_amax_history(ours)  # the warm-up backward's grad_output amax (it rolls at the next exit otherwise)
        assert bool(ours.fp8_initialized.all())
    got = _step(ours, x, grad, autocast)[:3]

    ao_recipe = "tensorwise" if recipe == "delayed" else recipe
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(ao_recipe), emulate=True)
    ao = convert_to_float8_training(nn.Sequential(copy.deepcopy(base)), config=config)
    assert type(ao[0]).__name__ == "Float8Linear"
    theirs = _step(ao, x, grad, autocast, fp8=False)[:3]

    names = ("output", "grad_input", "grad_weight")
    ours_db = [_sqnr(r, g) for r, g in zip(reference, got)]
    theirs_db = [_sqnr(r, g) for r, g in zip(reference, theirs)]
    print(
        f"\nSQNR {recipe:10s} {'bf16-autocast' if autocast else 'fp32':13s} "
        + " ".join(f"{n}: ours {a:.2f} dB, torchao {b:.2f} dB;" for n, a, b in zip(names, ours_db, theirs_db))
    )
    for name, a, b in zip(names, ours_db, theirs_db):
        assert a >= b - 0.5, f"{recipe} {name}: ours {a:.2f} dB < torchao {b:.2f} dB - 0.5"
        # and it is FP8 (E4M3 keeps 3 mantissa bits: a high-precision fallback would reach 45+ dB)
        assert a < 36, f"{recipe} {name}: {a:.2f} dB looks like a high-precision GEMM"
        assert b > 20  # torchao emulation really ran


# --- shapes and layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_input_dtype_errors(recipe):
    m = FP8Linear(32, 16, recipe=recipe)
    with lf.fp8_autocast():
        for bad in (torch.ones(4, 32, dtype=torch.int64), torch.ones(4, 32, dtype=torch.int32)):
            with pytest.raises(TypeError, match="floating-point"):
                m(bad)
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            with pytest.raises(TypeError, match=str(fp8).replace("torch.", "")):
                m(torch.randn(4, 32).to(fp8))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(0, 32), (2, 0, 32), (0, 3, 5, 32)])
def test_empty_batch(recipe, shape):
    m = FP8Linear(32, 16, recipe=recipe)
    before = _buffers(m)
    y, gx, gw, gb = _step(m, torch.randn(*shape))
    assert y.shape == (*shape[:-1], 16) and gx.shape == shape
    assert gw is not None and torch.equal(gw, torch.zeros_like(gw))
    assert torch.equal(gb, torch.zeros_like(gb))
    assert _same_buffers(before, _buffers(m))


@pytest.mark.parametrize("recipe", RECIPES)
def test_nd_inputs_match_2d(recipe):
    m = FP8Linear(32, 48, recipe=recipe)
    x2 = torch.randn(60, 32)
    g2 = torch.randn(60, 48)
    ref = _step(copy.deepcopy(m), x2, g2)
    for shape in [(60, 32), (4, 15, 32), (2, 3, 10, 32), (2, 3, 2, 5, 32)]:
        y, gx, gw, gb = _step(copy.deepcopy(m), x2.reshape(shape), g2.reshape(*shape[:-1], 48))
        assert y.shape == (*shape[:-1], 48) and gx.shape == shape
        assert torch.equal(y.reshape(60, 48), ref[0]) and torch.equal(gx.reshape(60, 32), ref[1])
        assert torch.equal(gw, ref[2]) and torch.equal(gb, ref[3])


@pytest.mark.parametrize("recipe", RECIPES)
def test_1d_input(recipe):
    m = FP8Linear(32, 16, recipe=recipe)
    x = torch.randn(32)
    y, gx, gw, _ = _step(copy.deepcopy(m), x)
    y2, gx2, gw2, _ = _step(copy.deepcopy(m), x.unsqueeze(0))
    assert y.shape == (16,) and gx.shape == (32,)
    assert torch.equal(y, y2[0]) and torch.equal(gx, gx2[0]) and torch.equal(gw, gw2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_non_contiguous_input(recipe):
    m = FP8Linear(64, 32, recipe=recipe)
    base = torch.randn(64, 24)
    xt = base.t()  # (24, 64), transposed view
    assert not xt.is_contiguous()
    g = torch.randn(24, 32)
    a = _step(copy.deepcopy(m), xt, g)
    b = _step(copy.deepcopy(m), xt.contiguous(), g)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    # a strided 3-D view, and a non-contiguous gradient
    x3 = torch.randn(4, 64, 6).transpose(1, 2)
    g3 = torch.randn(4, 32, 6).transpose(1, 2)
    a = _step(copy.deepcopy(m), x3, g3)
    b = _step(copy.deepcopy(m), x3.contiguous(), g3.contiguous())
    assert all(torch.equal(u, v) for u, v in zip(a[:3], b[:3]))
    # the bias gradient is autograd's own sum over a strided gradient (same as for nn.Linear)
    torch.testing.assert_close(a[3], b[3])


@pytest.mark.parametrize("recipe", RECIPES)
def test_bias_false(recipe):
    with_bias = FP8Linear(32, 16, recipe=recipe)
    without = FP8Linear(32, 16, bias=False, recipe=recipe)
    with torch.no_grad():
        without.weight.copy_(with_bias.weight)
        with_bias.bias.zero_()
    x = torch.randn(8, 32)
    a, b = _step(with_bias, x), _step(without, x)
    assert b[3] is None
    assert all(torch.equal(u, v) for u, v in zip(a[:3], b[:3]))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("in_f", "out_f", "rows"), [(24, 40, 7), (5, 3, 2), (17, 33, 1)])
def test_unaligned_features_equal_zero_padded_aligned_layer(recipe, in_f, out_f, rows):
    """Padding inside the GEMMs must give what an explicitly zero-padded aligned layer gives."""
    pad_in, pad_out = -in_f % 16 + in_f, -out_f % 16 + out_f
    small = FP8Linear(in_f, out_f, recipe=recipe)
    big = FP8Linear(pad_in, pad_out, recipe=recipe)
    with torch.no_grad():
        big.weight.zero_()
        big.bias.zero_()
        big.weight[:out_f, :in_f] = small.weight
        big.bias[:out_f] = small.bias
    x, g = torch.randn(rows, in_f), torch.randn(rows, out_f)
    xp, gp = torch.zeros(rows, pad_in), torch.zeros(rows, pad_out)
    xp[:, :in_f], gp[:, :out_f] = x, g
    a, b = _step(small, x, g), _step(big, xp, gp)
    assert torch.equal(a[0], b[0][:, :out_f])
    assert torch.equal(a[1], b[1][:, :in_f])
    assert torch.equal(a[2], b[2][:out_f, :in_f])


@pytest.mark.parametrize("recipe", RECIPES)
def test_unaligned_layer_close_to_linear(recipe):
    lin = nn.Linear(24, 40)
    fp8 = copy.deepcopy(lin)
    lf.convert_to_fp8(fp8, recipe=recipe, skip_unaligned=False)
    x, g = torch.randn(7, 24), torch.randn(7, 40)
    for a, b in zip(_step(lin, x, g, fp8=False)[:3], _step(fp8, x, g)[:3]):
        assert _sqnr(a, b) > 20


@pytest.mark.parametrize("recipe", RECIPES)
def test_grads_when_only_one_operand_needs_them(recipe):
    m = FP8Linear(32, 16, recipe=recipe)
    x, g = torch.randn(8, 32), torch.randn(8, 16)
    full = _step(copy.deepcopy(m), x, g)
    # input without grad (first layer of a network)
    m1 = copy.deepcopy(m)
    with lf.fp8_autocast():
        y = m1(x)
    y.backward(g)
    assert torch.equal(m1.weight.grad, full[2])
    # frozen weight (adapters, fine-tuning)
    m2 = copy.deepcopy(m).requires_grad_(False)
    xx = x.clone().requires_grad_()
    with lf.fp8_autocast():
        y = m2(xx)
    y.backward(g)
    assert m2.weight.grad is None and torch.equal(xx.grad, full[1])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_output_dtype_under_autocast_is_nn_linear_s(recipe, dtype):
    """Autocast casts float32 and float16 inputs of a linear to its dtype, never float64 ones."""
    lin = nn.Linear(32, 16).to(dtype)
    fp8 = copy.deepcopy(lin)
    lf.convert_to_fp8(fp8, recipe=recipe)
    x = torch.randn(4, 32, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = lin(x).dtype
        with lf.fp8_autocast():
            assert fp8(x).dtype == expected


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_parameters(recipe, dtype):
    m = FP8Linear(32, 16, recipe=recipe).to(dtype)
    x = torch.randn(8, 32, dtype=dtype)
    for _ in range(2):
        y, gx, gw, gb = _step(m, x, torch.randn(8, 16, dtype=dtype))
    assert y.dtype == gx.dtype == gw.dtype == gb.dtype == dtype
    assert all(torch.isfinite(t).all() for t in (y, gx, gw, gb))
    lin = nn.Linear(32, 16).to(dtype)
    lin.load_state_dict(m.state_dict())
    x = torch.randn(8, 32, dtype=dtype)
    g = torch.randn(8, 16, dtype=dtype)
    for a, b in zip(_step(lin, x, g, fp8=False), _step(m, x, g)):
        assert _sqnr(a, b) > 20
    assert m.fp8_scale.dtype == torch.float32


# --- NaN / Inf --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_reaches_output_and_counters(recipe, bad):
    m = FP8Linear(32, 16, recipe=recipe)
    _step(m, torch.randn(8, 32))  # a good step first (initializes the delayed history)
    before = m.fp8_counts.clone()
    x = torch.randn(8, 32)
    x[3, 5] = bad
    x[6, 0] = bad
    y, gx, gw, _ = _step(m, x, torch.randn(8, 16))
    assert not torch.isfinite(y).all()
    assert not torch.isfinite(y[3]).any() and not torch.isfinite(y[6]).any()
    new_overflows = (m.fp8_counts[INPUT, OVERFLOW] - before[INPUT, OVERFLOW]).item()
    assert new_overflows >= 2
    if recipe == "delayed":
        # the cast uses the history's finite scale: exactly the two bad elements overflow
        assert new_overflows == 2
        assert torch.isfinite(y[[0, 1, 2, 4, 5, 7]]).all()
    assert m.fp8_counts[WEIGHT, OVERFLOW] == before[WEIGHT, OVERFLOW]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_step_does_not_poison_delayed_history(algo, bad):
    recipe = FP8Recipe(name="delayed", amax_compute_algo=algo)
    good = [torch.randn(16, 32) * s for s in (1.0, 3.0, 0.5, 2.0)]
    bad_x = torch.randn(16, 32)
    bad_x[2, 3] = bad
    g = torch.randn(16, 16)
    a = FP8Linear(32, 16, recipe=recipe)
    b = copy.deepcopy(a)
    for x in good[:2]:
        _step(a, x, g)
        _step(b, x, g)
    _step(a, bad_x, g)
    assert torch.isfinite(a.fp8_scale).all()
    for x in good[2:]:
        ya = _step(a, x, g)
        yb = _step(b, x, g)
        assert torch.isfinite(a.fp8_scale).all()
        assert torch.equal(a.fp8_scale, b.fp8_scale)
        assert all(torch.equal(u, v) for u, v in zip(ya, yb))


# --- eval, inference_mode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_eval_and_inference_mode_leave_state_untouched(recipe):
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    lf.convert_to_fp8(m, recipe=recipe)
    x = torch.randn(8, 32)
    _step(m, x)
    train_out = _step(copy.deepcopy(m), x)[0]
    before = _buffers(m)

    m.eval()
    with lf.fp8_autocast():
        y_eval = m(x)
    with torch.no_grad(), lf.fp8_autocast():
        y_nograd = m(x)
    with torch.inference_mode(), lf.fp8_autocast():
        y_inf = m(x)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), lf.fp8_autocast():
        y_inf_bf16 = m(x)
    assert _same_buffers(before, _buffers(m))
    assert torch.equal(y_eval.detach(), y_nograd) and torch.equal(y_nograd, y_inf)
    assert y_inf_bf16.dtype == torch.bfloat16 and torch.isfinite(y_inf_bf16).all()
    if recipe == "tensorwise":
        assert torch.equal(y_eval.detach(), train_out)

    m.train()
    with torch.inference_mode(), lf.fp8_autocast():
        y_inf_train = m(x)
    assert torch.isfinite(y_inf_train).all()
    assert _same_buffers(before, _buffers(m))
    assert not any(b.is_inference() for b in m.buffers())
    # training resumes normally afterwards
    _step(m, x)
    assert not _same_buffers(before, _buffers(m))


# --- no device-to-host synchronisation ------------------------------------------------------------------

_SYNC_OPS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal")


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def syncs(self) -> dict[str, int]:
        return {k: v for k, v in self.ops.items() if k in _SYNC_OPS}


def test_sync_counter_sees_syncs():
    # positive control: the counter does catch a host read and a Python branch on a tensor
    t = torch.ones(3)
    with _OpCounter() as c:
        t.sum().item()
        if t.max() > 0:
            pass
    assert c.syncs().get("aten._local_scalar_dense", 0) + c.syncs().get("aten.is_nonzero", 0) >= 2


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("defer", [False, True], ids=["roll", "defer"])
def test_forward_backward_has_no_host_sync(recipe, autocast, defer):
    model = nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 48))
    lf.convert_to_fp8(model, recipe=recipe)
    for step in range(2):  # the second step runs on initialized (delayed) state
        x = torch.randn(4, 6, 64, requires_grad=True)
        with _OpCounter() as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                with lf.fp8_autocast(defer_amax_history_roll=defer):
                    y = model(x)
            y.float().square().sum().backward()
            if defer:
                lf.roll_amax_history(model)
        assert counter.syncs() == {}, f"step {step}: {counter.syncs()}"
        assert counter.ops["aten.mm"] == 6  # the counter saw all three GEMMs of both layers
    assert model[0].fp8_counts[:, 0].tolist() == [2 * 24 * 64, 2 * 64 * 32, 2 * 24 * 32]


class _HostDataCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts tensors made from host data (``aten.lift_fresh``: ``torch.tensor(...)``, ``t[i] = True``). On a GPU each
    is a copy from pageable host memory, which synchronises the host with the device."""

    def __init__(self):
        super().__init__()
        self.lifted = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy):
            self.lifted += 1
        return func(*args, **(kwargs or {}))


class _Siblings(nn.Module):
    """Three layers reading one input (attention's q/k/v): the followers share the first one's FP8 input cast."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x):
        h = x * 2  # not a leaf: its casts can be shared
        return torch.cat([self.q(h), self.k(h), self.v(h)], dim=-1)


@pytest.mark.parametrize("recipe", RECIPES)
def test_training_steps_make_no_tensor_from_host_data(recipe):
    # Found on an H200 (benchmarks/bench_llama.py records where synchronising CUDA calls come from): eager `delayed`
    # made one synchronising copy per follower layer of a shared input cast and forward, from `ready[INPUT] = True`.
    model = _Siblings()
    lf.convert_to_fp8(model, recipe=recipe)
    for step in range(3):  # the later steps run on initialized (delayed) state
        x = torch.randn(4, 6, 32, requires_grad=True)
        # the first step's roll makes the table's per-device constants, once (FP8StateTable._role_max): not counted
        with _HostDataCounter() if step else contextlib.nullcontext(_HostDataCounter()) as counter:
            with lf.fp8_autocast(defer_amax_history_roll=True):
                y = model(x)
            y.float().square().sum().backward()
            lf.roll_amax_history(model)
        assert not step or counter.lifted == 0, f"{recipe}, step {step}: {counter.lifted} tensors made from host data"


# --- memory saved for backward ----------------------------------------------------------------------------


def _saved_bytes(model, x, fp8: bool, backward: bool = True) -> int:
    """Bytes of the distinct storages saved for backward that are not parameter storage. The pack hook runs in the
    forward (where autograd saves); the backward only checks that what was saved runs it (``backward=False`` skips it
    for ``nn.Linear``'s own reference: its bf16 GEMMs alone took ~16 s on a 2-core CPU)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16), lf.fp8_autocast(enabled=fp8):
            y = model(x)
    if backward:
        y.float().sum().backward()
    return sum(saved.values())


def test_saved_for_backward_is_at_most_055_of_bf16_linear():
    m, k, n = 8192, 1024, 1024
    x = torch.randn(m, k, requires_grad=True)
    base = nn.Linear(k, n)
    reference = _saved_bytes(copy.deepcopy(base), x, fp8=False, backward=False)
    # nn.Linear under bf16 autocast keeps the bf16 copies of input and weight
    assert reference >= 2 * (m * k + n * k)
    ratios = {}
    for recipe in RECIPES:
        layer = copy.deepcopy(base)
        lf.convert_to_fp8(layer, recipe=recipe)
        ratios[recipe] = _saved_bytes(layer, x, fp8=True) / reference
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    ao = convert_to_float8_training(nn.Sequential(copy.deepcopy(base)), config=config)
    print(
        "\nsaved for backward vs nn.Linear under bf16 autocast: "
        + ", ".join(f"{recipe} {ratio:.3f}" for recipe, ratio in ratios.items())
        + f", torchao tensorwise {_saved_bytes(ao, x, fp8=False) / reference:.3f}"
    )
    for recipe, ratio in ratios.items():
        assert ratio <= 0.55, f"{recipe}: {ratio:.3f}"


# --- torch.compile ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_compile_fullgraph_matches_eager_bitwise(recipe):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    lf.convert_to_fp8(eager, recipe=recipe)
    compiled_model = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True)
    for step in range(3):  # step 0 initializes the delayed history, later steps run on it
        x = torch.randn(8, 64) * (1 + step)
        g = torch.randn(8, 32)
        outs = []
        for model in (eager, compiled):
            xx = x.clone().requires_grad_()
            with lf.fp8_autocast():
                y = model(xx)
            y.backward(g)
            outs.append((y.detach(), xx.grad))
        assert torch.equal(outs[0][0], outs[1][0]), f"step {step} output"
        assert torch.equal(outs[0][1], outs[1][1]), f"step {step} grad_input"
        for (name, p), (_, q) in zip(eager.named_parameters(), compiled_model.named_parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step} {name}.grad"
            p.grad = q.grad = None
        state_eager, state_compiled = _buffers(eager), _buffers(compiled_model)
        assert state_eager.keys() == state_compiled.keys() and len(state_eager) == 2 * 7
        for name, value in state_eager.items():
            assert torch.equal(value, state_compiled[name]), f"step {step} {name}"
    assert counter.frame_count == 1  # one graph, no breaks, no recompilation
    assert eager[0].fp8_counts[0, 0].item() == 3 * 8 * 64


class _Blocks(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


#: under the deferred roll a per-tensor, the history and a block recipe (how the graphs share the table does not depend
#: on the cast specs); in a standalone region, where each block compiles its own graph, a per-tensor one
SEPARATE_BLOCK_CASES = [("tensorwise", True), ("delayed", True), ("mxfp8", True), ("tensorwise", False)]


@pytest.mark.parametrize(
    ("recipe", "defer"), SEPARATE_BLOCK_CASES,
    ids=[f"{'deferred' if d else 'standalone'}-{r}" for r, d in SEPARATE_BLOCK_CASES],
)
def test_blocks_compiled_separately_share_one_state_table(recipe, defer):
    """Each block compiled on its own (a common way to compile transformers, torchtitan's and Lightning's model-parallel
    examples'): the graphs write rows of one shared state table, forward and backward. No graph may undo what another
    wrote (AOTAutograd writes back whole mutated inputs), so the run must equal eager bit for bit, state included.

    And under a deferred roll (the plugins'), identical blocks share one graph: a layer's row in the table must not be
    a constant of the graph (each block would recompile, and past torch's recompile limit, 8 by default, the
    remaining blocks would silently run eager)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager = _Blocks(n=3)
    lf.convert_to_fp8(eager, recipe=recipe)
    compiled = copy.deepcopy(eager)
    assert len({id(b[0].fp8_state.table) for b in compiled.blocks}) == 1
    counter = CompileCounterWithBackend("aot_eager")
    for i, block in enumerate(compiled.blocks):
        compiled.blocks[i] = torch.compile(block, backend=counter, fullgraph=True)
    for step in range(3):
        x, g = torch.randn(8, 64) * (1 + step), torch.randn(8, 64)
        outs = []
        for model in (eager, compiled):
            xx = x.clone().requires_grad_()
            with lf.fp8_autocast(defer_amax_history_roll=defer):
                y = model(xx)
            y.backward(g)
            if defer:
                lf.roll_amax_history(model)
            outs.append((y.detach(), xx.grad, [p.grad for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        (y1, gx1, gp1), (y2, gx2, gp2) = outs
        assert torch.equal(y1, y2) and torch.equal(gx1, gx2), step
        assert all(torch.equal(a, b) for a, b in zip(gp1, gp2)), step
        state_eager = _buffers(eager)
        state_compiled = {k.replace("._orig_mod", ""): v for k, v in _buffers(compiled).items()}
        for name, value in state_eager.items():
            assert torch.equal(value, state_compiled[name]), f"step {step} {name}"
    # one graph for the three blocks, all three steps; a standalone region rolls between forward and backward, where
    # each layer's row stays a constant of its graph (see FP8Linear._forward): one graph per block
    assert counter.frame_count == (1 if defer else len(compiled.blocks))


def _compile_in_scope(model, parts, scope, backend, fullgraph=True, every=1):
    """``model`` compiled whole (``scope="model"``), or every ``every``-th module of ``parts`` (a ModuleList or
    Sequential of ``model``) compiled in its place."""
    if scope == "model":
        return torch.compile(model, backend=backend, fullgraph=fullgraph)
    for i in range(0, len(parts), every):
        parts[i] = torch.compile(parts[i], backend=backend, fullgraph=fullgraph)
    return model


def _deferred_step(model, x, g, roll_before_backward=False):
    """One step under a deferred roll: ``(output, input grad, parameter grads)``; the roll after the backward (the
    plugins' order) or between the forward and the backward."""
    xx = x.clone().requires_grad_()
    with lf.fp8_autocast(defer_amax_history_roll=True):
        y = model(xx)
    if roll_before_backward:
        lf.roll_amax_history(model)
    y.backward(g)
    if not roll_before_backward:
        lf.roll_amax_history(model)
    out = (y.detach(), xx.grad, [p.grad for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


#: both scopes traced (``aot_eager``); inductor's partitioner and codegen on the layers compiled one by one (the whole
#: model under inductor checks nothing more: the same history reads, at several times the compile time)
HISTORY_ROLL_CASES = [("layers", "aot_eager"), ("model", "aot_eager"), ("layers", "inductor")]


@pytest.mark.parametrize(("scope", "backend"), HISTORY_ROLL_CASES, ids=[f"{s}-{b}" for s, b in HISTORY_ROLL_CASES])
def test_compiled_backward_reads_history_rolled_after_its_forward(scope, backend):
    """Under a deferred roll the roll may still fall between a layer's forward and its backward: manual optimization
    with two optimizers (a GAN: the discriminator's step rolls the one table, then the generator's backward runs), or
    a backward over a retained graph. The compiled backward must read the grad_output history as it is when it runs,
    as eager does; a copy taken in the forward (which AOTAutograd's partitioner would make of an indexed read the
    forward also does) is stale. The gradients grow 4x a step, so a stale history scales them wrongly."""
    torch._dynamo.reset()
    eager = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.GELU())])  # six rows in one table
    lf.convert_to_fp8(eager, recipe="delayed")
    plain = copy.deepcopy(eager)
    compiled = _compile_in_scope(plain, plain, scope, backend, every=2)
    for step in range(3):
        x, g = torch.randn(16, 32) * (1 + step), torch.randn(16, 32) * 4**step
        (_, gx1, gp1), s1 = _deferred_step(eager, x, g, roll_before_backward=True), _buffers(eager)
        (_, gx2, gp2), s2 = _deferred_step(compiled, x, g, roll_before_backward=True), _buffers(compiled)
        s2 = {k.replace("._orig_mod", "").replace("_orig_mod.", ""): v for k, v in s2.items()}
        if backend == "aot_eager":  # the same operations: bit for bit
            assert torch.equal(gx1, gx2), f"step {step} grad_input"
            assert all(torch.equal(a, b) for a, b in zip(gp1, gp2)), f"step {step}"
            assert all(torch.equal(v, s2[k]) for k, v in s1.items()), f"step {step} state"
        else:  # inductor fuses the GELUs and bias adds (last-bit differences); a stale scale is far off (~100%)
            torch.testing.assert_close(gx2, gx1, rtol=1e-4, atol=1e-5, msg=f"step {step} grad_input")
            for a, b in zip(gp1, gp2):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"step {step} parameter grads")
            for k, v in s1.items():
                if v.is_floating_point():  # scales and histories
                    torch.testing.assert_close(s2[k], v, rtol=1e-4, atol=0, msg=f"step {step} {k}")


# --- activation checkpointing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "defer"),
    [("tensorwise", False), ("rowwise", False), ("tensorwise", True), ("delayed", True), ("rowwise", True)],
)
def test_activation_checkpointing_matches_plain(recipe, defer):
    """The recomputation runs in the backward pass, outside fp8_autocast (as in Lightning): it must take the
    FP8 path of the original forward, give the same gradients and not record statistics twice."""
    from torch.utils.checkpoint import checkpoint

    plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    lf.convert_to_fp8(plain, recipe=recipe)
    ckpt = copy.deepcopy(plain)
    for step in range(2):
        x, g = torch.randn(8, 32) * (step + 1), torch.randn(8, 32)
        results = []
        for model, use_ckpt in ((plain, False), (ckpt, True)):
            xx = x.clone().requires_grad_()
            with lf.fp8_autocast(defer_amax_history_roll=defer):
                y = checkpoint(model, xx, use_reentrant=False) if use_ckpt else model(xx)
            y.backward(g)  # outside the region
            if defer:
                lf.roll_amax_history(model)
            results.append((y.detach(), xx.grad, [p.grad for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        (y1, gx1, gp1), (y2, gx2, gp2) = results
        assert torch.equal(y1, y2) and torch.equal(gx1, gx2)
        assert all(torch.equal(a, b) for a, b in zip(gp1, gp2))
        assert _same_buffers(_buffers(plain), _buffers(ckpt))
    assert plain[0].fp8_counts[0, 0] == 2 * 8 * 32


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_records_each_tensor_once(use_reentrant):
    """Reentrant checkpointing runs the original forward without a graph: the recomputation's backward is the
    one that records grad_output. Non-reentrant: the original's backward does. Either way, once."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = lf.FP8Linear(32, 32, recipe="delayed")
    x = torch.randn(4, 32, requires_grad=True)
    with lf.fp8_autocast():
        out = checkpoint(layer, x, use_reentrant=use_reentrant)
    out.sum().backward()
    assert layer.fp8_counts[:, 0].tolist() == [4 * 32, 32 * 32, 4 * 32]


@pytest.mark.slow
def test_retained_graph_second_backward_after_a_cached_donated_backward():
    """The torch defect behind the troubleshooting page's retained-graph limitation, and its workaround. A model
    compiled by inductor whose backward ran once without ``retain_graph`` leaves in inductor's FX graph cache a backward
    compiled with donated buffers (it overwrites saved activations in place: ``buf0 = mm; del mm  # reuse``). The
    cache key does not record the donation, so a second compile of the same graph loads that backward even when its
    first backward retains the graph, and the second backward computes from overwritten values, with no error.
    AOTAutograd's own cache would raise there ("compiled with non-empty donated buffers"), but it refuses graphs that
    hold a traced autograd.Function (``autograd_function_apply``), as ours do. Pure torch does the same with that
    cache off (seen here, 3x off). The first half is a canary: if it starts to pass, torch fixed it and the limitation
    can go. With ``torch._inductor.config.fx_graph_cache = False`` every compile is fresh: the backward is compiled at
    its first run, which retains the graph, so without donated buffers, and both backwards match eager. (Not
    ``allow_buffer_reuse = False``: a donated backward compiled under it reuses saved activations too, seen here.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(32, 32), nn.GELU())
    lf.convert_to_fp8(eager, recipe="delayed")
    x, g = torch.randn(16, 32), torch.randn(16, 32)

    def backwards(model, twice):
        xx = x.clone().requires_grad_()
        with lf.fp8_autocast(defer_amax_history_roll=True):
            y = model(xx)
        y.backward(g, retain_graph=twice)
        grads = [[p.grad.clone() for p in model.parameters()]]
        model.zero_grad(set_to_none=True)
        if twice:
            y.backward(g)
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        return grads

    backwards(torch.compile(copy.deepcopy(eager), backend="inductor", fullgraph=True), twice=False)
    first_eager, second_eager = backwards(eager, twice=True)
    torch._dynamo.reset()
    first, second = backwards(torch.compile(copy.deepcopy(eager), backend="inductor", fullgraph=True), twice=True)
    for a, b in zip(first_eager, first):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert max(float((b - a).abs().max() / a.abs().max()) for a, b in zip(second_eager, second)) > 0.05
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(copy.deepcopy(eager), backend="inductor", fullgraph=True)
        first, second = backwards(compiled, twice=True)
    for a, b, c, d in zip(first_eager, first, second_eager, second):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d, c, rtol=1e-5, atol=1e-6)


class _CheckpointedBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)


def _checkpointed_twins(recipe, scope, backend):
    """Two blocks, each in an activation checkpoint, eager and compiled with its checkpoint (``scope``: the whole model
    or block by block), same weights."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Blocks(n=2)
    lf.convert_to_fp8(eager, recipe=recipe)
    compiled = copy.deepcopy(eager)
    eager.blocks = nn.ModuleList(_CheckpointedBlock(b) for b in eager.blocks)
    compiled.blocks = nn.ModuleList(_CheckpointedBlock(b) for b in compiled.blocks)
    return eager, _compile_in_scope(compiled, compiled.blocks, scope, backend, fullgraph=True)


def _assert_steps_match(eager, compiled, growth, roll_before_backward=False, run_step=None):
    """Three steps (deferred-roll ones, or ``run_step(model, x, g)``) of inputs growing by ``growth`` a step: outputs,
    gradients and FP8 state bit for bit."""
    if run_step is None:
        def run_step(model, x, g):
            return _deferred_step(model, x, g, roll_before_backward)

    for step in range(3):
        x, g = torch.randn(8, 64) * growth**step, torch.randn(8, 64) * 2**step
        y1, gx1, gp1 = run_step(eager, x, g)
        y2, gx2, gp2 = run_step(compiled, x, g)
        assert torch.equal(y1, y2) and torch.equal(gx1, gx2), step
        assert all(torch.equal(a, b) for a, b in zip(gp1, gp2)), step
    state_eager = lf.fp8_state_dict(eager)["tables"][0]
    state_compiled = lf.fp8_state_dict(compiled)["tables"][0]
    for name, value in state_eager.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, state_compiled[name]), name
    return state_eager


#: every recipe compiled whole; block by block (a frame per checkpointed block, one shared graph) a per-tensor and a
#: block recipe: how the block graphs share the table does not depend on the cast specs
CHECKPOINTED_CASES = [(recipe, "model") for recipe in RECIPES] + [("tensorwise", "blocks"), ("mxfp8", "blocks")]


@pytest.mark.parametrize(("recipe", "scope"), CHECKPOINTED_CASES, ids=[f"{r}-{s}" for r, s in CHECKPOINTED_CASES])
def test_compiled_checkpointed_blocks_match_eager(recipe, scope):
    """An activation checkpoint compiled with its block (``torch.compile(checkpointed_block)``, or the whole model),
    under a deferred roll (the plugins'), against the same checkpointed model eager, bit for bit, FP8 state included.
    Every recipe compiles into one graph with ``fullgraph=True``, ``delayed`` included (its compiled records no longer
    store anything on the host, a side effect dynamo refuses inside a checkpoint)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    eager, compiled = _checkpointed_twins(recipe, scope, counter)
    state = _assert_steps_match(eager, compiled, growth=2)
    assert int(state["counts"][0, 0, 0]) == 3 * 8 * 64  # each input recorded once a step, not by the recomputation
    assert counter.frame_count == 1


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_compiled_checkpointed_delayed_blocks_recompute_with_the_forwards_scales(scope):
    """A roll between the forward and the backward of compiled checkpointed ``delayed`` blocks (two optimizers, a
    retained graph): the recomputation in the backward casts the input and weight with the scales their forward used
    (from before the roll), as eager's replay does, and the grad_output with the rolled history; bit for bit with
    eager. It read the rolled input and weight scales: gradients up to half off, no error."""
    eager, compiled = _checkpointed_twins("delayed", scope, "aot_eager")
    _assert_steps_match(eager, compiled, growth=4, roll_before_backward=True)


def _standalone_step(model, x, g):
    """One step in a standalone ``fp8_autocast()`` (it rolls on exit, between the forward and the backward):
    ``(output, input grad, parameter grads)``."""
    xx = x.clone().requires_grad_()
    with lf.fp8_autocast():
        y = model(xx)
    y.backward(g)
    out = (y.detach(), xx.grad, [p.grad for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


#: the history recipe compiled whole and block by block; a per-tensor one whole
STANDALONE_CASES = [("delayed", "model"), ("delayed", "blocks"), ("tensorwise", "model")]


@pytest.mark.parametrize(("recipe", "scope"), STANDALONE_CASES, ids=[f"{r}-{s}" for r, s in STANDALONE_CASES])
def test_standalone_region_compiles_checkpointed_blocks(recipe, scope):
    """Checkpointed blocks compiled with their checkpoint (whole model or block by block) inside a standalone
    ``fp8_autocast()``: one graph per frame with ``fullgraph=True``, bit for bit with the eager twin over three steps,
    FP8 state included (each table rolled once per region, on exit). The region used to note on the host which layers
    ran, a side effect dynamo refuses inside a checkpoint (``Unsafe side effect``; without ``fullgraph`` the blocks
    ran eager); compiled layers now mark their table instead (``FP8StateTable.mark_compiled_forward``)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    eager, compiled = _checkpointed_twins(recipe, scope, counter)
    state_eager = _assert_steps_match(eager, compiled, growth=4, run_step=_standalone_step)
    assert int(state_eager["counts"][0, 0, 0]) == 3 * 8 * 64  # each input recorded once a step
    history = state_eager["amax_history"][0, 0]  # one roll a step: three input amaxes, the latest first
    assert bool((history[:3] > 0).all()) and bool((history[3:] == 0).all())
    assert counter.frame_count == (1 if scope == "model" else 2)  # standalone: each block's row is a constant


def test_standalone_region_rolls_the_tables_that_recorded_inside_it_once():
    """A standalone region rolls, on exit and once, each table that a training forward recorded into while it was
    open, eager or compiled (found from the table's version counter), and no other: not a model that did not run, not
    a compiled model in eval mode (it records nothing)."""
    torch._dynamo.reset()
    ran, idle = nn.Sequential(nn.Linear(32, 32)), nn.Sequential(nn.Linear(32, 32))
    for model in (ran, idle):
        lf.convert_to_fp8(model, recipe="delayed")
    compiled = torch.compile(ran, backend="aot_eager", fullgraph=True)
    table, other = ran[0].fp8_state.table, idle[0].fp8_state.table
    generations = table.generation, other.generation
    with lf.fp8_autocast():
        compiled(torch.randn(4, 32))
        compiled(torch.randn(4, 32))  # two forwards, one roll
    assert (table.generation, other.generation) == (generations[0] + 1, generations[1])
    history = table.amax_history[0, 0]
    assert bool(history[0] > 0) and bool((history[1:] == 0).all())
    ran.eval()
    with lf.fp8_autocast():
        compiled(torch.randn(4, 32))
    assert table.generation == generations[0] + 1  # an evaluation forward records nothing: no roll
    ran.train()
    with lf.fp8_autocast():
        with lf.fp8_autocast():  # an inner region never rolls; the outermost rolls once
            idle(torch.randn(4, 32))
            compiled(torch.randn(4, 32))
    assert (table.generation, other.generation) == (generations[0] + 2, generations[1] + 1)


def test_state_is_fresh_after_to_empty_from_meta():
    with torch.device("meta"):
        layer = lf.FP8Linear(32, 32, recipe="delayed")
    layer.to_empty(device="cpu")
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.zeros_(layer.bias)
    assert torch.equal(layer.fp8_scale, torch.ones(3)) and not layer.fp8_initialized.any()
    assert int(layer.fp8_counts.abs().sum()) == 0 and int(layer.fp8_amax_history.abs().sum()) == 0
    with lf.fp8_autocast():
        out = layer(torch.randn(4, 32))
    assert torch.isfinite(out).all()


# --- the weight provider seam ------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_weight_provider_hands_over_the_quantized_weight(recipe):  # delayed: test_weight_provider_under_checkpointing
    """A provider (what an FP8 all-gathered weight will be) replaces the layer's own weight cast; its statistics are
    recorded as if the layer had cast the weight, and ``None`` falls back to the layer's cast."""
    from lightning_fp8.quantize import quantize

    layer = FP8Linear(64, 32, recipe=recipe)
    reference = copy.deepcopy(layer)
    specs = []

    def provider(module, spec, history):
        specs.append(spec)
        assert history is None  # current scaling
        return quantize(module.weight, spec)

    layer.weight_provider = provider
    x, g = torch.randn(8, 64), torch.randn(8, 32)
    assert all(torch.equal(a, b) for a, b in zip(_step(layer, x, g), _step(reference, x, g)))
    assert _same_buffers(_buffers(layer), _buffers(reference))  # the provided weight's statistics were recorded
    # asked for the forward cast; rowwise also for the backward's column-wise cast of W
    expected = lf.FP8Recipe(name=recipe).cast_specs()
    assert specs == ([expected.forward[1], expected.grad_input[1]] if recipe == "rowwise" else [expected.forward[1]])

    layer.weight_provider = lambda module, spec, history: None  # nothing to hand over: the layer casts
    assert torch.equal(_step(layer, x, g)[0], _step(reference, x, g)[0])

    doubled = copy.deepcopy(reference)
    doubled.weight_provider = lambda module, spec, history: quantize(module.weight.detach() * 2, spec)
    y = _step(doubled, x, g)[0]
    torch.testing.assert_close(y - reference.bias, 2 * (_step(reference, x, g)[0] - reference.bias), rtol=0.1, atol=0.1)


# --- the region is thread-local ----------------------------------------------------------------------------


def test_fp8_region_is_thread_local():
    import threading

    layer = FP8Linear(32, 16)
    x = torch.randn(4, 32)
    seen = {}

    def other_thread():
        seen["enabled"] = lf.is_fp8_autocast_enabled()
        seen["out"] = layer(x)

    with lf.fp8_autocast():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        fp8_out = layer(x)
    assert seen["enabled"] is False
    assert torch.equal(seen["out"], nn.functional.linear(x, layer.weight, layer.bias))  # high precision there
    assert not torch.equal(fp8_out, seen["out"])


def test_deepcopy_of_a_bound_model_gets_its_own_table():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    lf.convert_to_fp8(model, recipe="delayed")
    _step(model, torch.randn(4, 32))
    twin = copy.deepcopy(model)
    assert twin[0].fp8_state.table is twin[2].fp8_state.table is not model[0].fp8_state.table
    assert _same_buffers(_buffers(model), _buffers(twin))
    _step(twin, torch.randn(4, 32) * 3)
    assert not _same_buffers(_buffers(model), _buffers(twin))  # independent state


def test_moving_a_single_layer_of_a_shared_table_is_a_clear_error():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    lf.convert_to_fp8(model)
    model[0].to("meta")  # moves the shared table with it
    with pytest.raises(RuntimeError, match="move the whole model"):
        with lf.fp8_autocast():
            model[1](torch.randn(2, 32))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_a_layer_called_twice_before_the_backward(recipe, use_reentrant):
    """Weight sharing (a siamese encoder): both calls of the checkpointed block are recomputed in the backward. With
    `delayed` on a step whose history is empty, each call's scale comes from its own input; the recomputation of the
    first call used the second call's (11% error in the input gradient)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    lf.convert_to_fp8(plain, recipe=recipe)
    ckpt = copy.deepcopy(plain)
    for step in range(3):
        x1, x2 = torch.randn(8, 32), 10 * torch.randn(8, 32)
        results = []
        for model, use_ckpt in ((plain, False), (ckpt, True)):
            a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
            run = (lambda x: checkpoint(model, x, use_reentrant=use_reentrant)) if use_ckpt else model
            with lf.fp8_autocast(defer_amax_history_roll=True):
                y1, y2 = run(a), run(b)
            (y1.square().sum() + y2.square().sum()).backward()
            lf.roll_amax_history(model)
            results.append([a.grad, b.grad] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        assert all(torch.equal(u, v) for u, v in zip(*results)), step
        assert _same_buffers(_buffers(plain), _buffers(ckpt)), step


def test_double_backward_is_an_error_not_a_silent_zero():
    """A gradient penalty (WGAN-GP, R1) differentiates the gradient again. The FP8 GEMMs have no second derivative:
    their terms were silently dropped; now the second backward raises."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    lf.convert_to_fp8(model)
    x = torch.randn(8, 32, requires_grad=True)
    with lf.fp8_autocast():
        y = model(x)
    (grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.square().sum().backward()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_weight_provider_under_checkpointing_with_delayed(use_reentrant):
    """The recomputation asks the provider too, with the history state of the original forward."""
    from torch.utils.checkpoint import checkpoint

    from lightning_fp8.quantize import quantize

    def provider(module, spec, history):
        scale, ready = history
        return quantize(module.weight.detach() * 2, spec, history_scale=scale, history_ready=ready)

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32), nn.GELU())
    lf.convert_to_fp8(plain, recipe="delayed")
    plain[0].weight_provider = provider
    ckpt = copy.deepcopy(plain)
    ckpt[0].weight_provider = provider
    for step in range(3):
        x = torch.randn(8, 32) * (1 + step)
        grads = []
        for model, use_ckpt in ((plain, False), (ckpt, True)):
            xx = x.clone().requires_grad_()
            with lf.fp8_autocast():
                y = checkpoint(model, xx, use_reentrant=use_reentrant) if use_ckpt else model(xx)
            y.sum().backward()
            grads.append(xx.grad)
        assert torch.equal(*grads), step


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_an_evaluation_pass_before_the_backward_does_not_change_the_recomputation(use_reentrant):
    """A no-grad eval-mode forward of the same layers between a checkpointed forward and its backward (a monitoring
    pass) must not replace the decision the recomputation replays."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    lf.convert_to_fp8(plain, recipe="delayed")
    ckpt = copy.deepcopy(plain)
    for step in range(3):
        x = torch.randn(8, 32) * (1 + step)
        results = []
        for model, use_ckpt in ((plain, False), (ckpt, True)):
            xx = x.clone().requires_grad_()
            with lf.fp8_autocast(defer_amax_history_roll=True):
                y = checkpoint(model, xx, use_reentrant=use_reentrant) if use_ckpt else model(xx)
            model.eval()
            with torch.no_grad():  # outside the region: high precision
                model(torch.randn(8, 32))
            model.train()
            y.square().sum().backward()
            lf.roll_amax_history(model)
            results.append([xx.grad] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(*results)), step
        assert _same_buffers(_buffers(plain), _buffers(ckpt)), step
