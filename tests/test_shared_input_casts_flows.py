"""Flows where shared input casts could differ from ``SHARE_INPUT_CASTS = False``: a compiled record, a reload and
eager use of the same layers (the lineage tokens), a buffer changed through ``.data`` between forwards, accumulation
with a sibling skipped and evaluation forwards in between."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8 as lf
from lightning_fp8 import linear as fp8_linear
from lightning_fp8.recipe import INPUT


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(64, 64)
        self.k = nn.Linear(64, 64)

    def forward(self, a, b):
        return self.q(a), self.k(b)


def _pair(recipe="delayed"):
    torch.manual_seed(0)
    m = Pair()
    lf.convert_to_fp8(m, recipe=recipe)
    return m


def _diff(a, b):
    pairs = enumerate(zip(a, b))
    return [(i, (x.float() - y.float()).abs().max().item()) for i, (x, y) in pairs if not torch.equal(x, y)]


# ---------------------------------------------------------------- compile, reload, compiled again, then eager
def _compile_reload_then_eager(share, monkeypatch):
    monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
    torch._dynamo.reset()
    m = _pair()
    sd0 = lf.fp8_state_dict(m)  # q and k rows equal
    c = torch.compile(m, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    outs = []
    flags = []
    for step in range(2):
        with lf.fp8_autocast():  # compiled: q and k read different tensors (their histories diverge)
            c(torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g) * 50)
        flags.append(m.q.fp8_state.table.lineage_untrusted)
        if step == 0:
            lf.load_fp8_state_dict(m, sd0)  # rows equal again: tokens derived and trusted
            flags.append(m.q.fp8_state.table.lineage_untrusted)
    # eager: q and k read one tensor (an activation: leaves are never shared)
    for _ in range(2):
        h = torch.randn(8, 64, generator=g).requires_grad_() * 1
        with lf.fp8_autocast():
            yq, yk = m(h, h)
        outs += [yq.detach(), yk.detach()]
    return outs, flags, m.q.fp8_state.table.scale[:, INPUT].clone()


def test_compiled_record_after_reload_untrusts_tokens(monkeypatch):
    on, flags_on, s_on = _compile_reload_then_eager(True, monkeypatch)
    off, _, s_off = _compile_reload_then_eager(False, monkeypatch)
    assert not _diff(on, off), (_diff(on, off), flags_on, s_on, s_off)


# ---------------------------------------------------------------- compiled steps (the plugins' deferred roll), then eager
class CheckpointedPair(Pair):
    def forward(self, a, b):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, a, b, use_reentrant=False)


def _compiled_then_eager(share, monkeypatch, pair):
    """Compiled training steps record different input amaxes into q's and k's rows (equal tokens before), then eager
    steps where q and k read one activation: k may follow q's cast only if their rows are still equal, which the
    compiled records (graph operations, not this package's host code) must have made the tokens stop claiming."""
    monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = pair()
    lf.convert_to_fp8(m, recipe="delayed")
    c = torch.compile(m, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    outs = []
    for _ in range(2):
        a = torch.randn(8, 64, generator=g).requires_grad_()
        b = (torch.randn(8, 64, generator=g) * 50).requires_grad_()
        with lf.fp8_autocast(defer_amax_history_roll=True):
            yq, yk = c(a, b)
        (yq.float().sum() + yk.float().sum()).backward()
        lf.roll_amax_history(m)
    for _ in range(2):
        h = torch.randn(8, 64, generator=g).requires_grad_() * 1
        with lf.fp8_autocast(defer_amax_history_roll=True):
            yq, yk = m(h, h)
        outs += [yq.detach(), yk.detach()]
        lf.roll_amax_history(m)
    return outs + [m.q.fp8_state.table.scale.clone()]


@pytest.mark.parametrize("pair", [Pair, CheckpointedPair], ids=["plain", "checkpointed"])
def test_compiled_records_then_eager_shared_input(pair, monkeypatch):
    on, off = _compiled_then_eager(True, monkeypatch, pair), _compiled_then_eager(False, monkeypatch, pair)
    assert not _diff(on, off), _diff(on, off)


# ---------------------------------------------------------------- buffer read directly, changed through .data
class BufPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(64, 64)
        self.k = nn.Linear(64, 64)
        self.register_buffer("mem", torch.randn(8, 64))

    def forward(self):
        return self.q(self.mem), self.k(self.mem)


def _buffer_data_update(share, monkeypatch, recipe):
    monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
    torch.manual_seed(0)
    m = BufPair()
    lf.convert_to_fp8(m, recipe=recipe)
    outs = []
    for step in range(3):
        with lf.fp8_autocast(defer_amax_history_roll=True):
            yq, yk = m()
        outs += [yq.detach(), yk.detach()]
        m.mem.data.mul_(3.0)  # as weight-averaging swaps do: no version bump
        with lf.fp8_autocast(defer_amax_history_roll=True):  # same step (no roll)
            yq, yk = m()
        outs += [yq.detach(), yk.detach()]
        lf.roll_amax_history(m)
    return outs


def test_buffer_changed_through_data_tensorwise(monkeypatch):
    on = _buffer_data_update(True, monkeypatch, "tensorwise")
    off = _buffer_data_update(False, monkeypatch, "tensorwise")
    assert not _diff(on, off), _diff(on, off)


def test_buffer_changed_through_data_delayed(monkeypatch):
    on, off = _buffer_data_update(True, monkeypatch, "delayed"), _buffer_data_update(False, monkeypatch, "delayed")
    assert not _diff(on, off), _diff(on, off)


# ---------------------------------------------------------------- grad accumulation, sibling skipped, eval between
def _accum(share, monkeypatch):
    monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(q=nn.Linear(64, 64), k=nn.Linear(64, 64), v=nn.Linear(64, 64)))
    lf.convert_to_fp8(m, recipe="delayed")
    g = torch.Generator().manual_seed(2)
    outs = []
    for step in range(5):
        for micro in range(3):
            x = torch.randn(8, 64, generator=g).requires_grad_() * (1 + 7 * (step % 2))
            with lf.fp8_autocast(defer_amax_history_roll=True):
                h = x * 1.0  # an activation (it has a grad_fn): what siblings share
                names = ("q", "k", "v") if micro != 1 else ("v", "q")  # k skipped, order changed
                ys = [m[n](h) for n in names]
                if micro == 2:
                    ys.append(m["q"](h))  # q twice on one tensor
                    ys.append(m["k"](h))
            sum(y.float().sum() for y in ys).backward()
            outs += [y.detach() for y in ys]
            with torch.no_grad(), lf.fp8_autocast(defer_amax_history_roll=True):  # eval forward between
                m.eval()
                outs += [m["k"](h), m["q"](h)]
                m.train()
        lf.roll_amax_history(m)
    t = m["q"].fp8_state.table
    outs += [t.amax_history.clone(), t.scale.clone(), t.counts.float()]
    outs += [p.grad.clone() for p in m.parameters()]
    return outs


def test_accumulation_skip_eval_between(monkeypatch):
    on, off = _accum(True, monkeypatch), _accum(False, monkeypatch)
    assert not _diff(on, off), _diff(on, off)


def _buffer_data_update_eval(share, monkeypatch, recipe):
    """Evaluation forwards (no recording, not inference mode) of a buffer changed through ``.data`` in between."""
    monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
    torch.manual_seed(0)
    m = BufPair()
    lf.convert_to_fp8(m, recipe=recipe)
    with lf.fp8_autocast():  # one training forward: the delayed histories start
        m()
    m.eval()
    outs = []
    with torch.no_grad():
        for _ in range(2):
            with lf.fp8_autocast():
                outs += [y.detach() for y in m()]
            m.mem.data.mul_(3.0)
    return outs


def test_buffer_changed_through_data_eval_delayed(monkeypatch):
    on = _buffer_data_update_eval(True, monkeypatch, "delayed")
    off = _buffer_data_update_eval(False, monkeypatch, "delayed")
    assert not _diff(on, off), _diff(on, off)


# ---------------------------------------------------------------- what keeps and what ends the tokens' trust
def test_lineage_trust_follows_the_pending_amax_version():
    """The tokens stay trusted through eager records (the layers follow them), copies, pickles and moves; a record
    they did not follow (any in-place write of the input role's pending amax: a compiled graph's) ends their trust
    for good, and so does a copy of an untrusted table; writing rows derives them again."""
    import copy
    import io

    m = _pair()
    table = m.q.fp8_state.table
    saved = lf.fp8_state_dict(m)
    h = torch.randn(8, 64).requires_grad_() * 1
    with lf.fp8_autocast(defer_amax_history_roll=True):
        m(h, h)
    lf.roll_amax_history(m)
    assert table.lineage() is not None
    buffer = io.BytesIO()
    torch.save(m, buffer)  # pickles the table (pickle.dumps cannot: torch pickles no float8 tensor, cached casts)
    buffer.seek(0)
    for twin in (copy.deepcopy(m), torch.load(buffer, weights_only=False), copy.deepcopy(m).to("meta")):
        assert twin.q.fp8_state.table.lineage() == table.lineage()
    with torch.no_grad():
        table.role_amax_pending[INPUT][0] += 1.0  # as a compiled graph's write-back does: the version moves
    assert table.lineage() is None and table.lineage_untrusted
    assert copy.deepcopy(m).q.fp8_state.table.lineage() is None
    lf.load_fp8_state_dict(m, saved)
    assert table.lineage() is not None


def test_history_scale_follows_the_scales_of_rolls_and_loads():
    """The history-scaled casts read ``history_scale``: the scales as the last roll or load left them (a cast's own
    write of ``scale`` does not move it), also in a table pickled before it existed."""
    from lightning_fp8.state import FP8StateTable

    m = _pair()
    table = m.q.fp8_state.table
    for step in range(3):
        x = torch.randn(8, 64).requires_grad_() * (1 + step)
        with lf.fp8_autocast(defer_amax_history_roll=True):
            yq, yk = m(x * 1, x * 3)
        (yq.float().sum() + yk.float().sum()).backward()
        assert torch.equal(table.history_scale[table.initialized], table.scale[table.initialized])
        before = table.history_scale.clone()
        lf.roll_amax_history(m)
        assert table.initialized.all() and not torch.equal(table.history_scale, before)
        assert torch.equal(table.history_scale, table.scale)
    fresh = _pair()
    lf.load_fp8_state_dict(fresh, lf.fp8_state_dict(m))
    assert torch.equal(fresh.q.fp8_state.table.history_scale, table.scale)
    state = table.__getstate__()
    for name in ("history_scale", "forward_scale", "forward_ready"):
        del state[name]
    old = FP8StateTable.__new__(FP8StateTable)
    old.__setstate__(state)
    assert torch.equal(old.history_scale, table.scale)
    assert torch.equal(old.forward_scale, table.scale[:, :2]) and torch.equal(old.forward_ready, table.initialized[:, :2])


def test_tables_made_under_inference_mode():
    """Inference tensors have no version counter: a ``delayed`` model built, converted, copied, moved or loaded under
    ``torch.inference_mode()`` works (its tokens are never trusted: nothing to share there)."""
    import copy
    import io

    trained = _pair()
    buffer = io.BytesIO()
    torch.save(trained, buffer)
    with torch.inference_mode():
        layer = lf.FP8Linear(64, 64, recipe="delayed")
        m = _pair()
        twin = copy.deepcopy(m).to("meta")
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert m.q.fp8_state.table.lineage() is None
        x = torch.randn(8, 64)
        for model in (m, loaded):
            model.eval()
            with lf.fp8_autocast():
                yq, yk = model(x, x)
            assert torch.isfinite(yq).all() and torch.isfinite(yk).all()
        with lf.fp8_autocast():
            assert torch.isfinite(layer(x)).all()
    assert twin.q.weight.device.type == "meta"
