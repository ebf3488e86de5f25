"""Sharded FP8 training (issue 9): FSDP2 with FP8 weight all-gather and tensor parallelism through Lightning's
ModelParallelStrategy (Trainer and Fabric), 2 CPU processes on gloo; and the pieces in-process: the FP8 all-gather
weight, the tensor-parallel amax reductions, the errors.

The 2-process runs live in tests/scripts/fsdp2_train.py (Trainer), tests/scripts/fsdp2_fabric.py (Fabric) and
tests/scripts/tp_layers.py; tests/scripts/gloo_checks.py runs them (with the other 2-process checks of the suite) in one
launch per session, and the tests read their results back from files (the ``gloo_runs`` fixture of conftest.py).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from conftest import GlooRuns, gloo_launch
from utils import gloo_check_folder

import lightning_fp8 as lf
from lightning_fp8.distributed import (
    FP8GatheredWeight,
    FP8ShardedWeight,
    TensorParallelLayout,
    enable_fp8_all_gather,
    gathered_weight,
    gathers_fp8,
    precompute_fp8_weight_scales,
)
from lightning_fp8.quantize import quantize
from lightning_fp8.recipe import GRAD_OUTPUT, INPUT, WEIGHT, resolve_recipe

LOSS_RTOL = 0.01  # FP8 tolerance: per-rank input scales differ from the single process's whole-batch scales


def load(path):
    return torch.load(path, weights_only=False)


def per_layer(state: dict) -> dict:
    from lightning_fp8.state import fp8_state_layer_names, layer_state

    return {name: layer_state(state, name) for name in fp8_state_layer_names(state)}


def assert_losses_close(losses, reference):
    assert len(losses) == len(reference) and losses
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (step, a, b)


# ------------------------------------------------------------------------------------------------ Trainer, FSDP2


TRAINER_SINGLE, TRAINER_FSDP2 = "fsdp2_train/delayed/single", "fsdp2_train/delayed/fsdp2"
TRAINER_RUNS = pytest.mark.gloo(TRAINER_SINGLE, TRAINER_FSDP2)


@pytest.fixture
def trainer_runs(gloo_runs):
    """The Trainer script's runs with ``delayed`` (amax histories: the harder case for agreement and resume): the
    folders of the one-process reference and of the FSDP2 run."""
    return SimpleNamespace(single=gloo_runs.folder(TRAINER_SINGLE), fsdp2=gloo_runs.folder(TRAINER_FSDP2))


@pytest.mark.slow
@TRAINER_RUNS
def test_trainer_fsdp2_matches_one_process_and_gathers_fp8(trainer_runs):
    fsdp, single = load(trainer_runs.fsdp2 / "fsdp2.pt"), load(trainer_runs.single / "single.pt")
    # every FP8 layer's weight is sharded as an FP8ShardedWeight: FSDP2 gathers it in FP8
    assert set(fsdp["weight_types"].values()) == {"FP8ShardedWeight"}, fsdp["weight_types"]
    assert len(fsdp["weight_types"]) == 9
    assert_losses_close(fsdp["losses"], single["losses"])
    # validation every 2 steps (4 windows of 2 batches), the LM head held unsharded by the root after each
    assert len(single["val_losses"]) == 8
    assert_losses_close(fsdp["val_losses"], single["val_losses"])
    # the parameters stay float32 (sharded), with the unconverted model's keys
    assert fsdp["state"].keys() == single["state"].keys()
    assert all(v.dtype == torch.float32 for v in fsdp["state"].values())


@pytest.mark.slow
@TRAINER_RUNS
def test_trainer_fsdp2_ranks_agree_on_every_scale(trainer_runs):
    rank0 = per_layer(load(trainer_runs.fsdp2 / "fp8_rank0.pt"))
    rank1 = per_layer(load(trainer_runs.fsdp2 / "fp8_rank1.pt"))
    assert rank0.keys() == rank1.keys() and len(rank0) == 9
    for name in rank0:
        for key in ("amax_history", "scale", "initialized"):
            assert torch.equal(rank0[name][key], rank1[name][key]), (name, key)
        # the weight's history holds whole-weight amaxes (each rank records its shard's; the roll reduces them)
        assert bool(rank0[name]["initialized"].all()), name
        assert torch.isfinite(rank0[name]["scale"]).all() and (rank0[name]["scale"] > 0).all(), name


@pytest.mark.slow
@TRAINER_RUNS
def test_trainer_fsdp2_distributed_checkpoint_resumes_exactly(trainer_runs):
    fsdp = load(trainer_runs.fsdp2 / "fsdp2.pt")
    for name, value in fsdp["state"].items():
        assert torch.equal(value, fsdp["resumed"][name]), name
    straight, resumed = per_layer(fsdp["fp8"]), per_layer(fsdp["fp8_resumed"])
    for name in straight:
        for key in ("amax_history", "scale", "initialized"):
            assert torch.equal(straight[name][key], resumed[name][key]), (name, key)
    # the checkpoint is a torch.distributed.checkpoint folder
    ckpt = trainer_runs.fsdp2 / "epoch1.ckpt"
    assert ckpt.is_dir() and (ckpt / ".metadata").exists()


@pytest.mark.slow
@TRAINER_RUNS
def test_trainer_fsdp2_distributed_checkpoint_resumes_into_another_parallel_split(trainer_runs):
    """The folder written by data parallel 2 resumed into tensor parallel 2 x data parallel 1: the FP8 state is the
    checkpoint's when training starts, and the second epoch trains like the uninterrupted run."""
    fsdp = load(trainer_runs.fsdp2 / "fsdp2.pt")
    saved, start = per_layer(fsdp["fp8_first"]), per_layer(fsdp["tp_resumed_start"])
    assert saved.keys() == start.keys()
    for name in saved:
        for key in ("amax_history", "scale", "initialized"):
            assert torch.equal(saved[name][key], start[name][key]), (name, key)
    second_epoch = fsdp["losses"][len(fsdp["losses"]) // 2 :]
    assert len(fsdp["tp_resumed_losses"]) == len(second_epoch) == 4
    assert_losses_close(fsdp["tp_resumed_losses"], second_epoch)
    for name, value in fsdp["state"].items():
        assert torch.allclose(fsdp["tp_resumed"][name], value, rtol=0, atol=0.05), name


def _consolidate_run(workdir):
    """Lightning's command line on the FSDP2 run's distributed checkpoint, once the 2-process checks are done."""

    def args(gloo_run):
        checkpoint = gloo_check_folder(gloo_run, TRAINER_FSDP2) / "epoch1.ckpt"
        out = workdir / "consolidated.ckpt"
        return [sys.executable, "-m", "lightning.fabric.utilities.consolidate_checkpoint", checkpoint, "--output_file", out]

    return {"after": ("conftest", "gloo_runs"), "args": args, "cwd": os.getcwd(), "timeout": 300}


@pytest.fixture
def consolidate_run(early_runs):
    return early_runs.result(__name__, "consolidate_run")


@pytest.mark.slow
@TRAINER_RUNS
def test_trainer_fsdp2_checkpoint_consolidates_into_an_unconverted_model(trainer_runs, consolidate_run):
    """The consolidation runs early, after the 2-process checks (tests/conftest.py)."""
    from models import TinyDecoder

    proc, out = consolidate_run, consolidate_run.workdir / "consolidated.ckpt"
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = torch.load(out, weights_only=True)  # tensors and plain values only, FP8 state included
    plain = TinyDecoder(dim=128, heads=4, layers=2)
    plain.load_state_dict(checkpoint["state_dict"])  # strict: the unconverted model's keys, plain tensors
    expected = load(trainer_runs.fsdp2 / "fsdp2.pt")["first"]
    for name, value in plain.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert not any(type(m) is lf.FP8Linear for m in plain.modules())
    fp8 = checkpoint["FP8Precision"]
    assert fp8["recipe"]["name"] == "delayed" and len(per_layer(fp8["models"][0])) == 9


@pytest.mark.slow
@TRAINER_RUNS
def test_trainer_fsdp2_statistics_are_logged(trainer_runs):
    import csv

    with open(trainer_runs.fsdp2 / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    weight_amax = [float(r["fp8/blocks.0.fc/weight/amax"]) for r in rows if r.get("fp8/blocks.0.fc/weight/amax")]
    assert len(weight_amax) == 8 and all(0 < a < float("inf") for a in weight_amax)


@pytest.mark.slow
@pytest.mark.gloo("fsdp2_train/tensorwise/bytes")
def test_trainer_fsdp2_fp8_all_gather_moves_at_most_057_of_the_bf16_bytes(gloo_runs):
    """Bytes moved by FSDP2's parameter all-gathers per training step (forward and backward), FP8 all-gather against
    the same run gathering bf16 parameters (MixedPrecisionPolicy(param_dtype=bfloat16)); Linear weights are ~92% of
    the parameters (torchao measures 0.55x on such a model)."""
    gathered = load(gloo_runs.folder("fsdp2_train/tensorwise/bytes") / "bytes.pt")
    assert len(gathered["fp8"]) == len(gathered["bf16"]) == 2 and min(gathered["bf16"]) > 0
    ratio = sum(gathered["fp8"]) / sum(gathered["bf16"])
    print(f"FSDP2 all-gather bytes per step: FP8 {gathered['fp8'][0]}, bf16 {gathered['bf16'][0]}, ratio {ratio:.3f}")
    assert ratio <= 0.57


@pytest.mark.slow
@pytest.mark.gloo(TRAINER_SINGLE, "fsdp2_train/delayed/tp")
def test_trainer_tensor_parallel_with_fsdp2_matches_one_process(gloo_runs):
    """tensor_parallel_size=2: the MLPs column-/row-wise and the LM head column-wise (lightning_fp8's styles), FSDP2 on
    the (size 1) data-parallel mesh: a 2-D mesh, FP8 all-gather and TP compute together."""
    tp, single = load(gloo_runs.folder("fsdp2_train/delayed/tp") / "tp.pt"), load(gloo_runs.folder(TRAINER_SINGLE) / "single.pt")
    assert_losses_close(tp["losses"], single["losses"])
    weights = tp["weights"]
    assert weights["blocks.0.fc"][0] == "FP8ShardedWeight" and len(weights["blocks.0.fc"][1]) == 2  # (dp, tp) mesh
    assert weights["blocks.0.fc"][1][1] == "S(0)" and weights["blocks.0.out"][1][1] == "S(1)"


@pytest.mark.slow
@pytest.mark.gloo("fsdp2_train/tensorwise/errors")
def test_trainer_sharding_errors_and_warnings(gloo_runs):
    result = load(gloo_runs.folder("fsdp2_train/tensorwise/errors") / "errors.pt")
    # fully_shard in configure_model without prepare_for_sharding: a clear error, not a silent bf16 run
    assert "prepare_for_sharding" in result["unprepared"] and "before" in result["unprepared"]
    # torch's own TP styles on prepared layers: training works, and the plugin says those weights gather in high precision
    assert len(result["torch_styles_losses"]) == 2
    (warning,) = result["torch_styles_warnings"]
    assert "high precision" in warning and "FP8ColwiseParallel" in warning and "blocks.0.fc" in warning


# ------------------------------------------------------------------------------------------------- Fabric, FSDP2


@pytest.mark.slow
@pytest.mark.gloo("fsdp2_fabric/tensorwise/single", "fsdp2_fabric/tensorwise/fsdp2", "fsdp2_fabric/tensorwise/tp")
def test_fabric_fsdp2_matches_one_process_and_resumes_exactly(gloo_runs):
    single_dir, fsdp_dir = gloo_runs.folder("fsdp2_fabric/tensorwise/single"), gloo_runs.folder("fsdp2_fabric/tensorwise/fsdp2")
    fsdp, single = load(fsdp_dir / "fabric_fsdp2.pt"), load(single_dir / "fabric_single.pt")
    assert {kind for kind, _ in fsdp["weight_types"].values()} == {"FP8ShardedWeight"} and len(fsdp["weight_types"]) == 9
    assert single["losses"][0] != pytest.approx(5.663039684295654, abs=1e-6)  # the FP8 path ran (not the float32 one)
    assert_losses_close(fsdp["losses"], single["losses"])
    for name, value in fsdp["state"].items():
        assert torch.equal(value, fsdp["resumed"][name]), name
    rank0 = per_layer(torch.load(fsdp_dir / "fabric_fsdp2_fp8_rank0.pt", weights_only=True))
    rank1 = per_layer(torch.load(fsdp_dir / "fabric_fsdp2_fp8_rank1.pt", weights_only=True))
    for name in rank0:  # tensorwise: the weight's scale is agreed (the inputs' are each rank's own batch's)
        assert torch.equal(rank0[name]["scale"][WEIGHT], rank1[name]["scale"][WEIGHT]), name
    # tensor parallel 2 x FSDP2 1 through Fabric: the same losses, and its own exact resume
    tp = load(gloo_runs.folder("fsdp2_fabric/tensorwise/tp") / "fabric_tp.pt")
    assert_losses_close(tp["losses"], single["losses"])
    assert tp["weight_types"]["_forward_module.blocks.0.fc"] == ("FP8ShardedWeight", ["_S(0, 2)", "S(0)"])
    for name, value in tp["state"].items():
        assert torch.equal(value, tp["resumed"][name]), name


@pytest.mark.slow
@pytest.mark.gloo("fsdp2_fabric_resume")
def test_fabric_load_of_a_distributed_checkpoint_restores_the_plugin_and_the_stats_reader(gloo_runs):
    """``fabric.load(folder, {..., "fp8": plugin, "stats": stats})`` under ``ModelParallelStrategy``: Lightning's folder
    branch put the saved dicts in the state instead of loading them into the objects, so the run resumed silently with
    empty amax histories, the initial loss scale and a reader that had lost the first half of the run. ``delayed`` with
    float16 dynamic loss scaling: the resume is exact only if both were restored."""
    result = load(gloo_runs.folder("fsdp2_fabric_resume") / "fabric_resume.pt")
    straight = result["straight"]
    assert straight["totals"]["blocks.0.qkv"][0][0] == 2 * 8 * 4 * 32 * 128
    for resumed in (result["resumed"], result["resumed_from_a_mapping"]):  # the state a dict, or a UserDict
        assert resumed["loaded"] == {"fp8": "FP8Precision", "stats": "FP8Stats", "remainder": []}  # objects, not dicts
        assert resumed["loss_scale"] == straight["loss_scale"] > 2.0**10  # grown from init_scale, step by step
        for name, value in straight["weights"].items():
            assert torch.equal(value, resumed["weights"][name]), name
        (before,), (after,) = straight["fp8"]["tables"], resumed["fp8"]["tables"]
        for key in ("scale", "amax_history", "initialized"):
            assert torch.equal(before[key], after[key]), key
        assert resumed["totals"] == straight["totals"]


@pytest.mark.slow
@pytest.mark.gloo("fsdp2_fabric/tensorwise/single")
def test_fabric_hsdp_matches_one_process_and_resumes_exactly(gloo_runs, two_d_runs):
    """HSDP through Fabric: FSDP2 on a (replicate 2, shard 2) mesh of 4 processes, FP8 all-gather within each replica
    group: the one-process losses, one weight scale on all 4 ranks, and an exact resume from a checkpoint folder."""
    folder = two_d_runs.folder(HSDP)
    hsdp, single = load(folder / "fabric_hsdp.pt"), load(gloo_runs.folder("fsdp2_fabric/tensorwise/single") / "fabric_single.pt")
    assert len(hsdp["weight_types"]) == 9
    assert all(kind == ("FP8ShardedWeight", ["R", "S(0)"]) for kind in hsdp["weight_types"].values()), hsdp["weight_types"]
    assert_losses_close(hsdp["losses"], single["losses"])
    for name, value in hsdp["state"].items():
        assert torch.equal(value, hsdp["resumed"][name]), name
    ranks = [per_layer(torch.load(folder / f"fabric_hsdp_fp8_rank{rank}.pt", weights_only=True)) for rank in range(4)]
    for name in ranks[0]:
        for other in ranks[1:]:
            assert torch.equal(ranks[0][name]["scale"][WEIGHT], other[name]["scale"][WEIGHT]), name


# ------------------------------------------------------------------------------------------------ in-process pieces


def test_the_wrapped_fabric_load_checkpoint_takes_the_same_arguments():
    """lightning_fp8 wraps Fabric's ``ModelParallelStrategy.load_checkpoint`` (see
    test_fabric_load_of_a_distributed_checkpoint_restores_the_plugin_and_the_stats_reader): every argument reaches
    Lightning's, by position or by name, and a state without lightning-fp8 objects is left to Lightning."""
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_fp8.fabric import _loading_into_fp8_objects

    assert getattr(ModelParallelStrategy.load_checkpoint, "_lightning_fp8_loads_fp8_objects", False)
    calls = []

    def original(self, path, state=None, strict=True, weights_only=None):
        calls.append((path, state, strict, weights_only))
        state["other"] = {"replaced": True}  # Lightning's folder branch: a saved dict instead of the object
        return {}

    wrapped = _loading_into_fp8_objects(original)
    state = {"other": object()}
    assert wrapped(None, "ckpt", state, False, True) == {} and wrapped(None, path="ckpt", state=state, weights_only=False) == {}
    assert calls == [("ckpt", state, False, True), ("ckpt", state, True, False)]
    assert state["other"] == {"replaced": True}


def test_the_wrapped_fabric_load_checkpoint_passes_only_the_arguments_it_was_given():
    """Lightning 2.5's ``ModelParallelStrategy.load_checkpoint`` has no ``weights_only`` argument: the wrapper must
    not add one (it did: every ``fabric.load`` under ``ModelParallelStrategy`` raised ``TypeError`` on Lightning 2.5)."""
    from lightning_fp8.fabric import _loading_into_fp8_objects

    calls = []

    def lightning_2_5(self, path, state=None, strict=True):
        calls.append((path, strict))
        return {"rest": 1}

    wrapped = _loading_into_fp8_objects(lightning_2_5)
    state = {"other": object()}
    assert wrapped(None, "ckpt", state) == {"rest": 1}
    assert wrapped(None, "ckpt", state, False) == {"rest": 1}
    assert wrapped(None, path="ckpt", state=state, strict=False) == {"rest": 1}
    assert calls == [("ckpt", True), ("ckpt", False), ("ckpt", False)]
    assert list(inspect.signature(wrapped).parameters) == ["self", "path", "state", "strict"]


def test_which_recipes_gather_in_fp8():
    assert [gathers_fp8(resolve_recipe(n)) for n in ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")] == [
        True,
        True,
        False,
        False,
        False,
    ]


def test_sharded_weight_is_the_high_precision_tensor_for_everything_but_the_gather():
    torch.manual_seed(0)
    layer = lf.FP8Linear(32, 48)
    plain = nn.Linear(32, 48)
    plain.load_state_dict(layer.state_dict())
    assert enable_fp8_all_gather(layer) == [""]
    assert type(layer.weight) is nn.Parameter or isinstance(layer.weight, FP8ShardedWeight)
    assert isinstance(layer.weight, FP8ShardedWeight) and layer.weight.requires_grad
    assert layer.weight_provider is gathered_weight
    assert enable_fp8_all_gather(layer) == [""]  # idempotent
    # the ops FSDP2 uses to shard it keep the subclass (and its scale); the others give plain tensors
    w = layer.weight
    assert isinstance(w.detach(), FP8ShardedWeight) and isinstance(w.view(-1), FP8ShardedWeight)
    assert isinstance(w.new_zeros(4, 32), FP8ShardedWeight) and isinstance(w.narrow(0, 0, 8), FP8ShardedWeight)
    assert w.narrow(0, 0, 8)._scale is w._scale
    assert type(w * 2) is torch.Tensor and type(torch.chunk(w.detach(), 2)[0]) is torch.Tensor
    copied = copy.deepcopy(layer)  # weight-averaging callbacks deep-copy the model
    assert isinstance(copied.weight, FP8ShardedWeight) and torch.equal(copied.weight._tensor, w._tensor)
    assert copied.weight._tensor.data_ptr() != w._tensor.data_ptr() and copied.weight._scale is not w._scale
    # optimizer, gradients and state dicts see the float32 values
    opt_a = torch.optim.AdamW(layer.parameters(), lr=0.1)
    opt_b = torch.optim.AdamW(plain.parameters(), lr=0.1)
    x = torch.randn(4, 32)
    for _ in range(2):  # outside an FP8 region the layer is nn.Linear
        layer(x).square().sum().backward()
        plain(x).square().sum().backward()
        opt_a.step(), opt_b.step(), opt_a.zero_grad(), opt_b.zero_grad()
    state = layer.state_dict()
    assert type(state["weight"]) is torch.Tensor and list(state) == ["weight", "bias"]
    assert torch.equal(state["weight"], plain.weight.detach())
    fresh = nn.Linear(32, 48)
    fresh.load_state_dict(state)
    layer.load_state_dict(nn.Linear(32, 48).state_dict())  # loading copies into the wrapped tensor
    assert isinstance(layer.weight, FP8ShardedWeight) and not torch.equal(layer.weight._tensor, plain.weight.detach())


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_all_gather_gives_the_unsharded_cast_bit_for_bit(recipe):
    """Three shards (FSDP2 pads the last), each cast with the shared whole-weight scale, gathered: the FP8 weight of
    the unsharded layer, bit for bit, and the layer's FP8 forward from it is the unsharded layer's."""
    torch.manual_seed(0)
    layer = lf.FP8Linear(64, 80, recipe=recipe)  # 80 rows over 3 ranks: shards of 27, 27, 26 (+1 row of padding)
    reference = lf.FP8Linear(64, 80, recipe=recipe)
    reference.load_state_dict(layer.state_dict())
    enable_fp8_all_gather(layer)
    full = layer.weight._tensor
    spec = layer.fp8_state.table.specs.forward[WEIGHT]
    assert layer.weight._spec == spec
    shards = [FP8ShardedWeight(piece, spec) for piece in torch.split(full, 27)]
    for shard in shards[1:]:
        shard._scale = shards[0]._scale
    current = dataclasses.replace(spec, scale_source="current")  # the first step of delayed: no history yet
    precompute_fp8_weight_scales([shards[0]])  # one rank: the scale of the shard's amax ...
    assert torch.equal(shards[0]._scale, quantize(shards[0]._tensor, current).scale)
    shards[0]._scale.copy_(quantize(full, current).scale)  # ... three ranks: of the whole weight (the all-reduce's)
    mesh = SimpleNamespace(size=lambda: 3)
    inputs, metadata = zip(*(s.fsdp_pre_all_gather(mesh, full.shape, full.stride(), layer, None) for s in shards))
    assert all(t[0].shape == (27, 64) and t[0].dtype == torch.uint8 for t in inputs)
    gathered_bytes = torch.cat([t[0] for t in inputs])  # what the all-gather returns
    gathered, inner = shards[0].fsdp_post_all_gather((gathered_bytes,), metadata[0], torch.float32)
    unsharded = torch.as_strided(gathered, full.shape, full.stride(), 0)  # as FSDP2 makes the unsharded parameter
    assert isinstance(unsharded, FP8GatheredWeight) and unsharded.dtype == torch.float32
    assert torch.equal(unsharded._data.view(torch.uint8), quantize(full, current).data.view(torch.uint8))
    # the stats travel with the shard: the first shard's amax
    assert metadata[0][2].amax == shards[0]._tensor.abs().max()
    # the layer takes the gathered FP8 weight through the provider seam
    x = torch.randn(8, 64)
    layer.weight = nn.Parameter(unsharded, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), lf.fp8_autocast():
        ours, theirs = layer(x), reference(x)
    assert torch.equal(ours, theirs)
    ours.float().sum().backward()
    theirs.float().sum().backward()
    assert torch.equal(layer.weight.grad, reference.weight.grad)
    # outside the region the gathered weight computes dequantized (the high-precision weight was never gathered)
    dequantized = layer.weight.dequantize()
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dequantized, layer.bias))
    # and so does any other use of it (docs/distributed.md: an L2 penalty computed in the forward), gradient included
    layer.weight.grad = None
    penalty = layer.weight.pow(2).sum()
    assert torch.equal(penalty, dequantized.pow(2).sum()) and not torch.equal(penalty, full.pow(2).sum())
    penalty.backward()
    assert torch.equal(layer.weight.grad, 2 * dequantized)


def _layout(style: str) -> TensorParallelLayout:
    return TensorParallelLayout(style, SimpleNamespace(get_group=lambda: None))


@pytest.mark.parametrize(
    "recipe, expected",
    [
        # colwise: (input, weight, grad_output for grad_input, grad_output for grad_weight); rowwise likewise
        ("tensorwise", {"colwise": (False, True, True, True), "rowwise": (True, True, False, False)}),
        ("delayed", {"colwise": (False, True, True, True), "rowwise": (True, True, False, False)}),
        # rows along K (forward), N (grad_input), M (grad_weight)
        ("rowwise", {"colwise": (False, False, True, False), "rowwise": (True, True, False, False)}),
        ("blockwise", {"colwise": (False, False, False, False), "rowwise": (False, False, False, False)}),
        ("mxfp8", {"colwise": (False, False, False, False), "rowwise": (False, False, False, False)}),
    ],
)
def test_tensor_parallel_reduces_exactly_the_amaxes_that_span_ranks(recipe, expected):
    specs = resolve_recipe(recipe).cast_specs()
    x, w, g = torch.zeros(256, 256), torch.zeros(256, 256), torch.zeros(256, 256)
    for style, (x_red, w_red, g_in_red, g_w_red) in expected.items():
        layout = _layout(style)
        assert (layout.amax_reduce(specs.forward[INPUT], x) is not None) == x_red, (style, "input")
        assert (layout.amax_reduce(specs.forward[WEIGHT], w) is not None) == w_red, (style, "weight")
        assert (layout.amax_reduce(specs.grad_input[0], g) is not None) == g_in_red, (style, "grad_output/grad_input")
        assert (layout.amax_reduce(specs.grad_weight[0], g) is not None) == g_w_red, (style, "grad_output/grad_weight")
        assert specs.grad_input[0].role == specs.grad_weight[0].role == GRAD_OUTPUT


def test_tensor_parallel_blocks_must_not_span_ranks():
    spec = resolve_recipe("blockwise").cast_specs().forward[WEIGHT]  # 128 x 128 blocks
    with pytest.raises(ValueError, match="not a multiple of the recipe's 128-element blocks"):
        _layout("colwise").amax_reduce(spec, torch.zeros(192, 256))  # 192 rows of the weight on this rank


def test_prepare_for_sharding_needs_an_fp8_plugin():
    with pytest.raises(ValueError, match="found no FP8 plugin"):
        lf.prepare_for_sharding(nn.Sequential(nn.Linear(32, 32)))


def test_prepare_for_sharding_with_a_plugin_converts_and_prepares():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 48))
    plugin = lf.fabric.FP8Precision(recipe="delayed")
    assert lf.prepare_for_sharding(model, plugin) == ["0", "2"]
    assert all(isinstance(m.weight, FP8ShardedWeight) for m in model if isinstance(m, lf.FP8Linear))
    assert plugin.fp8_models == [model]
    blocks = nn.Sequential(nn.Linear(32, 32))
    assert lf.prepare_for_sharding(blocks, lf.fabric.FP8Precision(recipe="rowwise")) == []  # gathers high precision
    assert type(blocks[0].weight) is nn.Parameter and isinstance(blocks[0], lf.FP8Linear)


# ------------------------------------------------------------------ in-process, one rank (a real process group)


def test_fsdp1_modules_are_refused_with_a_pointer_to_fsdp2():
    plugin = lf.fabric.FP8Precision()
    fsdp1 = type("FullyShardedDataParallel", (nn.Module,), {})  # the check reads the wrapper's class name
    model = nn.Sequential(fsdp1())
    model[0].add_module("layer", nn.Linear(32, 32))
    with pytest.raises(ValueError, match="FSDP1.*ModelParallelStrategy.*prepare_for_sharding"):
        plugin.convert_module(model)


def test_fsdp2_on_one_rank_trains_like_the_unsharded_model(one_rank_group):
    """fully_shard on a one-rank mesh runs every FSDP2 code path (pre/post all-gather, the unsharded FP8 weight, the
    scale all-reduce) in-process: the losses are bit-identical to the unsharded model's, tensorwise and delayed."""
    from torch.distributed.fsdp import fully_shard

    for recipe in ("tensorwise", "delayed"):
        torch.manual_seed(0)
        sharded = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        plain.load_state_dict(sharded.state_dict())
        results = []
        for model, shard in ((sharded, True), (plain, False)):
            plugin = lf.fabric.FP8Precision(recipe=recipe)
            if shard:
                assert lf.prepare_for_sharding(model, plugin) == ["0", "2"]
                fully_shard(model[0]), fully_shard(model[2]), fully_shard(model)
                plugin.convert_module(model)  # what Lightning does after configure_model: verifies, converts nothing
                assert all(m._fp8_sharded for m in model if isinstance(m, lf.FP8Linear))
            else:
                plugin.convert_module(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            torch.manual_seed(1)
            for _ in range(3):
                loss = _train_step(model, plugin, optimizer, torch.randn(16, 32))
                losses.append(loss.item())
            results.append((losses, lf.fp8_state_dict(model)))
        assert results[0][0] == results[1][0], recipe
        for name, layer in per_layer(results[0][1]).items():
            other = per_layer(results[1][1])[name]
            assert torch.equal(layer["amax_history"], other["amax_history"]), (recipe, name)
        plain_sharded = _sharded_plain_fp8(recipe)
        with pytest.raises(ValueError, match="sharded already"):
            enable_fp8_all_gather(plain_sharded)
        # a sharded weight reached without FSDP2's hooks (a child called directly) is not taken for tensor parallelism
        with lf.fp8_autocast(), pytest.raises(ValueError, match="sharded weight .* and a plain input"):
            plain_sharded[0](torch.randn(4, 32))
        assert plain_sharded(torch.randn(4, 32)).shape == (4, 32)  # through the root: gathered first


def _sharded_plain_fp8(recipe):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(32, 32))
    lf.convert_to_fp8(model, recipe=recipe, log_summary=False)
    fully_shard(model)
    return model


TP_RECIPES = "tensorwise,delayed,rowwise,blockwise,mxfp8"


@pytest.mark.slow
@pytest.mark.gloo(f"tp_layers/{TP_RECIPES}")
def test_tensor_parallel_layers_match_the_unsharded_layers_for_every_recipe(gloo_runs):
    """Column-wise then row-wise FP8 layers on 2 ranks (tests/scripts/tp_layers.py): weight gradients bit-identical to
    the unsharded layers' for every recipe (every scale agreed across the group), outputs and input gradients within
    FP8's error of them (row-wise layers sum partial products across ranks: another rounding)."""
    recipes = TP_RECIPES
    results = torch.load(gloo_runs.folder(f"tp_layers/{recipes}") / "tp_layers.pt", weights_only=True)
    assert list(results) == recipes.split(",")
    for recipe, result in results.items():
        assert result["grad_weight_equal_0"] and result["grad_weight_equal_2"], recipe
        assert result["output_sqnr"] > 40 and result["grad_input_sqnr"] > 40, (recipe, result)  # FP8 itself: ~28 dB
        if recipe in ("tensorwise", "delayed"):  # per-tensor weight scale: the whole weight's on every rank
            assert result["weight_scale_equal_0"] and result["weight_scale_equal_2"], recipe


@pytest.mark.gloo(f"tp_layers/{TP_RECIPES}")
def test_tensor_parallel_layers_compiled_match_eager_bitwise_on_two_ranks(gloo_runs):
    """Column-wise then row-wise FP8 layers compiled by inductor on 2 ranks, with biases under bf16 autocast and as a
    bf16 model without biases: outputs, input and parameter gradients bit-identical to the eager tensor-parallel
    layers over two steps (the roundings of tests/test_compiled_rounding.py, on the local tensors). The bias-free and
    bf16 setups failed to compile (an in-place all-reduce on the rounded GEMM output's 16-bit view)."""
    equal = torch.load(gloo_runs.folder(f"tp_layers/{TP_RECIPES}") / "tp_compiled.pt", weights_only=True)
    # two steps: output, input gradient, 4 parameter gradients with biases, 2 without
    assert len(equal) == 2 * 6 + 2 * 4, equal
    assert all(equal.values()), [name for name, same in equal.items() if not same]


FSDP2_COMPILED_RECIPES = "tensorwise,delayed,rowwise"


@pytest.mark.gloo(f"fsdp2_compiled/{FSDP2_COMPILED_RECIPES}")
def test_fsdp2_blocks_compiled_by_inductor_match_eager_bitwise_on_two_ranks(gloo_runs):
    """FSDP2 on 2 ranks, bf16 parameters, each block compiled by inductor with ``fullgraph=True``, two micro-batches
    per step (tests/scripts/fsdp2_compiled.py): no graph compiled after the first step, and the outputs, the gathered
    gradients and the amax histories bit-identical to the same sharded blocks eager, for the recipes that gather in FP8
    (``tensorwise``, ``delayed``: they recompiled at every step before) and one that gathers bf16 (``rowwise``)."""
    results = torch.load(gloo_runs.folder(f"fsdp2_compiled/{FSDP2_COMPILED_RECIPES}") / "fsdp2_compiled.pt")
    assert list(results) == FSDP2_COMPILED_RECIPES.split(",")
    for recipe, result in results.items():
        assert not result["recompiled"], recipe
        assert result["equal"] and result["compared"] == 3 * (2 + 4) + 1, (recipe, result)


@pytest.mark.gloo("fsdp2_train/delayed/compiled")
def test_trainer_fsdp2_blocks_compiled_in_configure_model_compile_once(gloo_runs):
    """Through the Trainer (``ModelParallelStrategy``, 2 ranks, ``delayed``, FP8 all-gather): each block compiled in
    ``configure_model`` after ``fully_shard``, two micro-batches per optimizer step, 4 steps. One graph for the whole
    run (the blocks share it; before the fix a graph per step: 7 in 4 steps, then torch's recompile limit), and the
    losses and amax histories are those of the same run eager, bit for bit (``aot_eager``)."""
    result = load(gloo_runs.folder("fsdp2_train/delayed/compiled") / "compiled.pt")
    assert result["graphs"] == 1
    assert len(result["eager"]["losses"]) == 8 and result["compiled"]["losses"] == result["eager"]["losses"]
    eager, compiled = (per_layer(result[run]["fp8"]) for run in ("eager", "compiled"))
    assert list(compiled) == [name.replace("blocks.0.", "blocks.0._orig_mod.").replace("blocks.1.", "blocks.1._orig_mod.") for name in eager]
    for (_, a), (_, b) in zip(eager.items(), compiled.items()):
        assert torch.equal(a["amax_history"], b["amax_history"]) and torch.equal(a["scale"], b["scale"])


def test_fsdp1_strategies_refuse_the_plugin():
    """Lightning's FSDP (FSDP1) strategies accept only their own FSDPPrecision: the TypeError the docs quote (on a CPU,
    Lightning refuses strategy="fsdp" even earlier, for the accelerator)."""
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(TypeError, match="can only work with the `FSDPPrecision` plugin"):
        FSDPStrategy(precision_plugin=lf.FP8Precision())
    with pytest.raises(TypeError, match="FSDPPrecision"):
        FabricFSDP(precision=lf.fabric.FP8Precision())


def test_a_tied_weight_stays_tied_and_gathers_in_high_precision():
    """An LM head sharing the embedding's weight: wrapping it for FP8 all-gather would untie the two (and hand the
    embedding an FP8-gathered weight); it is left as it is."""
    model = nn.ModuleDict({"embed": nn.Embedding(64, 32), "mid": nn.Linear(32, 32), "head": nn.Linear(32, 64, bias=False)})
    model["head"].weight = model["embed"].weight
    assert lf.prepare_for_sharding(model, lf.fabric.FP8Precision()) == ["mid"]
    assert model["head"].weight is model["embed"].weight and type(model["head"].weight) is nn.Parameter
    assert isinstance(model["head"], lf.FP8Linear) and isinstance(model["mid"].weight, FP8ShardedWeight)


def test_a_layer_switched_to_high_precision_under_fp8_all_gather_warns_and_trains(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    plugin = lf.fabric.FP8Precision()
    lf.prepare_for_sharding(model, plugin)
    fully_shard(model[0]), fully_shard(model[2]), fully_shard(model)
    plugin.convert_module(model)
    with pytest.warns(UserWarning, match="'0' switches to high precision, but FSDP2 gathers its weight in FP8"):
        plugin.keep_in_high_precision("0")
    assert type(model[0]).__name__ != "FP8Linear" and isinstance(model[2], lf.FP8Linear)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        with plugin.forward_context():
            loss = model(torch.randn(8, 32)).float().square().mean()
        loss.backward()
        plugin.optimizer_step(optimizer)
        optimizer.zero_grad()
        assert torch.isfinite(loss)


def _example_run(workdir):
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "fsdp2_fp8.py")
    args = [sys.executable, script, "--steps", "3", "--tensor-parallel", "2", "--checkpoint", str(workdir / "ckpt")]
    return {"args": args, "cwd": workdir, "env": {**os.environ, "OMP_NUM_THREADS": "1"}, "timeout": 600}


@pytest.fixture
def example_run(early_runs):
    return early_runs.result(__name__, "example_run")


@pytest.mark.slow
def test_the_fsdp2_example_runs(example_run):
    """examples/fsdp2_fp8.py, shortened: tensor parallel 2 on 2 CPU processes (the 2-D mesh: FSDP2 and TP); started
    early (tests/conftest.py)."""
    proc, tmp_path = example_run, example_run.workdir
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "after 3 steps; distributed checkpoint" in proc.stdout
    assert (tmp_path / "ckpt" / ".metadata").exists()


def test_a_one_device_checkpoint_resumes_into_an_fsdp2_model_and_back(one_rank_group):
    """fully_shard gives the model a new class (FSDP<name>): the plugin state's model check must see the same model."""
    from torch.distributed.fsdp import fully_shard

    from models import TinyDecoder

    torch.manual_seed(0)
    plain, sharded = TinyDecoder(layers=1), TinyDecoder(layers=1)
    source = lf.fabric.FP8Precision(recipe="delayed")
    source.convert_module(plain)
    with source.forward_context():
        plain(torch.randint(0, 256, (2, 32))).float().sum().backward()
    source.after_optimizer_step()
    state = source.state_dict()
    target = lf.fabric.FP8Precision(recipe="delayed")
    lf.prepare_for_sharding(sharded, target)
    fully_shard(sharded)
    target.convert_module(sharded)
    assert type(sharded).__name__ == "FSDPTinyDecoder"
    target.load_state_dict(state)  # no "set the models up in the same order" error
    assert torch.equal(lf.fp8_state_dict(sharded)["tables"][0]["amax_history"], lf.fp8_state_dict(plain)["tables"][0]["amax_history"])
    assert target.state_dict()["model_classes"] == ["TinyDecoder"]  # and back: the sharded run saves the plain name


def test_weights_changed_outside_the_optimizer_step_get_fresh_gather_scales(one_rank_group):
    """load_state_dict between steps (or weights swapped in for evaluation): the next forward's FP8 all-gather uses the
    new weights' scales, so the sharded model computes exactly as the unsharded one with the same weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    sharded, plain = (nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
    plain.load_state_dict(sharded.state_dict())
    big = {k: v * 10 for k, v in plain.state_dict().items()}  # amaxes 10x: the old scales would saturate
    plugins = [lf.fabric.FP8Precision(), lf.fabric.FP8Precision()]
    lf.prepare_for_sharding(sharded, plugins[0])
    fully_shard(sharded[0]), fully_shard(sharded[2]), fully_shard(sharded)
    plugins[0].convert_module(sharded)
    plugins[1].convert_module(plain)
    x = torch.randn(8, 32)
    outputs = []
    for model, plugin in zip((sharded, plain), plugins):
        with torch.no_grad(), plugin.forward_context():
            first = model(x)
        if model is sharded:  # no optimizer step in between
            set_model_state_dict(model, dict(big), options=StateDictOptions(full_state_dict=True))
        else:
            model.load_state_dict(big)
        with torch.no_grad(), plugin.forward_context():
            outputs.append((first, model(x)))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])


# ------------------------------------------------------------------- what an adversarial review found (one rank)


def _twin_models(recipe, shard_children=True, plugin_kwargs=None):
    """A model sharded with FP8 all-gather (children and root, or the root alone: FSDP2 then keeps its parameters
    unsharded after forward) and the same model unsharded, each with its own plugin, set up as Lightning does."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    sharded, plain = (nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
    plain.load_state_dict(sharded.state_dict())
    plugins = [lf.fabric.FP8Precision(recipe=recipe, **(plugin_kwargs or {})) for _ in range(2)]
    lf.prepare_for_sharding(sharded, plugins[0])
    if shard_children:
        fully_shard(sharded[0]), fully_shard(sharded[2])
    fully_shard(sharded)
    plugins[0].convert_module(sharded)
    plugins[1].convert_module(plain)
    return (sharded, plugins[0]), (plain, plugins[1])


def _train_step(model, plugin, optimizer, x):
    """One training step as the plugin runs it: forward in its context, backward, optimizer step; the loss."""
    with plugin.forward_context():
        loss = model(x).float().square().mean()
    loss.backward()
    plugin.optimizer_step(optimizer)
    optimizer.zero_grad()
    return loss


def _weight_rows(model):
    """Every FP8 layer's weight amax history and counters (what the statistics callback reads)."""
    tables = lf.fp8_state_dict(model)["tables"]
    return [(t["amax_history"][:, WEIGHT].clone(), t["counts"][:, WEIGHT].clone()) for t in tables]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("shard_children", [True, False])
def test_evaluation_between_steps_keeps_fsdp2_runs_identical_to_unsharded(recipe, shard_children, one_rank_group):
    """Validation between training steps (eval forwards under no_grad, twice), and two forwards before one backward:
    with the root owning parameters FSDP2 keeps them unsharded after forward. The sharded run's losses, evaluation
    outputs, weight statistics and scales are the unsharded run's, bit for bit (the eval forward must neither break
    the next step's scale precompute nor swallow the next training step's weight statistics)."""
    runs = []
    for model, plugin in _twin_models(recipe, shard_children):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        seen = []
        for _ in range(3):
            model.eval()
            for _ in range(2):
                with torch.no_grad(), plugin.forward_context():
                    seen.append(model(torch.randn(8, 32)))
            model.train()
            with plugin.forward_context():
                loss = model(torch.randn(16, 32)).float().square().mean()
                loss = loss + model(torch.randn(16, 32)).float().square().mean()
            loss.backward()
            plugin.optimizer_step(optimizer)
            optimizer.zero_grad()
            seen.append(loss.detach())
        runs.append((seen, _weight_rows(model)))
    (seen_s, rows_s), (seen_p, rows_p) = runs
    for a, b in zip(seen_s, seen_p):
        assert torch.equal(a, b)
    for (hist_s, counts_s), (hist_p, counts_p) in zip(rows_s, rows_p):
        assert torch.equal(hist_s, hist_p) and torch.equal(counts_s, counts_p)
        assert (hist_s[:, :3] > 0).all()  # every training step recorded the weights' amaxes


def test_an_explicit_unshard_gathers_with_the_weights_scales(one_rank_group):
    """``model.unshard()`` (FSDP2's API to gather ahead) before the first forward and between an optimizer step and
    the next forward: the gather happens before the plugin's forward context, and must still use fresh scales."""
    (sharded, plugin), (plain, plain_plugin) = _twin_models("tensorwise", shard_children=False)
    x = torch.randn(8, 32)
    outs = []
    for model, p in ((sharded, plugin), (plain, plain_plugin)):
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # large steps: stale scales would show
        seen = []
        for step in range(3):
            if model is sharded:
                model.unshard()
            with p.forward_context():
                out = model(x)
            out.float().square().sum().backward()
            p.optimizer_step(optimizer)
            optimizer.zero_grad()
            seen.append(out.detach())
        outs.append(seen)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_weights_swapped_through_data_for_evaluation_get_fresh_gather_scales(recipe, one_rank_group):
    """An EMA / weight-averaging swap around validation writes the parameters through ``.data`` (Lightning's
    WeightAveraging does), which moves no version counter: the evaluation forwards and the next training forward
    gather with the scales of the weights they compute with, exactly as the unsharded model casts them."""
    outs = []
    for model, plugin in _twin_models(recipe):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        seen = []
        for step in range(2):
            _train_step(model, plugin, optimizer, torch.randn(16, 32))
            model.eval()
            saved = [p.data.clone() for p in model.parameters()]
            for p in model.parameters():
                p.data.copy_(p.data * 10)  # the averaged weights (amaxes 10x: stale scales saturate)
            with torch.no_grad(), plugin.forward_context():
                seen.append(model(torch.randn(8, 32)))
            for p, s in zip(model.parameters(), saved):
                p.data.copy_(s)
            model.train()
            with torch.no_grad(), plugin.forward_context():
                seen.append(model(torch.randn(8, 32)))
        outs.append(seen)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_empty_shards_gather_and_scale_without_crashing():
    """FSDP2 chunks dim 0 into ceil(rows / ranks) rows, so on many ranks the last shards are empty: the scale
    precompute gives them an amax of 0 (still one all-reduce entry each, so no rank waits alone), and their
    pre-all-gather sends the padding only, with no statistics."""
    spec = resolve_recipe("tensorwise").cast_specs().forward[WEIGHT]
    full = FP8ShardedWeight(torch.randn(16, 32), spec)
    empty = FP8ShardedWeight(torch.empty(0, 32), spec)
    precompute_fp8_weight_scales([empty, full])
    assert torch.equal(empty._scale, quantize(torch.zeros(1, 32), spec).scale)  # what an all-zero weight gets
    assert torch.equal(full._scale, quantize(full._tensor, spec).scale)
    mesh = SimpleNamespace(size=lambda: 32)
    (data,), (dtype, scale, stats) = empty.fsdp_pre_all_gather(mesh, torch.Size([16, 32]), (32, 1), nn.Linear(32, 16), None)
    assert data.shape == (1, 32) and data.dtype == torch.uint8 and stats is None and dtype == spec.dtype


def test_a_shard_placement_other_than_dim_0_is_refused_clearly():
    """FSDP2's ``shard_placement_fn`` may shard a weight on dim 1 (each rank then holds some columns); the FP8
    all-gather pads and concatenates rows (dim 0), so such a shard is refused with the way out, not gathered wrong."""
    spec = resolve_recipe("tensorwise").cast_specs().forward[WEIGHT]
    columns = FP8ShardedWeight(torch.randn(64, 16), spec)
    with pytest.raises(ValueError, match="sharded on dim 0.*Shard\\(1\\).*fp8_all_gather=False"):
        columns.fsdp_pre_all_gather(SimpleNamespace(size=lambda: 2), torch.Size([64, 32]), (32, 1), nn.Linear(32, 64), None)


def test_meta_device_initialisation_keeps_the_fp8_all_gather(one_rank_group):
    """The recipe for large models: build on the meta device, prepare, shard, then ``to_empty`` and initialise. The
    weights still gather in FP8 and the model computes as one initialised the same way without sharding."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    plugin = lf.fabric.FP8Precision()
    lf.prepare_for_sharding(model, plugin)
    fully_shard(model[0]), fully_shard(model[2]), fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in (model[0], model[2]):
        layer.reset_parameters()
    plugin.convert_module(model)
    assert all(isinstance(m.weight._local_tensor, FP8ShardedWeight) for m in (model[0], model[2]))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    plain_plugin = lf.fabric.FP8Precision()
    plain_plugin.convert_module(plain)
    with torch.no_grad():
        for a, b in zip(plain.parameters(), model.parameters()):
            a.copy_(b.full_tensor())
    x = torch.randn(8, 32)
    with plugin.forward_context():
        out = model(x)
    with plain_plugin.forward_context():
        ref = plain(x)
    assert torch.equal(out, ref)


def test_weights_replaced_after_preparation_warn_with_the_right_advice(one_rank_group):
    """``load_state_dict(assign=True)`` on a prepared, sharded model replaces the FP8 all-gather weights with plain
    ones: the plugin says so (not "call prepare_for_sharding", which was called), and the model still trains."""
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    plugin = lf.fabric.FP8Precision()
    lf.prepare_for_sharding(model, plugin)
    fully_shard(model)
    model.load_state_dict(model.state_dict(), assign=True)
    with pytest.warns(UserWarning, match=r"2 FP8 layer\(s\) \(0, 2\) were prepared .* lost it afterwards.*assign"):
        plugin.convert_module(model)
    with plugin.forward_context():
        out = model(torch.randn(8, 32))
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------- a second adversarial review (one rank, 2 ranks)


@pytest.mark.parametrize("change", ["clip", "scale"])
def test_weights_changed_through_data_after_the_step_get_fresh_gather_scales(change, one_rank_group):
    """WGAN weight clipping (``p.data.clamp_``) or a renormalisation through ``.data`` right after the optimizer step:
    the next gather must cast with the changed weights' scales, as the unsharded layers cast them."""
    outs = []
    for model, plugin in _twin_models("tensorwise"):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        seen = []
        for _ in range(3):
            with plugin.forward_context():
                out = model(torch.randn(16, 32))
            out.float().square().mean().backward()
            plugin.optimizer_step(optimizer)
            optimizer.zero_grad()
            for p in model.parameters():
                p.data.clamp_(-0.05, 0.05) if change == "clip" else p.data.mul_(4.0)
            seen.append(out.detach())
        with plugin.forward_context():
            seen.append(model(torch.randn(16, 32)).detach())
        outs.append(seen)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_submodule_evaluated_alone_with_swapped_weights_gets_fresh_gather_scales(one_rank_group):
    """Only a submodule is put in eval mode, and its weights swapped through ``.data``: the layer's own training flag
    tells, and the shared scales change while earlier layers' FP8 weights are saved for their backward (each gather
    keeps the scale it was cast with)."""
    from torch.distributed.fsdp import fully_shard

    class EncDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = nn.Sequential(nn.Linear(32, 64), nn.GELU()), nn.Sequential(nn.Linear(64, 32))

        def forward(self, x):
            return self.dec(self.enc(x))

    torch.manual_seed(0)
    sharded, plain = EncDec(), EncDec()
    plain.load_state_dict(sharded.state_dict())
    plugins = [lf.fabric.FP8Precision(), lf.fabric.FP8Precision()]
    lf.prepare_for_sharding(sharded, plugins[0])
    fully_shard(sharded.enc), fully_shard(sharded.dec), fully_shard(sharded)
    plugins[0].convert_module(sharded), plugins[1].convert_module(plain)
    outs = []
    for model, plugin in zip((sharded, plain), plugins):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        seen = []
        for _ in range(3):
            loss = _train_step(model, plugin, optimizer, torch.randn(16, 32))
            model.dec.eval()
            saved = [p.data.clone() for p in model.dec.parameters()]
            for p in model.dec.parameters():
                p.data.mul_(3.0)
            with torch.no_grad(), plugin.forward_context():
                seen.append(model.dec(torch.randn(8, 64)))
            for p, s in zip(model.dec.parameters(), saved):
                p.data.copy_(s)
            model.dec.train()
            seen.append(loss.detach())
        outs.append(seen)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_restoring_an_older_plugin_state_regathers_weights_held_by_the_root(one_rank_group):
    """``delayed``: the root holds its gathered weights after an evaluation forward, cast with the history scale of
    the moment; restoring an older plugin state must not leave them in use."""
    outs = []
    for model, plugin in _twin_models("delayed", shard_children=False):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        torch.manual_seed(1)
        seen, older = [], None
        for step in range(4):
            if step == 1:
                older = plugin.state_dict()
            with plugin.forward_context():
                out = model(torch.randn(16, 32))
            out.float().square().mean().backward()
            plugin.optimizer_step(optimizer)
            optimizer.zero_grad()
            seen.append(out.detach())
        model.eval()
        with torch.no_grad(), plugin.forward_context():
            seen.append(model(torch.randn(8, 32)))
        model.train()
        plugin.load_state_dict(older)
        with plugin.forward_context():
            seen.append(model(torch.randn(16, 32)).detach())
        outs.append(seen)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8_all_gather", [True, False])
def test_calibration_with_a_loss_runs_the_backward_of_a_sharded_model(fp8_all_gather, one_rank_group):
    """``calibrate(..., loss_fn)`` under FSDP2: the parameters handed to the backward are the sharded ones, which the
    graph does not hold; the grad_output histories must still fill as on the unsharded model, no gradient may be
    left behind, and the root must not stay gathered (an optimizer created afterwards gets the sharded parameters)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    sharded, plain = (nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
    plain.load_state_dict(sharded.state_dict())
    plugins = [lf.fabric.FP8Precision(recipe="delayed"), lf.fabric.FP8Precision(recipe="delayed")]
    lf.prepare_for_sharding(sharded, plugins[0], fp8_all_gather=fp8_all_gather)
    fully_shard(sharded[0]), fully_shard(sharded)  # the root owns the last layer
    plugins[0].convert_module(sharded), plugins[1].convert_module(plain)
    histories = []
    for model, plugin in zip((sharded, plain), plugins):
        torch.manual_seed(5)
        batches = [torch.randn(16, 32) * (i + 1) for i in range(3)]
        lf.calibrate(model, batches, lambda out, batch: out.float().square().mean(), precision=plugin)
        histories.append(lf.fp8_state_dict(model)["tables"][0]["amax_history"])
        assert all(p.grad is None for p in model.parameters())
    assert (histories[1][:, GRAD_OUTPUT, :3] > 0).all()
    assert torch.equal(histories[0], histories[1])
    assert all(isinstance(p, DTensor) for p in sharded.parameters())


_ONE_RANK_EVALUATES = r'''
import copy, datetime, os, sys, torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
import lightning_fp8 as lf

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
sharded = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
probe = nn.Sequential(nn.Linear(32, 32))  # a second model set up with the same plugin, not sharded
plugin = lf.fabric.FP8Precision()
lf.prepare_for_sharding(sharded, plugin)
prepared_copy = copy.deepcopy(sharded)  # prepared for FP8 all-gather but never sharded: its weights never gather
fully_shard(sharded[0]), fully_shard(sharded[2]), fully_shard(sharded)
plugin.convert_module(sharded), plugin.convert_module(probe)
optimizer = torch.optim.SGD(sharded.parameters(), lr=1e-2)
probe_optimizer = torch.optim.Adam(probe.parameters(), lr=1e-2, fused=True)
copy_plugin = lf.fabric.FP8Precision()
copy_plugin.convert_module(prepared_copy)
copy_optimizer = torch.optim.Adam(prepared_copy.parameters(), lr=1e-2, fused=True)
for step in range(3):
    with plugin.forward_context():
        out = sharded(torch.randn(8, 32))
    if rank == 0:  # between the forward's gathers and the backward's: a step of another model's own optimizer,
        # outside the plugin, with no FP8 all-gather weight in it: the gather scales' decision (a collective) must
        # not change on this rank alone
        probe(torch.randn(4, 32)).square().mean().backward()
        probe_optimizer.step()
        probe_optimizer.zero_grad()
        with copy_plugin.forward_context():  # and the prepared, unsharded copy: its weights never gather either
            prepared_copy(torch.randn(4, 32)).float().square().mean().backward()
        copy_optimizer.step()
        copy_optimizer.zero_grad()
    plugin.backward(out.float().square().mean(), sharded)
    plugin.optimizer_step(optimizer)
    optimizer.zero_grad()
    if rank == 0:  # rank-zero sampling / logging with another model: after a step, and with a mode switch
        probe.eval()
        with torch.no_grad(), plugin.forward_context():
            probe(torch.randn(4, 32))
        probe.train()
dist.barrier()
print("finished", rank)
'''


# starts both ranks of a script, each with its output in files, and records each one's exit code
_TWO_RANKS = """
import subprocess, sys
script, store, out = sys.argv[1:]
procs = []
for rank in (0, 1):
    with open(f"{out}/rank{rank}.out", "w") as stdout, open(f"{out}/rank{rank}.err", "w") as stderr:
        procs.append(subprocess.Popen([sys.executable, script, str(rank), store], stdout=stdout, stderr=stderr))
for rank, p in enumerate(procs):
    code = p.wait()
    with open(f"{out}/rank{rank}.code", "w") as f:
        f.write(str(code))
"""


def _one_rank_run(workdir):
    script = workdir / "one_rank_evaluates.py"
    script.write_text(_ONE_RANK_EVALUATES)
    args = [sys.executable, "-c", _TWO_RANKS, str(script), str(workdir / "store"), str(workdir)]
    return {"args": args, "cwd": workdir, "env": {**os.environ, "OMP_NUM_THREADS": "1"}, "timeout": 300}


TWO_D, HSDP = "fsdp2_2d/delayed", "fsdp2_fabric/tensorwise/hsdp"  # the checks of the 4-process launch


def _two_d_run(workdir):
    """tests/scripts/gloo_checks.py with 4 processes: 2-D (data parallel 2 x tensor parallel 2) and HSDP."""
    return gloo_launch(workdir, [TWO_D, HSDP], world=4, timeout=600)


# started when collection ends and run while other tests run (tests/conftest.py, "subprocesses started early")
EARLY_RUNS = {
    "consolidate_run": _consolidate_run, "example_run": _example_run, "one_rank_run": _one_rank_run, "two_d_runs": _two_d_run,
}  # fmt: skip


@pytest.fixture
def two_d_runs(early_runs):
    run = early_runs.result(__name__, "two_d_runs")
    return GlooRuns(run.workdir / "checks", [TWO_D, HSDP], run)


@pytest.mark.slow
@pytest.mark.gloo(TRAINER_SINGLE)
def test_trainer_two_dimensional_parallelism_matches_one_process_and_gathers_fp8(gloo_runs, two_d_runs):
    """Data parallel 2 x tensor parallel 2 on 4 processes, ``delayed``: the losses of one process on the same global
    batches; at every forward (training and validation) each FP8-gathered weight is bit for bit the cast of its
    tensor-parallel piece by the scale of the whole weight (the history's once it has one); all ranks agree on every
    amax history and scale."""
    folder = two_d_runs.folder(TWO_D)
    ranks = [load(folder / f"rank{rank}.pt") for rank in range(4)]
    single = load(gloo_runs.folder(TRAINER_SINGLE) / "single.pt")
    assert_losses_close(ranks[0]["losses"], single["losses"])
    assert_losses_close(ranks[0]["val_losses"], single["val_losses"])
    placements = ranks[0]["placements"]  # (data parallel, tensor parallel) while sharded
    assert placements["blocks.0.fc"] == ["_S(0, 2)", "S(0)"] and placements["blocks.0.out"] == ["S(0)", "S(1)"]
    forwards = len(single["losses"]) + len(single["val_losses"])
    for rank, result in enumerate(ranks):
        assert len(result["checks"]) == 9 * forwards, rank  # 9 FP8 layers, every forward checked
        wrong = [row for row in result["checks"] if not (row[1] and row[2])]
        assert not wrong, (rank, wrong[:5])
        for table, first in zip(result["fp8"]["tables"], ranks[0]["fp8"]["tables"]):
            for key in ("amax_history", "scale", "initialized"):
                assert torch.equal(table[key], first[key]), (rank, key)


@pytest.fixture
def one_rank_run(early_runs):
    return early_runs.result(__name__, "one_rank_run")


@pytest.mark.slow
def test_one_rank_running_another_model_alone_does_not_hang_the_gather_scales(one_rank_run):
    """The scales' all-reduce is decided where FSDP2 gathers (every rank gathers), never in a forward or an optimizer
    step that one rank runs alone; 2 processes on gloo, a 60 s collective timeout turns a hang into a failure (started early:
    tests/conftest.py)."""
    for rank in (0, 1):
        code, stdout, stderr = (one_rank_run.workdir / f"rank{rank}.{kind}" for kind in ("code", "out", "err"))
        code, stdout, stderr = (p.read_text() if p.exists() else None for p in (code, stdout, stderr))
        assert code == "0" and f"finished {rank}" in stdout, (code, stderr and stderr[-4000:], one_rank_run.stderr[-2000:])


def test_layers_wrapped_without_prepare_for_sharding_still_get_their_scales(one_rank_group):
    """``enable_fp8_all_gather`` called directly (not through ``prepare_for_sharding``): the plugin finds the wrapped
    layers when it checks the sharded model, so their gathers use computed scales, as the unsharded layers' casts."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    sharded, plain = (nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
    plain.load_state_dict({k: v * 10 for k, v in sharded.state_dict().items()})  # amaxes far from a unit scale's
    sharded.load_state_dict(plain.state_dict())
    plugins = [lf.fabric.FP8Precision(), lf.fabric.FP8Precision()]
    plugins[0].convert_module(sharded)
    assert enable_fp8_all_gather(sharded) == ["0", "2"]
    fully_shard(sharded[0]), fully_shard(sharded[2]), fully_shard(sharded)
    plugins[0].convert_module(sharded)
    plugins[1].convert_module(plain)
    outs = []
    for model, plugin in zip((sharded, plain), plugins):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        outs.append([_train_step(model, plugin, optimizer, torch.randn(16, 32)).detach() for _ in range(3)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# ------------------------------------------------------------------- an optimizer step the plugin does not see


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_a_fused_optimizer_stepped_outside_the_plugin_gets_fresh_gather_scales(recipe, one_rank_group):
    """A Fabric loop that steps its optimizer itself (``optimizer.step()``, not through the plugin) with a fused
    optimizer, whose kernels move no version counter: the next gather must cast with the stepped weights' scales, as
    the unsharded layers cast them (before, the sharded layers gathered every step with the first step's scales)."""
    outs = []
    for model, plugin in _twin_models(recipe):
        optimizer = torch.optim.Adam(model.parameters(), lr=0.5, fused=True)  # large steps: stale scales would show
        outs.append(_outputs_with_raw_steps(model, plugin, optimizer)[0])  # optimizer.step(), not the plugin's
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _outputs_with_raw_steps(model, plugin, optimizer, steps=3, plugin_steps=()):
    """Train ``steps`` steps stepping ``optimizer`` itself (the plugin does not see it), except the steps in
    ``plugin_steps``, which go through ``plugin.optimizer_step``; the outputs and the FP8 amax histories."""
    torch.manual_seed(1)
    seen = []
    for step in range(steps):
        with plugin.forward_context():
            out = model(torch.randn(16, 32))
        out.float().square().mean().backward()
        plugin.optimizer_step(optimizer) if step in plugin_steps else optimizer.step()
        optimizer.zero_grad()
        seen.append(out.detach())
    return seen, [t["amax_history"].clone() for t in lf.fp8_state_dict(model)["tables"]]


def test_an_optimizer_given_the_gathered_weights_after_its_first_step_is_seen(one_rank_group):
    """An optimizer stepped first over other parameters, then given the sharded weights in place of them (the same
    number of parameters): its steps update the gathered weights, and their scales follow (fresh-eyes review: the
    optimizer's first answer was kept while the parameter count stayed the same)."""
    runs = []
    for model, plugin in _twin_models("tensorwise"):
        placeholders = [nn.Parameter(torch.zeros(1)) for _ in model.parameters()]
        optimizer = torch.optim.Adam(placeholders, lr=0.5, fused=True)
        for p in placeholders:
            p.grad = torch.zeros(1)
        optimizer.step()
        optimizer.param_groups[0]["params"] = list(model.parameters())
        optimizer.state.clear()
        runs.append(_outputs_with_raw_steps(model, plugin, optimizer)[0])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_delayed_records_the_gathered_weight_after_a_step_the_plugin_does_not_see(one_rank_group):
    """``delayed``: a raw fused step, then a plugin step. The gathered weight's statistics are recorded once per
    optimizer step: after the raw step the new weights' amaxes must enter the history, as the unsharded layers record
    them (fresh-eyes review: the record was keyed on the table generation alone, which a raw step does not move)."""
    runs = []
    for model, plugin in _twin_models("delayed"):
        optimizer = torch.optim.Adam(model.parameters(), lr=0.5, fused=True)
        runs.append(_outputs_with_raw_steps(model, plugin, optimizer, steps=4, plugin_steps=(1, 3)))
    (outs_s, hist_s), (outs_p, hist_p) = runs
    for a, b in zip(outs_s, outs_p):
        assert torch.equal(a, b)
    for a, b in zip(hist_s, hist_p):
        assert torch.equal(a[:, WEIGHT], b[:, WEIGHT])


def test_only_an_optimizer_of_sharded_fp8_all_gather_weights_moves_the_gather_scales(one_rank_group):
    """A copy of a prepared model taken before ``fully_shard`` holds plain FP8ShardedWeight parameters that are never
    gathered: its optimizer's steps (which one rank may run alone) must not make the shared scales stale, or that
    rank would enter the scales' all-reduce alone (the two-process check below hangs on it)."""
    import copy

    from torch.distributed.fsdp import fully_shard

    from lightning_fp8.distributed import _updates_gathered_weights

    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    lf.prepare_for_sharding(model, lf.fabric.FP8Precision())
    copy_before_sharding = copy.deepcopy(model)
    fully_shard(model[0]), fully_shard(model[2]), fully_shard(model)
    assert _updates_gathered_weights(torch.optim.SGD(model.parameters(), lr=0.1))
    assert not _updates_gathered_weights(torch.optim.SGD(copy_before_sharding.parameters(), lr=0.1))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_weights_may_have_changed_on_all_ranks_refreshes_the_gather_scales(recipe, one_rank_group):
    """Weights rescaled through ``.data`` (no version counter, no optimizer step, no mode switch) between two forwards:
    ``lf.weights_may_have_changed(all_ranks=True)`` on every rank makes the next gather cast with the new weights'
    scales, as the unsharded layers cast them (fresh-eyes review: the documented call did not reach these scales)."""
    runs = []
    for model, plugin in _twin_models(recipe):
        torch.manual_seed(1)
        with torch.no_grad():
            with plugin.forward_context():
                first = model(torch.randn(16, 32))
            for p in model.parameters():
                p.data.mul_(8)
            lf.weights_may_have_changed(all_ranks=True)
            with plugin.forward_context():
                second = model(torch.randn(16, 32))
        with plugin.forward_context():
            third = model(torch.randn(16, 32)).detach()
        runs.append((first, second, third))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_compiled_sharded_layer_is_one_fp8_all_gather_weight(one_rank_group):
    """A sharded FP8 layer replaced by its compiled wrapper (``model[0] = torch.compile(model[0])``) is one FP8
    all-gather weight, not two: the wrapper forwards attribute reads to the layer, so its ``weight`` was taken for a
    second shard, and the shared gather scales' all-reduce read each such shard twice."""
    from lightning_fp8.distributed import fp8_all_gather_weights

    (model, _), _ = _twin_models("tensorwise")
    before = fp8_all_gather_weights(model)
    model[0] = torch.compile(model[0], backend="eager")
    after = fp8_all_gather_weights(model)
    assert len(before) == 2 and [id(w) for w in after] == [id(w) for w in before]


@pytest.mark.parametrize("recipe", ["delayed"])  # tensorwise: on 2 ranks below
def test_fsdp2_blocks_compiled_with_fp8_all_gather_never_recompile(recipe, one_rank_group):
    """FSDP2 with FP8 all-gather, each sharded child compiled (torchtitan's way), two micro-batches per optimizer step
    for five steps: one graph per child for the whole run (no recompilation after the first step; before, the
    gathered weight's once-per-step statistics record was Python state the graph guarded on, so every step recompiled
    and past torch's recompile limit (8) the children ran eager or, with ``fullgraph=True``, failed), and the
    outputs, the gradients and the amax histories are the unsharded eager model's, bit for bit (``aot_eager``)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    runs = []
    for compiled, (model, plugin) in zip((True, False), _twin_models(recipe)):
        if compiled:
            for index in (0, 2):
                model[index] = torch.compile(model[index], backend=backend, fullgraph=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        seen = []
        for step in range(5):
            if compiled and step == 1:
                warm = backend.frame_count  # the children's graphs, compiled at the first step
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                for micro in range(2):
                    if compiled:
                        model.set_requires_gradient_sync(micro == 1)
                    with plugin.forward_context():
                        out = model(torch.randn(8, 32) * (1 + micro))
                    out.float().square().mean().backward()
                    seen.append(out.detach())
            seen.extend(p.grad.full_tensor() if compiled else p.grad.clone() for p in model.parameters())
            plugin.optimizer_step(optimizer)
            optimizer.zero_grad()
        runs.append((seen, [t["amax_history"].clone() for t in lf.fp8_state_dict(model)["tables"]]))
    assert backend.frame_count == warm and 1 <= warm <= 2  # no graph compiled after the first step
    (seen, histories), (seen_plain, histories_plain) = runs
    assert len(seen) == len(seen_plain) == 5 * (2 + 4)  # per step: 2 outputs, 4 parameter gradients
    for a, b in zip(seen, seen_plain):
        assert torch.equal(a, b)
    for a, b in zip(histories, histories_plain):
        assert torch.equal(a, b) and bool((a > 0).any())
