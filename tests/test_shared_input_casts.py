"""Sibling layers sharing their input's FP8 cast: ``SHARE_INPUT_CASTS`` on vs off, bit for bit, where sharing could
go wrong (``delayed`` siblings in two state tables or with another history, an eval-mode sibling, parameter dtypes, a
Parameter read directly under a fused optimizer, evaluation forwards of one input between micro-batches)."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import lightning_fp8 as lf
from lightning_fp8 import linear as fp8_linear
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.state import bind_state_tables


def _run_siblings(share, monkeypatch, recipes, steps=4, scales=(8.0, 1.0, 1.0, 1.0), eval_k=False, dtype=None):
    monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
    torch.manual_seed(0)
    q, k = (lf.FP8Linear(64, 64, recipe=r) for r in recipes)
    bind_state_tables(nn.ModuleList([q, k]))  # one table per recipe, as convert_to_fp8 makes
    if eval_k:
        k.eval()
    if dtype is not None:
        k.to(dtype)
    opt = torch.optim.SGD([*q.parameters(), *k.parameters()], lr=0.01)
    outs = []
    for step in range(steps):
        x = torch.randn(16, 64, requires_grad=True) * scales[step]
        with lf.fp8_autocast():
            h = x * 1.0  # an activation (it has a grad_fn): what siblings share
            yq, yk = q(h), k(h)
        outs.append((yq.detach().clone(), yk.detach().clone()))
        opt.zero_grad()
        (yq.float().sum() + yk.float().sum()).backward()
        opt.step()
    return outs


def _assert_equal_runs(a, b):
    bad = []
    for step, ((qa, ka), (qb, kb)) in enumerate(zip(a, b)):
        if not torch.equal(qa, qb):
            bad.append((step, "q", (qa.float() - qb.float()).abs().max().item()))
        if not torch.equal(ka, kb):
            bad.append((step, "k", (ka.float() - kb.float()).abs().max().item()))
    assert not bad, bad


@pytest.mark.parametrize(
    "recipes",
    [
        # one table per recipe: the same CastSpec (the cache key) but another history rule
        (FP8Recipe("delayed", amax_history_len=16), FP8Recipe("delayed", amax_history_len=1)),
        (FP8Recipe("delayed"), FP8Recipe("delayed", amax_compute_algo="most_recent")),
        (FP8Recipe("delayed", amax_history_len=1), FP8Recipe("delayed", amax_history_len=16)),
    ],
    ids=["history_len_16_vs_1", "max_vs_most_recent", "history_len_1_vs_16"],
)
@pytest.mark.parametrize("scales", [(8.0, 1.0, 1.0, 1.0), (8.0, 1.0, 8.0, 1.0)], ids=["drop", "spike"])
def test_delayed_siblings_in_two_tables_with_the_same_cast_spec(recipes, scales, monkeypatch):
    """Both layers always read the same tensor (equal recorded amaxes), but their tables derive scales differently
    (one table per recipe; CastSpec, the cache key, has neither amax_history_len nor amax_compute_algo): the follower
    must not take the leader's cast. Taking it gave up to 63% relative error in k's output ("spike", the recipes
    reversed: most_recent / length 1 leading saturates the follower's input)."""
    shared = _run_siblings(True, monkeypatch, recipes, scales=scales)
    separate = _run_siblings(False, monkeypatch, recipes, scales=scales)
    _assert_equal_runs(shared, separate)


def test_delayed_follower_in_eval_mode(monkeypatch):
    """k frozen in eval mode (Lightning keeps submodule modes) reads the same tensor as the training q."""
    shared = _run_siblings(True, monkeypatch, ("delayed", "delayed"), eval_k=True)
    separate = _run_siblings(False, monkeypatch, ("delayed", "delayed"), eval_k=True)
    _assert_equal_runs(shared, separate)


def test_delayed_siblings_different_param_dtypes(monkeypatch):
    shared = _run_siblings(True, monkeypatch, ("delayed", "delayed"), dtype=torch.float64)
    separate = _run_siblings(False, monkeypatch, ("delayed", "delayed"), dtype=torch.float64)
    _assert_equal_runs(shared, separate)


@pytest.mark.parametrize("siblings", [1, 2])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_parameter_input_with_fused_optimizer(recipe, siblings, monkeypatch):
    """A learned tensor read directly by FP8Linear layers (Perceiver latents / learned queries), trained by a fused
    AdamW (which, on CPU in torch 2.13, does not bump the parameter's version counter), one fp8_autocast per step
    (which rolls on exit, like the plugins once per optimizer step)."""

    def run(share):
        monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
        torch.manual_seed(0)
        lat = nn.Parameter(torch.randn(16, 64))
        layers = [lf.FP8Linear(64, 64, recipe=recipe) for _ in range(siblings)]
        opt = torch.optim.AdamW([lat, *(p for m in layers for p in m.parameters())], lr=0.1, fused=True)
        outs = []
        for step in range(3):
            with lf.fp8_autocast():
                ys = [m(lat) for m in layers]
            outs.append((ys[0].detach().clone(), ys[-1].detach().clone()))
            opt.zero_grad()
            sum(y.square().sum() for y in ys).backward()
            opt.step()
        return outs

    _assert_equal_runs(run(True), run(False))


@pytest.mark.parametrize("eval_ctx", ["no_grad", "inference_mode", "train_no_grad"])
def test_delayed_accumulation_with_eval_forwards_on_the_same_input(eval_ctx, monkeypatch):
    """A Fabric-style loop: defer_amax_history_roll=True, 3 micro-batches per step that reuse one input tensor, an
    evaluation forward of the same tensor between micro-batches, a roll per optimizer step."""

    def run(share):
        monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
        torch.manual_seed(0)
        q, k, v = (lf.FP8Linear(64, 64, recipe="delayed") for _ in range(3))
        mods = nn.ModuleList([q, k, v])
        opt = torch.optim.SGD(mods.parameters(), lr=0.05)
        outs = []
        for step in range(4):
            x = torch.randn(16, 64) * (4.0 if step == 0 else 1.0)
            for micro in range(3):
                with lf.fp8_autocast(defer_amax_history_roll=True):
                    ys = [m(x) for m in (q, k, v)]
                    outs.append((ys[0].detach().clone(), ys[2].detach().clone()))
                    (sum(y.sum() for y in ys) / 3).backward()
                    if eval_ctx == "train_no_grad":
                        ctx = torch.no_grad()
                    else:
                        mods.eval()
                        ctx = torch.no_grad() if eval_ctx == "no_grad" else torch.inference_mode()
                    with ctx:
                        e = [m(x) for m in (k, q, v)]
                    mods.train()
                    outs.append((e[0].detach().clone(), e[2].detach().clone()))
            opt.step()
            opt.zero_grad()
            lf.roll_amax_history(mods)
        return outs

    _assert_equal_runs(run(True), run(False))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_siblings_cast_their_shared_input_once(recipe):
    """Compiled, three layers reading one input (q/k/v) cast it once: the graph traces each layer's cast, and the
    min-cut partitioner's (inductor's) common-subexpression elimination merges the identical ones. A NaN literal in
    the cast (the value of non-finite elements) defeated it (``nan != nan``, so no two casts compared equal): each
    sibling kept its own cast, and the partitioner, which may not recompute the later ones, saved their FP8 copies for
    backward (in a Llama block, one more FP8 copy of the block's input per sibling than torchao keeps)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    class QKV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(64, 64, bias=False) for _ in range(3))

        def forward(self, x):
            # every sibling's output is needed by the backward, as in attention (q, k, v) and SwiGLU (gate, up): torch
            # 2.14's partitioner no longer merges a value only the forward reads with one the backward needs, so an
            # output that only an addition reads (``q(x) + k(x) * v(x)``) would keep a forward cast of its own there
            return self.q(x) * self.k(x) * self.v(x)

    graphs = []

    def forward_compiler(gm, example_inputs):
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm, partition_fn=min_cut_rematerialization_partition)
    model = QKV()
    lf.convert_to_fp8(model, recipe=recipe, log_summary=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(32, 64, requires_grad=True)
    with lf.fp8_autocast(defer_amax_history_roll=True):
        out = compiled(x)
    out.sum().backward()
    # what the forward keeps for backward (its outputs after the model's): one FP8 copy of the shared input for the
    # three layers, as torchao keeps (rowwise: the copy cast along the tokens, for the weight gradients)
    forward_outputs = next(n for n in graphs[0].graph.nodes if n.op == "output").args[0]
    saved_input_copies = [n for n in forward_outputs if isinstance(n, torch.fx.Node)
                          and n.meta["val"].dtype == torch.float8_e4m3fn and n.meta["val"].numel() == x.numel()]
    assert len(saved_input_copies) == 1, [n.name for n in saved_input_copies]
    conversions = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
    casts = [n for n in graphs[0].graph.nodes if n.target in conversions
             and n.meta["val"].dtype == torch.float8_e4m3fn and tuple(n.meta["val"].shape) == (32, 64)]
    assert len(casts) == (1 if recipe == "tensorwise" else 2), [n.name for n in casts]  # rowwise: along each axis
