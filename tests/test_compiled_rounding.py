"""Under inductor, an FP8 layer rounds where its eager run rounds: the emulated GEMM's output, the bias and input.

Inductor computes fused bfloat16 / float16 arithmetic in float32 and skips a conversion's rounding when a consumer
in the same kernel reads it. The emulated GEMM stands for a kernel that writes its output rounded; compiled, that
output reached the bias add (or the upcast to float32) unrounded, so a compiled step on a machine without FP8 GEMMs
computed other numbers than the eager step, for every recipe in bfloat16 / float16 and for the recipes whose GEMM
outputs bfloat16 (``rowwise``, the block recipes) in float32. ``lightning_fp8.recipe.rounded_to`` makes the
consumer read the converted value through its 16 bits, which inductor cannot skip.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import lightning_fp8 as lf
import lightning_fp8.recipe as recipe_module
from lightning_fp8.recipe import rounded_to

F16 = (torch.bfloat16, torch.float16)


def _special_and_random_floats() -> torch.Tensor:
    """Every float32 class the rounding meets: signed zeros, subnormals of both formats, ties at both rounding bits,
    the edges of float16's range, infinities, NaNs with payloads, and random bit patterns over the whole range."""
    named = [0.0, -0.0, 1.0, -1.0, 1.00390625, 1.01171875, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 2**-14, 2**-14 * 0.999,
             2**-24, 2**-25, 2**-25 * 1.01, 3 * 2**-25, 2**-149, 1e-40, 65504.0, 65519.0, 65520.0, 65536.0, -65520.0,
             3.3895e38, 3.4e38, -3.4e38, float("inf"), float("-inf")]
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (50_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    nan_payloads = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, -1, -8388607], dtype=torch.int32)
    return torch.cat([torch.tensor(named), bits.view(torch.float32), nan_payloads.view(torch.float32)])


@pytest.mark.parametrize("store", [False, True], ids=["recomputed", "stored"])
@pytest.mark.parametrize("form", ["float32-formula", "bits"])
@pytest.mark.parametrize("dtype", F16, ids=["bfloat16", "float16"])
def test_rounded_to_rounds_compiled_as_a_conversion_does(dtype, form, store, monkeypatch):
    """Compiled, ``rounded_to(x, dtype)`` read back in float32 is ``x.to(dtype)``'s value for every float32 class
    (NaNs stay NaN), where inductor's own ``x.to(dtype).float()`` keeps values unrounded; its gradient is that of
    ``x.to(dtype)``. Both forms: the float32 formula inductor's C++ backend gets, and the bit view Triton gets
    (forced here on the C++ backend, which compiles it too, in scalar loops). With ``store``, the same values and
    gradient, and with the float32 formula the compiled code keeps the rounded tensor in a 16-bit buffer of its own,
    which two readers read (without ``store`` there is no such buffer: each reader rounds ``x`` itself); the bit view
    is never stored (each reader recomputes it at no cost; stored, a GPU's ``rowwise`` backward took more kernels)."""
    if form == "bits":
        monkeypatch.setattr(recipe_module, "inductor_cpp_backend", lambda device_type: False)
    x = _special_and_random_floats()
    expected = x.to(dtype).float()

    def through(f):
        return torch.compile(lambda t: f(t).float() * 1.0, fullgraph=True, dynamic=False)(x)

    torch._dynamo.reset()
    plain = through(lambda t: t.to(dtype))
    assert not torch.equal(plain[~x.isnan()], expected[~x.isnan()])  # the skipped rounding this guards against
    ours = through(lambda t: rounded_to(t, dtype, store=store))
    nan = x.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int32), expected[~nan].view(torch.int32))  # -0.0 included
    assert torch.equal(rounded_to(x, dtype, store=store).view(torch.int16), x.to(dtype).view(torch.int16))  # eager

    def two_readers(t):  # in two loop orders, as a row-wise and a column-wise cast read their input
        r = rounded_to(t, dtype, store=store).float().nan_to_num().abs()
        return r.amax(dim=1), r.amax(dim=0)

    torch._dynamo.reset()
    x2d, expected2d = x[:50_000].reshape(200, 250), expected[:50_000].reshape(200, 250).nan_to_num().abs()
    (rows, columns), (code, *_) = run_and_get_code(torch.compile(two_readers, fullgraph=True, dynamic=False), x2d)
    assert torch.equal(rows, expected2d.amax(dim=1)) and torch.equal(columns, expected2d.amax(dim=0))
    sixteen_bit_buffer = re.search(rf"empty_strided_cpu\(\(200, 250\), \(250, 1\), {dtype}\)", code)
    assert bool(sixteen_bit_buffer) == (store and form == "float32-formula"), code

    xs = torch.randn(64, requires_grad=True)
    rounded = torch.compile(lambda t: (rounded_to(t, dtype, store=store).float() * torch.arange(64.0)).sum(),
                            fullgraph=True)
    rounded(xs).backward()
    assert torch.equal(xs.grad, torch.arange(64.0))


@pytest.mark.parametrize("dtype", F16, ids=["bfloat16", "float16"])
def test_float32_rounding_formula_is_the_conversion(dtype):
    """``_rounded_in_float32`` (the C++ backend's rounding, in float32 operations) run eagerly equals
    ``x.to(dtype).float()`` bit for bit on every float32 class, NaNs staying NaN, and so does the same formula
    compiled by inductor on a length that leaves a vector tail (checked over all 2**32 float32 values once, by hand,
    in both forms)."""
    x = _special_and_random_floats()[:-1]
    expected = x.to(dtype).float()
    nan = x.isnan()
    compiled = torch.compile(lambda t: recipe_module._rounded_in_float32(t, dtype) * 1.0, fullgraph=True)
    for ours in (recipe_module._rounded_in_float32(x, dtype), compiled(x)):
        assert ours.dtype == torch.float32
        assert torch.equal(ours.isnan(), nan)
        assert torch.equal(ours[~nan].view(torch.int32), expected[~nan].view(torch.int32))


#: where the skipped roundings showed (every recipe in bfloat16 and float16 and under autocast; in float32 the recipes
#: whose GEMMs output bfloat16): the row-wise GEMM's bfloat16 output in a float32 model, a 16-bit model's per-tensor
#: GEMM, and under autocast the block-scaled GEMM (``fp8_block_mm``'s emulation, which ``blockwise`` shares), the bias
#: and the input that ``mxfp8`` casts in the autocast dtype (float16 through the bits: the test above)
CASES = [
    ("rowwise", torch.float32, False),
    ("tensorwise", torch.bfloat16, False),
    ("mxfp8", torch.float32, True),
]


@pytest.mark.parametrize("recipe, dtype, autocast", CASES, ids=[f"{r}-{str(d)[6:]}{'-autocast' * a}" for r, d, a in CASES])
def test_one_fp8_layer_compiled_by_inductor_matches_eager_bitwise(recipe, dtype, autocast):
    """Two steps: the output, input and weight gradients and the FP8 state of an inductor-compiled layer equal the
    eager layer's bit for bit, and so does the bias gradient where it is a 16-bit sum over the tokens (in a float32
    model inductor orders the float32 additions its own way: equal to float32 rounding). Before ``rounded_to``: ``rowwise`` in
    float32 apart from the first step (outputs by 0.004, weight gradients by 0.85), every recipe in bfloat16 and
    float16, every recipe under autocast. The loss is computed outside the graph: inside, it would meet inductor's own
    skipped roundings, which are not the layer's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Linear(64, 48)
    lf.convert_to_fp8(eager, recipe=recipe)
    eager = eager.to(dtype)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):  # one shape (a second would recompile); 7 tokens: a 16-bit bias gradient summed over so few
        x = (torch.randn(7, 64, generator=gen) * (1 + 3 * step)).to(dtype)  # tokens, inductor kept it unrounded
        results = []
        for model in (eager, compiled):
            xx = x.clone().requires_grad_()
            with lf.fp8_autocast(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(xx)
            out.float().square().sum().backward()
            results.append((out, xx.grad))
        (a, eager_dx), (b, compiled_dx) = results
        assert torch.equal(a, b), f"step {step} output: {(a.float() - b.float()).abs().max()}"
        assert torch.equal(eager_dx, compiled_dx), f"step {step} input gradient"
        assert torch.equal(eager.weight.grad, compiled_layer.weight.grad), f"step {step} weight gradient"
        if dtype == torch.float32 and not autocast:  # a float32 sum: inductor orders the additions its own way
            scale = eager.bias.grad.abs().max().item()
            torch.testing.assert_close(compiled_layer.bias.grad, eager.bias.grad, rtol=0, atol=1e-6 * scale)
        else:  # a 16-bit sum, rounded as eager rounds it
            assert torch.equal(eager.bias.grad, compiled_layer.bias.grad), f"step {step} bias gradient"
        assert compiled_layer.bias.grad.abs().sum() > 0 and compiled_dx.abs().sum() > 0
        eager.zero_grad()
        compiled_layer.zero_grad()
    for (name, a), (_, b) in zip(eager.named_buffers(), compiled_layer.named_buffers()):
        assert torch.equal(a, b), name


def _autocast_steps(models, x):
    """One bf16-autocast training step of each model on the same input: (output, input gradient, parameter grads)."""
    results = []
    for model in models:
        xx = x.clone().requires_grad_()
        with lf.fp8_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(xx)
        out.float().square().sum().backward()
        results.append((out, xx.grad, [p.grad for p in model.parameters()]))
    return results


def _assert_same_step(step, eager, results):
    """Two models' :func:`_autocast_steps` results equal bit for bit: output, input gradient, parameter gradients."""
    (a, dx_a, grads_a), (b, dx_b, grads_b) = results
    assert torch.equal(a, b), f"step {step} output: {(a.float() - b.float()).abs().max()}"
    assert torch.equal(dx_a, dx_b), f"step {step} input gradient"
    for (name, _), ga, gb in zip(eager.named_parameters(), grads_a, grads_b):
        assert torch.equal(ga, gb), f"step {step} {name}: {(ga - gb).abs().max()}"


def test_stacked_fp8_layers_with_bias_compiled_match_eager_bitwise():
    """The next FP8 layer's cast reads this layer's output rounded to its dtype, bias included (compiled, the bias
    add fused with the next cast's amax and scaling skipped that rounding: outputs apart by 0.012, the first weight's
    gradient by 0.5, under bf16 autocast)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 48))
    lf.convert_to_fp8(eager, recipe="tensorwise")
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    _assert_same_step(0, eager, _autocast_steps((eager, compiled), x))


@pytest.mark.parametrize("dtype", F16, ids=["bfloat16", "float16"])
def test_chained_roundings_compile_to_short_loop_bodies(dtype, monkeypatch):
    """Compiled, a chain of roundings (as a biased FP8 layer's output feeds the next layer: the bias rounded, added,
    the sum rounded) gives eager's bits, and the loop bodies inductor traces stay short: the float32 formula reads
    its input about two dozen times and inductor inlines an elementwise input into every read, so with the input
    unstored these three formulas traced bodies of 5310 operations, 126 stored (each ``LoopBody`` is what inductor's
    code generation walks, several times)."""
    from torch._inductor import config as inductor_config
    from torch._inductor import loop_body

    sizes = []
    init = loop_body.LoopBody.__init__

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sizes.append(sum(len(block.graph.nodes) for block in (self.root_block, *self.subblocks.values())))

    monkeypatch.setattr(loop_body.LoopBody, "__init__", counting_init)
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)  # a cached graph is not traced again

    def chain(t):
        for _ in range(3):
            t = rounded_to(t * 1.5 + 0.25, dtype).float()
        return t

    torch._dynamo.reset()
    x = _special_and_random_floats()[:4096] * 1e-3
    compiled = torch.compile(chain, fullgraph=True, dynamic=False)(x)
    expected = chain(x)  # eager: x.to(dtype)
    assert torch.equal(compiled.isnan(), expected.isnan())
    assert torch.equal(compiled.nan_to_num().view(torch.int32), expected.nan_to_num().view(torch.int32))
    assert sizes and max(sizes) < 300, sorted(sizes)[-5:]


def test_tensor_parallel_row_wise_bias_compiled_matches_eager_bitwise(one_rank_group):
    """Under tensor parallelism a row-wise sharded layer adds its bias to the reduced output, on ``DTensor``s (whose
    ``.to`` inductor skips the rounding of): compiled, its output and gradients equal eager's bit for bit under bf16
    autocast, bias gradient included. Before, on one rank: outputs apart by 0.0078 at the first step. (Two ranks:
    tests/test_fsdp2.py.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,))
    base = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 48))
    with torch.no_grad():
        for layer in base:
            layer.bias.mul_(10)  # a bias of the output's size: its rounding shows
    lf.convert_to_fp8(base, recipe="tensorwise")
    models = []
    for _ in range(2):
        model = copy.deepcopy(base)
        parallelize_module(model, mesh, {"0": lf.FP8ColwiseParallel(), "1": lf.FP8RowwiseParallel()})
        models.append(model)
    eager, compiled_model = models
    compiled = torch.compile(compiled_model, fullgraph=True)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(7, 64, generator=gen) * (1 + 3 * step)
        results = []
        for model in (eager, compiled):
            xx = x.clone().requires_grad_()
            with lf.fp8_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
                out = full(model(xx))
            out.float().square().sum().backward()
            results.append((out, xx.grad, [full(p.grad) for p in model.parameters()]))
        _assert_same_step(step, eager, results)
        eager.zero_grad()
        compiled_model.zero_grad()


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_recipes_behind_an_activation_compile_and_match_eager_bitwise(recipe):
    """A float32 model under bf16 autocast with an activation between two block-recipe layers: the second layer's
    input is the activation's output rounded to bfloat16, which inductor fuses into the layer's tile casts.
    Compiled, the step runs; its output and the second layer's gradients equal eager's bit for bit (the first
    layer's pass through GELU's backward, which inductor computes a little differently from eager: close, not
    equal, before and after any change to the rounding). A rounding in 32-bit integers on a CPU (tried and
    reverted in stop 37) made inductor's C++ code generation fail here (``InductorError: AssertionError`` in its
    loop split, torch 2.13) at these shapes."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))  # smaller shapes did not show it
    lf.convert_to_fp8(eager, recipe=recipe, log_summary=False)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    (a, dx_a, grads_a), (b, dx_b, grads_b) = _autocast_steps((eager, compiled), x)
    assert torch.equal(a, b)
    # the second layer's gradients; the first layer's and the input's pass through GELU's backward, which inductor
    # computes a little differently from eager (not this package's rounding)
    for (name, _), ga, gb in list(zip(eager.named_parameters(), grads_a, grads_b))[2:]:
        assert torch.equal(ga, gb), name
    torch.testing.assert_close(dx_a, dx_b, rtol=0.02, atol=1e-3)


@pytest.mark.parametrize("tokens", [7, 32])
def test_mxfp8_layers_with_bias_compiled_count_as_eager(tokens):
    """Two ``mxfp8`` layers with biases under bf16 autocast, two training steps: compiled, the FP8 state (amaxes,
    scales and the statistics' counters) equals eager's, as do the outputs and gradients. A rounding in 32-bit
    integers on a CPU (tried and reverted in stop 37) made inductor count the first layer's grad_output statistics
    from other values than it cast (7 tokens: counters apart by hundreds) or fail to compile (32 tokens:
    ``InductorError`` in its loop split)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 48))
    with torch.no_grad():
        for layer in (eager[0], eager[2]):
            layer.bias.mul_(10)
    lf.convert_to_fp8(eager, recipe="mxfp8", log_summary=False)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(tokens, 96, generator=gen) * (1 + 3 * step)
        _assert_same_step(step, eager, _autocast_steps((eager, compiled), x))
        eager.zero_grad()
        compiled_model.zero_grad()
        _assert_same_fp8_state(step, eager, compiled_model)


def _assert_same_fp8_state(step, a, b):
    """Two models' FP8 state tables (amaxes, scales, histories and the statistics' counters) equal bit for bit."""
    tables_a, tables_b = lf.fp8_state_dict(a)["tables"], lf.fp8_state_dict(b)["tables"]
    assert len(tables_a) == len(tables_b) > 0
    for table_a, table_b in zip(tables_a, tables_b):
        for key, value in table_a.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, table_b[key]), f"step {step} {key}"


def test_inductor_loop_split_drops_the_tail_of_a_partial_block():
    """The torch bug the compiled block casts keep clear of (``lightning_fp8.quantize._cast_blocks_compiled``):
    inductor's C++ loop split (torch 2.13) splits a loop over a dimension indexed by ``j // 32`` at 32 and rounds its
    size down to a multiple of 32, so the last 16 of 48 columns of this block-scaled cast are never written, no
    error. If a torch release fixes it, this test fails and says so (the blocked layout can then be reconsidered)."""
    torch._dynamo.reset()

    def cast(x, scale):
        blocks = torch.nn.functional.pad(x, (0, 16)).reshape(7, 2, 32) * scale[:, :, None]
        return blocks.reshape(7, 64)[:, :48].to(torch.float8_e4m3fn)

    # The unwritten bytes are whatever the output's memory held: computed after eager's, the compiled output often
    # reuses the freed eager result and holds the right bytes by chance (166 of 200 trials here). So the compiled
    # cast comes first, both results stay alive, and three trials must not all hide it.
    compiled_cast = torch.compile(cast, fullgraph=True)
    wrong = 0
    for _ in range(3):
        x, scale = torch.randn(7, 48), torch.rand(7, 2) + 1
        compiled = compiled_cast(x, scale)
        eager = cast(x, scale)
        assert torch.equal(eager.float()[:, :32], compiled.float()[:, :32])
        wrong += int((eager.float() != compiled.float()).sum().item() > 0)
    assert wrong > 0, "inductor no longer drops the partial block's tail"


#: block cast specs with partial blocks: (recipe, which cast, rows, cols, dtype, statistics)
PARTIAL_BLOCK_CASTS = [
    ("mxfp8", "input", 7, 208, torch.bfloat16, False),
    ("mxfp8", "input", 129, 48, torch.float32, True),
    ("mxfp8", "grad_weight input", 33, 80, torch.float16, True),
    ("blockwise", "input", 9, 144, torch.bfloat16, False),
    ("blockwise", "input", 9, 144, torch.bfloat16, True),
    ("blockwise", "weight", 144, 208, torch.float32, True),
]


@pytest.mark.parametrize(
    "recipe, which, rows, cols, dtype, statistics", PARTIAL_BLOCK_CASTS,
    ids=[f"{r}-{w.replace(' ', '_')}-{m}x{n}-{str(d)[6:]}{'-stats' * s}" for r, w, m, n, d, s in PARTIAL_BLOCK_CASTS],
)
def test_block_casts_with_partial_blocks_compiled_match_eager(recipe, which, rows, cols, dtype, statistics):
    """A block cast of a computed input (an activation's product, rounded to its dtype) whose shape leaves a partial
    block: compiled by inductor, its FP8 bytes, scales and counts equal eager's. Cast over the ``(R, C)`` layout,
    the last columns of the partial block came out wrong in every row (``mxfp8`` 7 x 208: 112 bytes; ``blockwise``
    9 x 144: 144), with or without the statistics (the loop split above)."""
    from lightning_fp8.quantize import quantize
    from lightning_fp8.recipe import _cast_specs, resolve_recipe

    specs = _cast_specs(resolve_recipe(recipe))
    spec = {"input": specs.forward[0], "weight": specs.forward[1], "grad_weight input": specs.grad_weight[1]}[which]

    def cast(h, b):
        q = quantize(rounded_to(nn.functional.silu(h.float()) * b, dtype), spec, statistics=statistics)
        return q.data.view(torch.uint8), q.scale, (q.stats.counts if statistics else q.scale)

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    h, b = torch.randn(rows, cols, generator=gen).to(dtype), torch.randn(rows, cols, generator=gen) * 100
    eager, compiled = cast(h, b), torch.compile(cast, fullgraph=True)(h, b)
    for name, e, c in zip(("data", "scale", "counts"), eager, compiled):
        assert torch.equal(e, c), f"{name}: {(e != c).sum().item()} differ"
    if statistics:
        assert eager[2][0].item() > 0  # the counts counted


@pytest.mark.parametrize("backend", ["cpp", "triton-form"])
def test_a_compiled_block_cast_stores_its_padded_input_once_for_the_cpp_backend(backend, monkeypatch):
    """A block cast whose input leaves a partial block (9 x 144 under 1 x 128 tiles): compiled by inductor's C++
    backend, the zero-padded input is a buffer of its own (9 x 256) that the amaxes, the cast and the counts read with
    plain loads (inlined, each of them re-read the input through masked vector loads: a layer with a partial block
    took about 1.6 times one with the next multiple of 128). In the form Triton gets (``inductor_cpp_backend``
    false, compiled here by the C++ backend) there is no such buffer. Bytes, scales and counts equal eager's."""
    import lightning_fp8.quantize as quantize_module
    from lightning_fp8.recipe import _cast_specs, resolve_recipe

    if backend == "triton-form":
        monkeypatch.setattr(quantize_module, "inductor_cpp_backend", lambda device_type: False)
    spec = _cast_specs(resolve_recipe("blockwise")).forward[0]

    def cast(h):
        q = quantize_module.quantize(h * 2, spec)
        return q.data.view(torch.uint8), q.scale, q.stats.counts

    torch._dynamo.reset()
    h = torch.randn(9, 144, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    compiled, (code, *_) = run_and_get_code(torch.compile(cast, fullgraph=True, dynamic=False), h)
    for name, e, c in zip(("data", "scale", "counts"), cast(h), compiled):
        assert torch.equal(e, c), f"{name}: {(e != c).sum().item()} differ"
    padded_buffer = re.search(r"empty_strided_cpu\(\(9, 256\), \(256, 1\), torch\.bfloat16\)", code)
    assert bool(padded_buffer) == (backend == "cpp"), code


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_recipes_with_partial_blocks_compiled_match_eager_bitwise(recipe):
    """Partial blocks in every dimension (9 tokens; 208, 144 and 80 features: not multiples of 32 or 128) under bf16
    autocast, two training steps and an evaluation forward: compiled by inductor, the outputs, gradients and the FP8
    state (counters included) equal eager's bit for bit. With the block casts computed over the ``(R, C)`` layout
    (before ``_cast_blocks_compiled``) and the float32 rounding, both recipes failed here (the loop split above)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(208, 144), nn.ReLU(), nn.Linear(144, 80))
    lf.convert_to_fp8(eager, recipe=recipe, log_summary=False)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(9, 208, generator=gen) * (1 + 3 * step)
        _assert_same_step(step, eager, _autocast_steps((eager, compiled), x))
        eager.zero_grad()
        compiled_model.zero_grad()
        _assert_same_fp8_state(step, eager, compiled_model)
    eager.eval()
    compiled_model.eval()
    with torch.no_grad(), lf.fp8_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(eager(x), compiled(x))


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_a_bfloat16_input_under_float16_autocast_compiled_matches_eager(recipe):
    """A bfloat16 input under float16 autocast: the layer casts the input converted to float16, and compiled that
    conversion is kept too (``rounded_to`` treated a 16-bit input of the other dtype as a plain ``.to``, which
    inductor skipped: tiny inputs that float16 flushes to zero or rounds to a subnormal reached the cast unrounded;
    found by a review: input gradients apart in 408 of 1872 elements, the cast's zero count 0 compiled where eager
    counted 51 underflows)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Linear(208, 144, bias=False)
    lf.convert_to_fp8(eager, recipe=recipe, log_summary=False)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    x = torch.randn(9, 208, generator=torch.Generator().manual_seed(1))
    x[0] *= 1e-6  # below float16's smallest normal: float16 subnormals, and zeros
    x[1] *= 1e-7
    x = x.to(torch.bfloat16)
    results = []
    for model in (eager, compiled):
        xx = x.clone().requires_grad_()
        with lf.fp8_autocast(), torch.autocast("cpu", dtype=torch.float16):
            out = model(xx)
        out.float().square().sum().backward()
        results.append((out, xx.grad))
    (a, dx_a), (b, dx_b) = results
    assert torch.equal(a, b) and torch.equal(dx_a, dx_b)
    assert torch.equal(eager.weight.grad, compiled_layer.weight.grad)
    _assert_same_fp8_state(0, eager, compiled_layer)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp8"])
def test_a_bfloat16_gemm_output_converted_to_float16_then_biased_compiled_matches_eager(recipe):
    """Under float16 autocast these recipes' GEMMs output bfloat16, converted to float16 and then biased. Compiled,
    the bias add read the bfloat16 value: float16 subnormals (an input row about 6e-8) were rounded once where eager
    rounds twice, one ulp apart (found by a review: ``rowwise`` 0.00016665459 eagerly, 0.00016653538 compiled)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Linear(208, 144)
    lf.convert_to_fp8(eager, recipe=recipe, log_summary=False)
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True)
    x = torch.randn(4, 208, generator=torch.Generator().manual_seed(1))
    x[0] *= 6e-8
    x[1] *= 1e-6
    outs = []
    for model in (eager, compiled):
        with torch.no_grad(), lf.fp8_autocast(), torch.autocast("cpu", dtype=torch.float16):
            outs.append(model(x.clone()))
    assert outs[0].dtype == torch.float16
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@pytest.mark.parametrize("recipe, roundings", [("rowwise", 2), ("mxfp8", 3), ("blockwise", 3)])
def test_the_compiled_backward_rounds_a_rounded_inputs_gradient_once(recipe, roundings):
    """Under bfloat16 autocast these recipes cast the input rounded to bfloat16 (``rounded_to``), whose gradient is
    the backward GEMM's output, rounded already: the compiled ``rowwise`` backward rounds two GEMM outputs (input and
    weight gradients), not the input gradient a second time (a full pass of the formula over it, which changed no
    bit; counted as the bfloat16 split's multiplications in the backward graph); the block recipes keep the second
    rounding (measured faster so; see ``rounded_to``). The values: the bitwise tests above."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    backward_graphs = []

    def backward_compiler(gm, example_inputs):
        backward_graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=backward_compiler,
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    layer = nn.Linear(64, 48, bias=False)
    lf.convert_to_fp8(layer, recipe=recipe, log_summary=False)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    x = torch.randn(32, 64, requires_grad=True)
    with lf.fp8_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    out.float().sum().backward()
    split = recipe_module._ROUNDING[torch.bfloat16][0]
    (graph,) = backward_graphs
    splits = [n for n in graph.graph.nodes if n.target == torch.ops.aten.mul.Tensor and split in n.args]
    assert len(splits) == roundings, graph.code
    assert x.grad is not None and x.grad.abs().sum() > 0
