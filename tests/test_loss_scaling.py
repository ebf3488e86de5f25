"""The loss-scaling modes and the GradScaler adapter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Precision
from lightning_fp8.loss_scaling import LossScaler, resolve_loss_scaling


@pytest.mark.parametrize(
    ("mode", "dtype", "expected"),
    [
        ("auto", torch.bfloat16, "skip_nonfinite"),
        ("auto", torch.float16, "dynamic"),
        (True, torch.bfloat16, "dynamic"),
        (False, torch.float16, "off"),
        ("dynamic", torch.bfloat16, "dynamic"),
        ("skip_nonfinite", torch.float16, "skip_nonfinite"),
    ],
)
def test_modes_resolve(mode, dtype, expected):
    assert resolve_loss_scaling(mode, dtype) == expected
    assert FP8Precision(loss_scaling=mode, compute_dtype=dtype).loss_scaling == expected


def test_unknown_mode_names_the_valid_ones():
    with pytest.raises(ValueError, match="loss_scaling='always'.*'auto', 'dynamic', 'skip_nonfinite', 'off'"):
        FP8Precision(loss_scaling="always")


def _params():
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    return layer, torch.optim.SGD(layer.parameters(), lr=0.1)


def _backward(scaler, layer, poison=False):
    loss = layer(torch.randn(4, 8)).square().mean() * (float("nan") if poison else 1.0)
    scaled, ratio = scaler.scale(loss)
    scaled.backward()
    return ratio


def test_skip_nonfinite_keeps_true_gradients_and_skips_bad_steps():
    layer, opt = _params()
    scaler = LossScaler("skip_nonfinite")
    _backward(scaler, layer)
    grad = layer.weight.grad.clone()
    reference = layer.weight.detach() - 0.1 * grad
    scaler.step(opt)
    assert scaler.update() is None and float(scaler.scale_tensor) == 1.0
    torch.testing.assert_close(layer.weight.detach(), reference)  # the true gradient was applied
    opt.zero_grad()
    _backward(scaler, layer, poison=True)
    before = layer.weight.detach().clone()
    scaler.step(opt)
    assert torch.equal(layer.weight.detach(), before) and int(scaler.skipped_steps) == 1
    assert float(scaler.scale_tensor) == 1.0  # no back-off: nothing was scaled


def test_dynamic_scales_backs_off_and_reports_the_ratio():
    layer, opt = _params()
    scaler = LossScaler("dynamic", init_scale=2.0**10, growth_interval=1)
    assert _backward(scaler, layer) is None  # nothing pending yet
    assert float(scaler.scale_tensor) == 2.0**10
    scaler.step(opt)
    assert float(scaler.scale_tensor) == 2.0**10  # the update waits for the next backward
    opt.zero_grad()
    ratio = _backward(scaler, layer, poison=True)
    assert float(ratio) == 2.0 and float(scaler.scale_tensor) == 2.0**11
    scaler.step(opt)
    assert int(scaler.skipped_steps) == 1
    ratio = scaler.update()  # what the plugin does before a checkpoint
    assert float(ratio) == 0.5 and float(scaler.scale_tensor) == 2.0**10 and scaler.update() is None


def test_unscale_once_per_backward_and_never_without_one():
    layer, opt = _params()
    scaler = LossScaler("dynamic", init_scale=4.0)
    scaler.unscale(opt)  # no backward yet: nothing happens (GradScaler would record no inf check)
    _backward(scaler, layer)
    scaled = layer.weight.grad.clone()
    scaler.unscale(opt)
    scaler.unscale(opt)  # idempotent
    assert torch.equal(layer.weight.grad, scaled / 4)
    scaler.step(opt)
    scaler.unscale(opt)  # stepped: the gradients are consumed; a new backward is needed
    before = layer.weight.detach().clone()
    scaler.step(opt)  # a plain step, outside the scaler
    torch.testing.assert_close(layer.weight.detach(), before - 0.1 * layer.weight.grad)


@pytest.mark.parametrize("growth_interval", [1, 1000])
def test_second_optimizer_after_one_backward_is_unscaled_too(growth_interval):
    """Both optimizers step on the gradients of one backward: both must be unscaled with the scale that backward
    used, even when the scale grows after the first step (GradScaler.update runs once, at the next backward)."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = LossScaler("dynamic", init_scale=8.0, growth_interval=growth_interval)
    scaled, _ = scaler.scale(b(a(torch.randn(4, 8))).square().mean())
    scaled.backward()
    expected = [m.weight.detach() - 0.1 * m.weight.grad / 8 for m in (a, b)]
    scaler.step(opt_a)
    scaler.step(opt_b)
    for m, want in zip((a, b), expected):
        torch.testing.assert_close(m.weight.detach(), want)
    ratio = scaler.update()
    assert float(ratio) == (2.0 if growth_interval == 1 else 1.0)  # one update per backward, not per optimizer


def test_state_dict_round_trip_and_mode_change():
    layer, opt = _params()
    scaler = LossScaler("dynamic", init_scale=2.0**5, growth_interval=1)
    _backward(scaler, layer)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="update pending"):
        scaler.state_dict()
    scaler.update()
    state = scaler.state_dict()
    assert state["mode"] == "dynamic" and state["scaler"]["scale"] == 2.0**6
    fresh = LossScaler("dynamic")
    assert fresh.load_state_dict(state) == (None, None) and float(fresh.scale_tensor) == 2.0**6
    other = LossScaler("skip_nonfinite")
    warning, ratio = other.load_state_dict(state)
    assert "starts fresh" in warning and ratio == 2.0**-6 and float(other.scale_tensor) == 1.0
