"""Checks that need a CUDA GPU: the native FP8 GEMMs, the compiled Triton casts, training on the device.

The rest of the suite runs on CPUs, where every FP8 GEMM is emulated (with the CUDA operand contract asserted) and the
Triton kernels run under ``TRITON_INTERPRET=1``. This file checks the same code where it really runs: on a machine
without CUDA every test here is reported as skipped (CI has no GPU); on a GPU run ``python -m pytest tests/test_cuda.py``.

* The native GEMMs (``torch.nn.functional.scaled_mm`` / ``torch._scaled_mm``) against the emulation, through whole
  FP8 layers (forward, grad_input and grad_weight GEMMs with each recipe's real operand layouts), on aligned and on
  odd shapes: the same FP8 operands, so the only differences are the accumulation order and fast accumulation.
* The compiled Triton casts (per-tensor with statistics, history-scaled, block-scaled) bit for bit against the torch
  reference on the device, on the cases of ``test_triton_cast.py`` (every bf16/fp16 value, rounding boundaries,
  NaN/inf, odd sizes).
* A training step of the Fabric plugin with a fused optimizer raises no device-to-host synchronisation
  (``torch.cuda.set_sync_debug_mode("error")``), for every recipe.
* A real Trainer fits a small decoder on the GPU for every recipe, with the stats callback logging to a CSV file.
"""

from __future__ import annotations

import csv
import glob
import math
import os

import pytest
import torch
from lightning.fabric import Fabric
from models import TinyDecoder, loader
from torch import nn
from utils import make_trainer

import lightning_fp8 as lf
from lightning_fp8 import gemm
from lightning_fp8 import quantize as quantize_module
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision
from lightning_fp8.recipe import RECIPES

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (this machine has none)")
FP8_HARDWARE = CUDA and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_hardware = pytest.mark.skipif(not FP8_HARDWARE, reason="needs FP8 tensor cores (compute capability 8.9+)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@needs_fp8_hardware
def test_gemm_paths_on_this_gpu():
    """Per-tensor and row-wise recipes run natively on 8.9+; the block recipes where their kernels exist."""
    for recipe in ("tensorwise", "delayed", "rowwise"):
        assert lf.gemm_path("cuda", recipe) == "native", recipe
    major = torch.cuda.get_device_capability()[0]
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    public = gemm._PUBLIC_SCALED_MM is not None
    assert lf.gemm_path("cuda", "blockwise") == ("native" if major == 9 and cuda >= (12, 9) and public else "emulated")
    assert lf.gemm_path("cuda", "mxfp8") == ("native" if major >= 10 and cuda >= (12, 8) and public else "emulated")


def _fp8_layer_step(
    recipe: str, in_features: int, out_features: int, lead: tuple[int, ...], native: bool, monkeypatch
) -> tuple[dict[str, torch.Tensor], int]:
    """One forward and backward of a converted ``nn.Linear`` on CUDA with the native GEMM or the emulation; the
    output and the three gradients, and how many GEMMs went to the native kernel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, out_features)).cuda()
    report = lf.convert_to_fp8(model, recipe=recipe, skip_unaligned=False, log_summary=False)
    assert report.converted, report.summary()
    x = torch.randn(*lead, in_features, device="cuda", requires_grad=True)
    grad = torch.randn(*lead, out_features, device="cuda")
    native_calls = [0]
    public, private = gemm._PUBLIC_SCALED_MM, torch._scaled_mm

    def counting(fn):
        def call(*args, **kwargs):
            native_calls[0] += 1
            return fn(*args, **kwargs)

        return call

    with monkeypatch.context() as m:
        if native:
            if public is not None:
                m.setattr(gemm, "_PUBLIC_SCALED_MM", counting(public))
            m.setattr(torch, "_scaled_mm", counting(private))
        else:
            m.setattr(gemm, "gemm_path", lambda *args, **kwargs: "emulated")
        with torch.autocast("cuda", dtype=torch.bfloat16), lf.fp8_autocast():
            out = model(x)
        (out.float() * grad).sum().backward()
    layer = model[0]
    return {
        "out": out.float(),
        "grad_input": x.grad,
        "grad_weight": layer.weight.grad,
        "grad_bias": layer.bias.grad,
    }, native_calls[0]


SHAPES = {"aligned": (512, 768, (4, 128)), "odd": (200, 300, (7, 13))}


@needs_fp8_hardware
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_native_gemms_match_the_emulation(recipe, shape, monkeypatch):
    """The same FP8 operands through the hardware kernel and through the emulation: forward and both backward GEMMs
    agree to the accumulation order (a wrong layout, scale or padding is an O(1) error)."""
    if lf.gemm_path("cuda", recipe) != "native":
        pytest.skip(f"{recipe}: no native kernel on this GPU ({lf.gemm_path('cuda', recipe)})")
    in_features, out_features, lead = SHAPES[shape]
    native, calls = _fp8_layer_step(recipe, in_features, out_features, lead, True, monkeypatch)
    emulated, none = _fp8_layer_step(recipe, in_features, out_features, lead, False, monkeypatch)
    assert calls == 3 and none == 0, (calls, none)  # forward, grad_input, grad_weight
    errors = {k: _rel(native[k], emulated[k]) for k in native}
    print(f"{recipe} {shape}: native vs emulated relative differences {errors}")
    assert all(math.isfinite(e) and e < 1e-2 for e in errors.values()), errors


@needs_fp8_hardware
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_native_layers_compile_without_graph_breaks(recipe):
    """``torch.compile(fullgraph=True)`` (which raises at any graph break) through the native GEMMs, forward and
    backward: on torch 2.11 ``F.scaled_mm`` broke the graph at every GEMM (47 breaks in the Llama benchmark)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    lf.convert_to_fp8(model, recipe=recipe, log_summary=False)
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16), lf.fp8_autocast():
        out = compiled(x)
    out.float().square().mean().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


@needs_fp8_hardware
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_compile_dynamic_true_matches_eager_on_the_gpu(recipe):
    """``torch.compile(dynamic=True)`` through the native GEMMs (``aot_eager``: the traced graph, the same kernels):
    the same bits as eager for every token count, aligned, 16-aligned and odd (tests/test_compile_dynamic.py on CUDA;
    on a CPU the GEMMs are emulated)."""
    import copy

    from test_compile_dynamic import TOKENS, _step

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Linear(256, 384).cuda()
    lf.convert_to_fp8(eager, recipe=recipe, log_summary=False)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager", dynamic=True)
    for tokens in TOKENS:
        x = torch.randn(tokens, 256, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pairs = list(zip(_step(eager, x), _step(compiled, x)))
        assert all(torch.equal(a, b) for a, b in pairs), (recipe, tokens)
    for a, b in zip(eager.state_dict().values(), twin.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_inductor_dynamic_true_on_the_gpu(recipe):
    """Inductor with ``dynamic=True`` on CUDA (Triton code with symbolic sizes, the stored scales): close to eager for
    every token count. ``emulate_precision_casts`` keeps inductor's bf16 roundings where eager has them (without it a
    fused bf16 intermediate can flip FP8 values: a few percent on a CPU); a wrong scale or layout is an O(1) error."""
    import copy

    from test_compile_dynamic import TOKENS, _step

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Linear(256, 384).cuda()
    lf.convert_to_fp8(eager, recipe=recipe, log_summary=False)
    compiled = torch.compile(copy.deepcopy(eager), dynamic=True)
    for tokens in TOKENS:
        x = torch.randn(tokens, 256, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16), torch._inductor.config.patch(emulate_precision_casts=True):
            errors = [_rel(b.float(), a.float()) for a, b in zip(_step(eager, x), _step(compiled, x))]
        print(f"inductor dynamic=True {recipe} {tokens} tokens: relative differences to eager {errors}")
        assert all(math.isfinite(e) and e < 1e-2 for e in errors), (recipe, tokens, errors)


def _inductor_against_eager(recipe: str, device: str) -> list[str]:
    """Three deferred steps of a two-layer MLP under bf16 autocast, eager and compiled by inductor, the middle step not
    counting (``fp8_autocast(count_statistics=False)``, what ``statistics_every_n_steps`` runs between two counting
    steps). Asserts what must hold whatever the roundings: the first step's forward counts (same input, same weights)
    are the same integers, a step that does not count leaves every counter as it was, and outputs and gradients are
    close (1e-2, as above). Returns, for the test to print, what is not bit-identical: ``rounded_to`` claims nothing
    (on this project's CPU every recipe gives none, C++ code; with a GELU instead of the ReLU, inductor's GELU rounds
    differently from eager's kernel in places, which moves a few FP8 values and counts, so the ReLU)."""
    import copy

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 160), nn.ReLU(), nn.Linear(160, 48)).to(device)
    lf.convert_to_fp8(eager, recipe=recipe, log_summary=False)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)

    def step(model: nn.Module, x: torch.Tensor, count: bool) -> list[torch.Tensor]:
        x = x.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16), lf.fp8_autocast(
            defer_amax_history_roll=True, count_statistics=count
        ):
            y = model(x)
        y.float().pow(2).sum().backward()
        lf.roll_amax_history(model)
        out = [y.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]
        model.zero_grad(set_to_none=True)
        return out

    def counters() -> list[torch.Tensor]:
        return [model[i].fp8_counts.clone() for model in (eager, twin) for i in (0, 2)]

    differ = []
    # eager's bf16 roundings kept in the compiled graphs, forward and backward (compiled at the first backward)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        for i, count in enumerate((True, False, True)):
            x = torch.randn(96, 64, device=device) * (1 + 3 * i)
            before = counters()
            pairs = list(zip(step(eager, x, count), step(compiled, x, count)))
            errors = [_rel(b.float(), a.float()) for a, b in pairs]
            assert all(math.isfinite(e) and e < 1e-2 for e in errors), (recipe, i, errors)
            differ += [f"step {i} tensor {k}" for k, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
            if not count:
                assert all(map(torch.equal, before, counters())), (recipe, "a step that does not count counted")
            if i == 0:
                assert torch.equal(eager[0].fp8_counts[:2], twin[0].fp8_counts[:2]), (recipe, "first forward counts")
    state_e, state_c = lf.fp8_state_dict(eager)["tables"][0], lf.fp8_state_dict(twin)["tables"][0]
    differ += [f"state {k}" for k, v in state_e.items() if isinstance(v, torch.Tensor) and not torch.equal(v, state_c[k])]
    return differ


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_inductor_against_eager_counting_and_not_on_the_gpu(recipe):
    """:func:`_inductor_against_eager` on CUDA: the Triton code of counting and not counting steps, and ``delayed``'s
    input recast in the backward, which no GPU has run compiled yet."""
    differ = _inductor_against_eager(recipe, "cuda")
    print(f"inductor vs eager, {recipe}, CUDA: not bit-identical: {differ or 'none'}")


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_inductor_checkpointed_blocks_on_the_gpu(recipe):
    """Activation-checkpointed blocks compiled one by one by inductor (torchtitan's way) under a deferred roll, on
    CUDA: one graph for the three blocks (``fullgraph=True``), close to eager over three steps (tests/test_linear.py's
    ``test_compiled_checkpointed_blocks_match_eager`` with Triton code)."""
    import copy

    from test_linear import _Blocks, _CheckpointedBlock, _compile_in_scope, _deferred_step
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Blocks(n=3).cuda()
    lf.convert_to_fp8(eager, recipe=recipe, log_summary=False)
    compiled = copy.deepcopy(eager)
    eager.blocks = nn.ModuleList(_CheckpointedBlock(b) for b in eager.blocks)
    compiled.blocks = nn.ModuleList(_CheckpointedBlock(b) for b in compiled.blocks)
    counter = CompileCounterWithBackend("inductor")
    compiled = _compile_in_scope(compiled, compiled.blocks, "blocks", counter)
    for step in range(3):
        x = torch.randn(64, 64, device="cuda") * (1 + step)
        g = torch.randn(64, 64, device="cuda") * 2**step
        y1, gx1, gp1 = _deferred_step(eager, x, g)
        y2, gx2, gp2 = _deferred_step(compiled, x, g)
        errors = [_rel(b.float(), a.float()) for a, b in zip([y1, gx1, *gp1], [y2, gx2, *gp2])]
        print(f"inductor checkpointed blocks {recipe} step {step}: relative differences to eager {errors}")
        assert all(math.isfinite(e) and e < 1e-2 for e in errors), (recipe, step, errors)
    assert counter.frame_count == 1


@pytest.mark.parametrize("case", ["offset slice", "strided slice", "expanded", "transposed"])
def test_stored_views_keep_their_values_under_inductor_on_the_gpu(case):
    """``lightning_fp8.recipe.stored`` of a view under inductor's Triton code (tests/test_compiled_scales.py on CUDA)."""
    from test_compiled_scales import _VIEWS

    torch._dynamo.reset()
    x = torch.randn(5, 6, device="cuda")
    fn = _VIEWS[case]
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))


# ------------------------------------------------------------------------------- Triton casts, compiled


def _cuda(value):
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, tuple):
        return tuple(_cuda(v) for v in value)
    if isinstance(value, dict):
        return {k: _cuda(v) for k, v in value.items()}
    return value


def test_compiled_triton_casts_match_the_reference_bit_for_bit(monkeypatch):
    """Every case of test_triton_cast.py, on CUDA tensors: the compiled kernels, dispatched as in training, against
    the torch reference on the same device (data bytes, scales, amaxes and counts)."""
    import test_triton_cast as tc

    from lightning_fp8.triton_cast import triton_cast_with_statistics, use_triton

    assert use_triton(torch.ones(4, 16, device="cuda", dtype=torch.bfloat16))
    monkeypatch.setattr(quantize_module, "use_triton", quantize_module.use_triton)  # the comparisons patch it
    failures = {}
    for name, build in tc._cases().items():
        result = tc._compare(triton_cast_with_statistics, *_cuda(build()))
        if result["mismatches"] != 0 or result["counts"] != result["ref_counts"]:
            failures[f"elementwise {name}"] = result
    for name, build in tc._block_cases().items():
        case = _cuda(build())
        result = tc._compare_block(case["x"], case["spec"], case["scale"], case["statistics"])
        if (result["data_mismatches"], result["scale_mismatches"], result["amax_mismatches"]) != (0, 0, 0) or result[
            "counts"
        ] != result["ref_counts"]:
            failures[f"block {name}"] = result
    for name, build in tc._history_cases().items():
        result = tc._compare_history(**_cuda(build()), cast_module=quantize_module)
        bad = [
            k
            for k in ("data_mismatches", "scale_mismatches", "amax_mismatches", "stats_scale_mismatches")
            if result.get(k, 0) != 0
        ]
        if bad or result.get("counts") != result.get("ref_counts"):
            failures[f"history {name}"] = result
    assert not failures, failures


# ------------------------------------------------------------------------------- training on the device


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fabric_step_on_cuda_never_synchronizes(recipe):
    """Forward, loss scaling, backward, fused AdamW step and the amax-history roll, with CUDA's sync checker set to
    raise: not one device-to-host synchronisation."""
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cuda", devices=1, plugins=[FabricFP8Precision(recipe=recipe)])
    model = TinyDecoder(dim=128, heads=4, optimizer="adamw_fused")
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    batches = [fabric.to_device(b) for b in list(loader(n=4_000))[:4]]

    def step(batch):
        optimizer.zero_grad()
        logits = model(batch[0])
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, 256), batch[1].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        return loss.detach()

    losses = [step(b) for b in batches[:2]]  # warm-up: lazy initialisation, the scaler's first step
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses += [step(b) for b in batches[2:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(math.isfinite(float(loss)) for loss in losses)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_trainer_fits_on_the_gpu(recipe, tmp_path):
    """A real Trainer on the GPU: the loss falls, the layers are FP8 (native GEMMs where the GPU has them) and the
    stats callback's CSV carries the loss scale and the overflow counts."""
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    model = TinyDecoder(dim=128, heads=4, lr=3e-3)
    trainer = make_trainer(
        lf.FP8Precision(recipe=recipe),
        accelerator="cuda",
        max_steps=60,
        log_every_n_steps=10,
        logger=CSVLogger(tmp_path),
        callbacks=[lf.FP8StatsCallback()],
    )
    seen = set()
    model.blocks[0].fc.register_forward_hook(lambda m, args, out: seen.add((args[0].device.type, out.dtype)))
    trainer.fit(model, loader(n=40_000))
    assert isinstance(model.blocks[0].fc, lf.FP8Linear)
    assert seen == {("cuda", torch.bfloat16)}, seen  # the FP8 layers ran on the GPU (Lightning moves the model back)
    [path] = glob.glob(os.path.join(tmp_path, "**", "metrics.csv"), recursive=True)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) >= 5 and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.5, losses
    columns = set(rows[0])
    assert any("loss_scale" in c for c in columns), sorted(columns)
    assert any("overflow" in c for c in columns), sorted(columns)
