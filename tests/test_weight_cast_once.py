"""Each weight is cast to FP8 once per optimizer step (issue 11): counted through a real Trainer with gradient
accumulation, activation checkpointing and validation in between, and bit-identical to casting at every use."""

from __future__ import annotations

import contextlib
import pickle

import pytest
import torch
from models import TinyDecoder, loader
from utils import make_trainer

import lightning_fp8 as lf
from lightning_fp8 import linear as fp8_linear
from lightning_fp8.recipe import INPUT, RECIPES, WEIGHT
from lightning_fp8.state import bind_state_tables

_QUANTIZE = fp8_linear.quantize


def _count_weight_casts(monkeypatch) -> list[tuple[object, bool]]:
    """Record every weight cast the FP8 layers make: (its cast spec, with statistics or not)."""
    calls: list[tuple[object, bool]] = []
    real = _QUANTIZE

    def counting(x, spec, *, statistics=True, **kwargs):
        if spec.role == WEIGHT:
            calls.append((spec, statistics))
        return real(x, spec, statistics=statistics, **kwargs)

    monkeypatch.setattr(fp8_linear, "quantize", counting)
    return calls


def _train(recipe: str, cache: bool, monkeypatch, steps: int = 3, accumulate: int = 4, compute_dtype=torch.bfloat16, **model_kwargs):
    monkeypatch.setattr(fp8_linear, "CACHE_WEIGHT_CASTS", cache)
    calls = _count_weight_casts(monkeypatch)
    torch.manual_seed(0)
    model = TinyDecoder(layers=1, **model_kwargs)
    trainer = make_trainer(
        lf.FP8Precision(recipe=recipe, compute_dtype=compute_dtype), max_steps=steps, accumulate_grad_batches=accumulate, limit_val_batches=2,
        val_check_interval=4, num_sanity_val_steps=1,
    )  # fmt: skip
    trainer.fit(model, loader(n=20_000), loader(n=4_000))
    return model, calls


@pytest.mark.parametrize(
    ("recipe", "compute_dtype"), [(r, torch.bfloat16) for r in RECIPES] + [("delayed", torch.float16), ("tensorwise", torch.float16)]
)
def test_each_weight_is_cast_once_per_optimizer_step_and_bit_identical(recipe, compute_dtype, monkeypatch):
    """float16: dynamic loss scaling adjusts the grad_output amaxes at every backward; the weights' casts stay valid."""
    cached, cached_calls = _train(recipe, True, monkeypatch, compute_dtype=compute_dtype)
    every, every_calls = _train(recipe, False, monkeypatch, compute_dtype=compute_dtype)
    layers = len(list(lf.state.fp8_layers(cached)))
    specs = cached.lm_head.fp8_state.table.specs
    per_use = 1 + (not specs.weight_reused)  # the forward's cast, and the backward's own when it casts differently
    recorded = lambda calls: sum(1 for _, statistics in calls if statistics)  # noqa: E731
    # the training forwards' casts (with statistics): one per layer and micro-batch, or one per optimizer step
    assert recorded(every_calls) == layers * 3 * 4
    assert recorded(cached_calls) == layers * 3
    # the backward's own casts (recipes whose grad_input GEMM casts the weight differently): likewise
    if per_use == 2:
        backward = lambda calls: sum(1 for spec, _ in calls if spec == specs.grad_input[1])  # noqa: E731
        assert backward(every_calls) == layers * 3 * 4 and backward(cached_calls) == layers * 3
    # the weights, and every FP8 scale and amax, bit for bit
    for (name, a), (_, b) in zip(cached.state_dict().items(), every.state_dict().items()):
        assert torch.equal(a, b), name
    s_cached, s_every = lf.fp8_state_dict(cached), lf.fp8_state_dict(every)
    for t_cached, t_every in zip(s_cached["tables"], s_every["tables"]):
        for field in ("scale", "amax_history", "initialized"):
            assert torch.equal(t_cached[field], t_every[field]), field
        # the weight's statistics are recorded once per step, with the same fractions
        c, e = t_cached["counts"][:, WEIGHT], t_every["counts"][:, WEIGHT]
        assert torch.equal(c * 4, e)


@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
def test_activation_checkpointing_recomputation_reuses_the_cast(recipe, monkeypatch):
    cached, cached_calls = _train(recipe, True, monkeypatch, steps=2, activation_checkpointing=True)
    every, every_calls = _train(recipe, False, monkeypatch, steps=2, activation_checkpointing=True)
    assert len(cached_calls) < len(every_calls)
    for (name, a), (_, b) in zip(cached.state_dict().items(), every.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_weight_changed_in_place_is_cast_again():
    layer = lf.FP8Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    with lf.fp8_autocast(), torch.no_grad():
        layer.train()
        first = layer(x)
        with torch.no_grad():
            layer.weight.mul_(2)  # bumps the version counter: the kept cast is stale
        second = layer(x)
    assert torch.allclose(second, 2 * first, rtol=0.1)
    reference = lf.FP8Linear(64, 32, bias=False)
    reference.load_state_dict(layer.state_dict())
    with lf.fp8_autocast(), torch.no_grad():
        assert torch.equal(reference(x), second)


# --- review findings: a kept weight cast must never outlive the weight or the scale it was made for -----------------


def _standalone_losses(cache: bool, monkeypatch, recipe: str, eval_mode: bool) -> list[float]:
    monkeypatch.setattr(fp8_linear, "CACHE_WEIGHT_CASTS", cache)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    lf.convert_to_fp8(model, recipe=recipe)
    model.train(not eval_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-1, fused=True)  # updates without bumping versions
    x, y = torch.randn(32, 64), torch.randn(32, 16)
    losses = []
    with lf.fp8_autocast():
        for _ in range(4):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("eval_mode", [False, True])
def test_standalone_region_with_a_fused_optimizer_sees_every_update(recipe, eval_mode, monkeypatch):
    """A fused optimizer changes weights without bumping their version counters; a standalone region rolls only on
    exit: its layers must cast the weight at every use."""
    assert _standalone_losses(True, monkeypatch, recipe, eval_mode) == _standalone_losses(False, monkeypatch, recipe, eval_mode)


def test_delayed_recomputation_after_a_roll_keeps_no_stale_cast(monkeypatch):
    from torch.utils.checkpoint import checkpoint

    def run(cache):
        monkeypatch.setattr(fp8_linear, "CACHE_WEIGHT_CASTS", cache)
        torch.manual_seed(0)
        layer = lf.FP8Linear(64, 64, bias=False, recipe="delayed")
        x = torch.randn(16, 64)
        region = lambda: lf.fp8_autocast(defer_amax_history_roll=True)  # noqa: E731  (as under the plugin)
        with region():
            checkpoint(layer, x.requires_grad_(), use_reentrant=False).sum().backward()
        lf.roll_amax_history(layer)
        with torch.no_grad():
            layer.weight.mul_(4)  # the weight grows: the history's scale now saturates it
        with region():
            y = checkpoint(layer, x, use_reentrant=False)
        lf.roll_amax_history(layer)  # the step ends before the backward recomputes (its scale: the forward's)
        y.sum().backward()
        layer.eval()
        with region(), torch.no_grad():
            return layer(x)

    assert torch.equal(run(True), run(False))


def _weight_averaging():
    """Lightning's ``WeightAveraging`` callback, which Lightning has from 2.6 (the suite also runs on 2.5.1, the floor:
    ``.ci/run``); before 2.6 there is nothing of it to test."""
    from lightning.pytorch import callbacks

    if not hasattr(callbacks, "WeightAveraging"):
        pytest.skip("Lightning < 2.6 has no WeightAveraging callback")
    return callbacks.WeightAveraging


def test_weights_swapped_through_data_around_evaluation_are_seen(monkeypatch, tmp_path):
    """Lightning's WeightAveraging (EMA) swaps the averaged weights in with ``param.data.copy_`` (no version bump);
    a validation inside an accumulation window must run on the averaged weights."""
    WeightAveraging = _weight_averaging()
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    class Model(TinyDecoder):
        def validation_step(self, batch, batch_idx):
            self.val_losses.append(self.loss(batch).item())

    def run(cache):
        monkeypatch.setattr(fp8_linear, "CACHE_WEIGHT_CASTS", cache)
        torch.manual_seed(0)
        model = Model(layers=1, dim=32)
        model.val_losses = []
        ema = WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.5))
        trainer = make_trainer(
            lf.FP8Precision(), callbacks=[ema], max_steps=4, accumulate_grad_batches=4, val_check_interval=10,
            limit_val_batches=1, num_sanity_val_steps=0, default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(model, loader(n=6_000), loader(n=2_000))
        return model.val_losses

    cached = run(True)
    assert cached and cached == run(False)


@pytest.mark.parametrize(("recipe", "grad_in_validation"), [("tensorwise", False), ("delayed", False), ("tensorwise", True)])
def test_weights_swapped_around_evaluation_are_seen_by_a_layer_kept_in_eval_mode(recipe, grad_in_validation, monkeypatch):
    """A trained block kept in ``eval()`` (dropout off) never switches mode, and Lightning restores modes after
    validation by assigning ``module.training`` (no ``train()`` call): nothing dropped the kept casts. With
    WeightAveraging (EMA, swapped in and out through ``.data``), validation reused the training weights' cast, and
    the training step after it the averaged weights' (a cast kept by the validation forward, under ``no_grad``):
    losses and weights off by up to about a thousandth, no error. Training, validation and the weights must equal
    casting at every use, bit for bit; also with a validation step that computes with gradients
    (``inference_mode=False`` and ``torch.enable_grad()``: a metric that needs input gradients), whose forwards may
    keep casts (the plugin makes them stale when the steps change between validation and training)."""
    WeightAveraging = _weight_averaging()
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    class Model(TinyDecoder):
        def on_train_batch_start(self, batch, batch_idx):
            self.blocks.eval()  # trained, without dropout

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.train_losses.append(loss.detach().clone())
            return loss

        def validation_step(self, batch, batch_idx):
            with torch.enable_grad() if grad_in_validation else contextlib.nullcontext():
                self.val_losses.append(self.loss(batch).detach().clone())

    def run(cache):
        monkeypatch.setattr(fp8_linear, "CACHE_WEIGHT_CASTS", cache)
        torch.manual_seed(0)
        model = Model(layers=1, dim=32)
        model.train_losses, model.val_losses = [], []
        ema = WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.5))
        trainer = make_trainer(
            lf.FP8Precision(recipe=recipe), callbacks=[ema], max_steps=4, val_check_interval=2, limit_val_batches=1,
            num_sanity_val_steps=0, inference_mode=not grad_in_validation,
        )  # fmt: skip
        trainer.fit(model, loader(n=4_000), loader(n=2_000))
        return model

    cached, every_use = run(True), run(False)
    assert len(cached.train_losses) == 4 and len(cached.val_losses) == 2
    assert all(torch.equal(a, b) for a, b in zip(cached.train_losses, every_use.train_losses))
    assert all(torch.equal(a, b) for a, b in zip(cached.val_losses, every_use.val_losses))
    for (name, a), b in zip(cached.state_dict().items(), every_use.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_new_weight_tensor_where_the_kept_casts_weight_was_is_cast_again():
    """A kept cast belongs to one weight tensor object: a new tensor at the same address with the same version
    counter (the allocator reuses a freed weight's memory; here, deterministically, fresh tensors over one buffer)
    is cast again. ``torch.func.functional_call`` over candidate weights (perturbations, checkpoints) gave each
    candidate the first one's cast: outputs off by up to half their size, no error."""
    from torch.func import functional_call

    torch.manual_seed(0)
    layer = lf.FP8Linear(64, 64, bias=False)
    layer.eval()
    x = torch.randn(8, 64)
    buffer = torch.empty_like(layer.weight)
    outs, expected = [], []
    for i in range(3):
        buffer.data.copy_(layer.weight.detach() * (1 + i))  # no version bump on buffer
        candidate = buffer.detach()  # a new tensor object: same storage, same version counter value
        with lf.fp8_autocast(defer_amax_history_roll=True):  # what the precision plugins' forward_context enters
            outs.append(functional_call(layer, {"weight": candidate}, (x,)))
        with lf.fp8_autocast():  # a standalone region keeps nothing
            expected.append(functional_call(layer, {"weight": candidate.clone()}, (x,)))
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))


def test_an_optimizer_step_the_plugin_does_not_see_is_seen(monkeypatch):
    """An optimizer that does not go through the plugin (Fabric: not passed to ``setup``; the Trainer's
    ``self.optimizers(use_pl_optimizer=False)``) still changes the weights: the kept casts must not outlive its step.
    A fused optimizer does not bump the weights' version counters, so the first step's casts were reused for the
    whole run: the weights trained, the FP8 layers never saw it (loss 1.09 after five steps instead of 0.49)."""
    from lightning.fabric import Fabric

    from lightning_fp8.fabric import FP8Precision

    def run(cache):
        monkeypatch.setattr(fp8_linear, "CACHE_WEIGHT_CASTS", cache)
        torch.manual_seed(0)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[FP8Precision()])
        model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # not set up through Fabric
        x, y = torch.randn(32, 64), torch.randn(32, 16)
        losses = []
        for _ in range(4):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return losses

    cached, every_use = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(cached, every_use)), (cached, every_use)


def test_a_teachers_no_grad_forward_on_weights_swapped_through_data_is_cast_afresh():
    """A teacher's forward inside a training step: the teacher's (EMA) weights copied in through ``.data`` (no version
    bump), a forward under ``no_grad`` with the layers still in training mode, the student's weights copied back. The
    teacher's forward must not reuse the student's kept cast, nor leave its own for the student's next forward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(lf.FP8Linear(64, 64), torch.nn.GELU(), lf.FP8Linear(64, 64))
    teacher = [p.detach() * 1.5 for p in model.parameters()]
    x = torch.randn(16, 64)

    def swap(weights):
        saved = [p.detach().clone() for p in model.parameters()]
        for p, w in zip(model.parameters(), weights):
            p.data.copy_(w)
        return saved

    with lf.fp8_autocast(defer_amax_history_roll=True):
        model(x).sum().backward()  # the student's casts are kept
        student = swap(teacher)
        with torch.no_grad():
            taught = model(x)
        swap(student)
        after = model(x)
    fresh = torch.nn.Sequential(lf.FP8Linear(64, 64), torch.nn.GELU(), lf.FP8Linear(64, 64))
    with torch.no_grad(), lf.fp8_autocast():  # a standalone region keeps nothing
        for p, w in zip(fresh.parameters(), teacher):
            p.copy_(w)
        assert torch.equal(taught, fresh(x))
        for p, w in zip(fresh.parameters(), student):
            p.copy_(w)
        assert torch.equal(after, fresh(x))


def test_a_weight_computed_in_the_forward_is_not_kept_alive():
    """The kept cast refers to its weight weakly: a weight computed in the forward (a ``functional_call`` candidate,
    a parametrization) is freed when the forward no longer needs it, as without the kept casts (``tensorwise`` saves
    only its FP8 copy for backward)."""
    import gc
    import weakref

    from torch.func import functional_call

    layer = lf.FP8Linear(64, 64, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    candidate = layer.weight * 2  # computed from the parameter (a leaf would be held by its gradient accumulator)
    ref = weakref.ref(candidate)
    with lf.fp8_autocast(defer_amax_history_roll=True):
        out = functional_call(layer, {"weight": candidate}, (x,))
    del candidate
    gc.collect()
    assert ref() is None  # the output's graph holds the FP8 copy, not the high-precision weight
    out.sum().backward()


def test_a_layer_with_kept_casts_pickles():
    """The kept casts are transient (and hold a weak reference to their weight, which does not pickle): a model saved
    whole in the middle of an optimizer step (``torch.save(model)`` from a callback) pickles without them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(lf.FP8Linear(32, 32), torch.nn.GELU(), lf.FP8Linear(32, 32))
    x = torch.randn(8, 32)
    with lf.fp8_autocast(defer_amax_history_roll=True):
        model(x).sum().backward()
    assert model[0]._fp8_weight_casts  # kept for the next micro-batch
    restored = pickle.loads(pickle.dumps(model))
    assert not restored[0].__dict__.get("_fp8_weight_casts")
    with lf.fp8_autocast(defer_amax_history_roll=True):
        assert torch.equal(restored(x), model(x))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_weight_casts_under_activation_checkpointing(recipe, reentrant, monkeypatch):
    """Under non-reentrant activation checkpointing each weight is still cast once per optimizer step, forward and
    backward: the backward's saved weight is another tensor object over the same storage (checkpoint's saved-tensor
    hooks hand back a detached alias), matched through the weight its forward read. A reentrant checkpoint's first
    forward runs under ``no_grad``, which keeps and reuses nothing (a teacher's forward under ``no_grad`` reads
    weights swapped in through ``.data``): it casts at every micro-batch, and records the weight's statistics once
    per step all the same. The results equal casting at every use either way."""
    from torch.utils.checkpoint import checkpoint

    def run(cache):
        monkeypatch.setattr(fp8_linear, "CACHE_WEIGHT_CASTS", cache)
        calls = _count_weight_casts(monkeypatch)
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(2))
        lf.convert_to_fp8(blocks, recipe=recipe, log_summary=False)
        optimizer = torch.optim.SGD(blocks.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            for micro in range(4):
                x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + micro), requires_grad=True)
                with lf.fp8_autocast(defer_amax_history_roll=True):
                    for block in blocks:
                        x = checkpoint(block, x, use_reentrant=reentrant)
                x.pow(2).mean().backward()
                losses.append(x.detach())
            optimizer.step()
            optimizer.zero_grad()
            lf.roll_amax_history(blocks)
        return losses, calls, blocks

    cached, calls, blocks = run(True)
    every_use, _, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(cached, every_use))
    specs = blocks[0][0].fp8_state.table.specs
    recorded = sum(1 for _, statistics in calls if statistics)
    assert recorded == 2 * 2, calls  # the statistics once per layer and optimizer step, reentrant too
    forward = sum(1 for spec, _ in calls if spec == specs.forward[1])
    assert forward >= 2 * 2 * 4 if reentrant else forward == 2 * 2, calls  # reentrant: at every micro-batch
    if not specs.weight_reused and not reentrant:  # rowwise: the backward casts the weight along its other axis
        assert sum(1 for spec, _ in calls if spec == specs.grad_input[1]) == 2 * 2


def test_a_dtype_round_trip_drops_the_kept_cast():
    torch.manual_seed(0)
    layer = lf.FP8Linear(64, 64, bias=False)
    x = torch.randn(8, 64)
    with lf.fp8_autocast(defer_amax_history_roll=True), torch.no_grad():
        layer.eval()
        layer(x)
        layer.bfloat16()
        layer.float()  # the weights are rounded to bf16 (storage and version may be the same)
        after = layer(x)
    fresh = lf.FP8Linear(64, 64, bias=False)
    fresh.load_state_dict(layer.state_dict())
    fresh.eval()
    with lf.fp8_autocast(), torch.no_grad():
        assert torch.equal(after, fresh(x))


# ------------------------------------------------------------------ sibling layers share their input's cast


def _siblings(recipe: str, share: bool, monkeypatch, mutate_between: bool = False, steps: int = 1):
    """q, k and v reading one input tensor, for ``steps`` training steps (SGD in between; each ``fp8_autocast`` rolls
    the histories on exit, so ``delayed`` casts with history scales from the second step on); returns the last step's
    (outputs, grads, unique saved bytes, input casts made, histories) and every step's outputs and gradients."""
    monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
    casts = []
    real = _QUANTIZE

    def counting(x, spec, *, statistics=True, **kwargs):
        if spec.role == INPUT:
            casts.append(spec)
        return real(x, spec, statistics=statistics, **kwargs)

    monkeypatch.setattr(fp8_linear, "quantize", counting)
    torch.manual_seed(0)
    q, k, v = (lf.FP8Linear(128, 128, recipe=recipe) for _ in range(3))
    bind_state_tables(torch.nn.ModuleList([q, k, v]))  # one state table, as convert_to_fp8 makes for a model
    optimizer = torch.optim.SGD([p for m in (q, k, v) for p in m.parameters()], lr=0.5)
    every_step = []
    for step in range(steps):
        x = torch.randn(4, 32, 128, requires_grad=True) * (1.0 + step)  # a range that changes: scales move
        x.retain_grad()
        saved: dict[int, int] = {}
        casts.clear()

        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16), lf.fp8_autocast():
                h = x * 2.0  # one activation tensor read by the three layers
                out_q = q(h)
                if mutate_between:
                    with torch.no_grad():
                        h[0, 0] += 1000.0  # in place: the next layers must not reuse the earlier cast
                y = out_q + k(h) + v(h)
        optimizer.zero_grad()
        y.float().sum().backward()
        grads = [t.grad.clone() for t in (x, q.weight, k.weight, v.weight)]
        every_step.append((y.detach(), grads))
        optimizer.step()
    histories = [m.fp8_amax_history[0].clone() for m in (q, k, v)]
    return y.detach(), grads, sum(saved.values()), list(casts), histories, every_step


@pytest.mark.parametrize("recipe", RECIPES)
def test_layers_reading_one_input_share_its_fp8_cast(recipe, monkeypatch):
    shared = _siblings(recipe, True, monkeypatch)
    separate = _siblings(recipe, False, monkeypatch)
    assert torch.equal(shared[0], separate[0])
    assert all(torch.equal(a, b) for a, b in zip(shared[1], separate[1]))
    assert all(torch.equal(a, b) for a, b in zip(shared[4], separate[4]))  # each layer recorded its input's amax
    # one cast of the input instead of three (two for the recipes that also cast it for grad_weight), and the three
    # layers save one FP8 copy of it (and its scales): two copies of 4 x 32 x 128 one-byte elements fewer
    assert len(separate[3]) == 3 * len(shared[3])
    assert 2 * 4 * 32 * 128 <= separate[2] - shared[2] <= 2 * 4 * 32 * 128 * 1.3


def test_delayed_siblings_share_the_cast_with_history_scales_bit_for_bit(monkeypatch):
    """``delayed`` scales each layer's input from its own amax history; siblings that always read the same tensor
    record the same amaxes, so their histories and scales are equal and sharing the first one's cast changes no bit,
    also once the scales come from the histories (steps 2 and 3), while casting and saving one copy instead of three."""
    shared = _siblings("delayed", True, monkeypatch, steps=3)
    separate = _siblings("delayed", False, monkeypatch, steps=3)
    for (y_shared, g_shared), (y_separate, g_separate) in zip(shared[5], separate[5]):
        assert torch.equal(y_shared, y_separate)
        assert all(torch.equal(a, b) for a, b in zip(g_shared, g_separate))
    assert all(torch.equal(a, b) for a, b in zip(shared[4], separate[4]))
    assert bool((shared[4][0] > 0).sum() == 3)  # three amaxes in the history: the last step used a history scale
    assert len(separate[3]) == 3 * len(shared[3]) == 3
    assert 2 * 4 * 32 * 128 <= separate[2] - shared[2] <= 2 * 4 * 32 * 128 * 1.3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_an_input_changed_in_place_between_siblings_is_cast_again(recipe, monkeypatch):
    shared = _siblings(recipe, True, monkeypatch, mutate_between=True)
    separate = _siblings(recipe, False, monkeypatch, mutate_between=True)
    assert torch.equal(shared[0], separate[0])
    assert all(torch.equal(a, b) for a, b in zip(shared[1], separate[1]))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_delayed_sibling_with_another_history_casts_its_own(checkpoint, monkeypatch):
    """A ``delayed`` layer whose input history differs from its sibling's (k joins after q has trained alone) does not
    take q's cast, scaled from q's history: it casts with its own scale, as without sharing, also in an
    activation-checkpointing recomputation; once both record the same amaxes, the tokens say nothing about equality
    (they stay apart), so k keeps casting its own."""
    from torch.utils.checkpoint import checkpoint as activation_checkpoint

    def run(share: bool, use_checkpoint: bool):
        monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
        torch.manual_seed(0)
        q, k = lf.FP8Linear(64, 64, recipe="delayed"), lf.FP8Linear(64, 64, recipe="delayed")
        bind_state_tables(torch.nn.ModuleList([q, k]))
        for _ in range(2):  # q alone: its history fills, k's stays empty
            with lf.fp8_autocast():
                q(torch.randn(8, 64) * 3.0).sum().backward()
        results = []
        for _ in range(2):
            x = torch.randn(8, 64, requires_grad=True)
            assert not bool(k.fp8_initialized[INPUT]) or len(results) > 0

            def block(x):
                h = x * 2.0
                return q(h) + k(h)

            with lf.fp8_autocast():
                y = activation_checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
            q.weight.grad = k.weight.grad = None
            y.sum().backward()
            results.append((y.detach(), x.grad, q.weight.grad, k.weight.grad))
        return results

    for shared, separate in zip(run(True, checkpoint), run(False, False)):
        assert all(torch.equal(a, b) for a, b in zip(shared, separate))


@pytest.mark.parametrize("evaluate", [False, True])
def test_delayed_cast_of_a_persistent_input_is_not_reused_after_a_roll(evaluate, monkeypatch):
    """A shared ``delayed`` cast is scaled from a history: once the histories roll, a cast kept on an input tensor
    that lives across steps (unchanged) is stale and must not be reused, also by evaluation forwards (which record
    nothing, so the rows' tokens alone would not tell)."""

    def run(share: bool):
        monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
        torch.manual_seed(0)
        q, k = lf.FP8Linear(64, 64, recipe="delayed"), lf.FP8Linear(64, 64, recipe="delayed")
        bind_state_tables(torch.nn.ModuleList([q, k]))
        # one tensor read in every step; computed with autograd recording (a leaf would not be shared at all)
        x = torch.randn(8, 64, requires_grad=True) * 5.0
        outputs = []
        for step in range(3):
            q.train(not evaluate), k.train(not evaluate)
            with lf.fp8_autocast():  # rolls on exit: the next step's scales come from the updated histories
                outputs.append((q(x) + k(x)).detach())
            q.train(), k.train()
            with lf.fp8_autocast():  # both read a wider tensor: the histories move together, so the scales do
                h = torch.randn(8, 64) * (10.0 * 4.0**step)
                q(h), k(h)
        return outputs

    shared_outputs, separate_outputs = run(True), run(False)
    assert not torch.equal(separate_outputs[1], separate_outputs[2])  # the scales moved
    for shared, separate in zip(shared_outputs, separate_outputs):
        assert torch.equal(shared, separate)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_layers_count_every_weight_cast_with_the_same_fractions(recipe):
    """As docs/stats.md says: a compiled layer casts its weight at every micro-batch and counts every cast (eager keeps
    one cast per optimizer step and counts it once); the fractions the callback logs are the same."""
    import copy

    from torch import nn

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    lf.convert_to_fp8(eager, recipe=recipe)
    compiled = copy.deepcopy(eager)
    run = {"eager": eager, "compiled": torch.compile(compiled, backend="aot_eager", fullgraph=True)}
    micro_batches = [torch.randn(8, 32) for _ in range(3)]
    for model in run.values():
        for x in micro_batches:  # one optimizer step of three micro-batches
            with lf.fp8_autocast(defer_amax_history_roll=True):
                model(x).float().pow(2).mean().backward()
        lf.roll_amax_history(model)
    (weight_eager, input_eager), (weight_compiled, input_compiled) = (
        (layer.fp8_counts[WEIGHT].clone(), layer.fp8_counts[INPUT].clone()) for layer in (eager[0], compiled[0])
    )
    assert int(weight_eager[0]) == 64 * 32 and torch.equal(weight_compiled, 3 * weight_eager)
    assert torch.equal(input_compiled, input_eager)  # inputs are cast, and counted, at every micro-batch either way
    assert int(weight_eager[1]) > 0 and weight_compiled[1:].float().div(weight_compiled[0]).equal(
        weight_eager[1:].float().div(weight_eager[0])
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_validation_inside_an_accumulation_window_records_the_weights_statistics_once(recipe):
    """A validation inside an accumulation window makes the kept weight casts stale (the weights may have been swapped
    through ``.data``), so the next training forward casts again; it must not record the weight's statistics a second
    time in that optimizer step: the weight rows' counters equal a run without validation (they read 10240 elements
    instead of 8192 per layer here, one cast too many), and so does everything else."""

    def run(validate):
        torch.manual_seed(0)
        model = TinyDecoder(layers=1, dim=32)
        val = dict(val_check_interval=3, limit_val_batches=2) if validate else dict(limit_val_batches=0)
        trainer = make_trainer(lf.FP8Precision(recipe=recipe), max_steps=4, accumulate_grad_batches=2,
                               num_sanity_val_steps=0, **val)
        trainer.fit(model, loader(n=4_000), loader(n=1_000) if validate else None)
        return model

    validated, plain = run(True), run(False)
    for a, b in zip(validated.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)
    counts_v = [t["counts"] for t in lf.fp8_state_dict(validated)["tables"]]
    counts_p = [t["counts"] for t in lf.fp8_state_dict(plain)["tables"]]
    assert counts_v and all(torch.equal(a, b) for a, b in zip(counts_v, counts_p)), (counts_v, counts_p)
    assert all(int(c[:, WEIGHT, 0].min()) > 0 for c in counts_p)
