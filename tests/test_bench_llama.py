"""benchmarks/bench_llama.py on its test size: the measurement code runs, and its result file has what the docs
tables and the issue's targets need (no timing is asserted: speed is only reported, as a ratio)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._inductor.runtime.cache_dir_utils import cache_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_llama
import docs_tables
import harness
from utils import bench_result

KINDS = ("bf16", "torchao-tensorwise", "ours-tensorwise", "ours-delayed", "ours-tensorwise:uncounted")
COMPILED = ("ours-tensorwise", "ours-tensorwise:uncounted")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    """One run of the script's measurement code: test size, bf16, torchao, our tensorwise and delayed, eager, and ours
    compiled with dynamo alone (``backend="eager"``: the graphs, graph breaks and recompilations without inductor's
    compile time), written and read back as the script does. One thread: steadier on a loaded machine."""
    return bench_result(
        tmp_path_factory, "llama", "python benchmarks/bench_llama.py --sizes test",
        lambda: bench_llama.run([bench_llama.SIZES["test"]], KINDS, device="cpu", compile_backend="eager", warmup=2,
                                reps=2, log=lambda message: None, compile_kinds=COMPILED),
    )


def test_the_block_is_llama_shaped():
    size = bench_llama.SIZES["llama3-8b"]
    assert (size.hidden, size.ffn, size.heads, size.kv_heads, size.tokens) == (4096, 14336, 32, 8, 8192)
    block = bench_llama.DecoderBlock(bench_llama.SIZES["test"])
    linears = {name for name, m in block.named_modules() if isinstance(m, nn.Linear)}
    assert linears == {"attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                       "feed_forward.w2", "feed_forward.w3"}
    assert sum(isinstance(m, nn.RMSNorm) for m in block.modules()) == 2
    test = bench_llama.SIZES["test"]
    stack = bench_llama.make_stack(test, "cpu")
    assert sum(p.numel() for n, p in stack.named_parameters() if "norm" not in n) == test.linear_params


def test_variants_share_the_weights_and_convert_every_linear():
    base = bench_llama.make_stack(bench_llama.SIZES["test"], "cpu")
    for kind in KINDS:
        variant = bench_llama.build_variant(kind, base, "cpu", None)
        assert all(p is q for p, q in zip(variant.model.parameters(), base.parameters(), strict=True)), kind
        linears = [type(m).__name__ for m in variant.model.modules() if isinstance(m, nn.Linear)]
        expected = {"bf16": "Linear", "torchao-tensorwise": "Float8Linear"}.get(kind, "FP8Linear")
        assert linears == [expected] * 7, (kind, linears)


def test_uncounted_variant_records_scales_but_counts_nothing():
    """``ours-<recipe>:uncounted`` is the step that ``statistics_every_n_steps`` runs between two counting steps: the
    scales are recorded as the counting variant records them, the counters and histograms stay at zero; the counting
    variant's are not."""
    from lightning_fp8 import FP8Stats

    base = bench_llama.make_stack(bench_llama.SIZES["test"], "cpu")
    x = torch.randn(bench_llama.SIZES["test"].batch, bench_llama.SIZES["test"].seq, bench_llama.SIZES["test"].hidden)
    readings = {}
    for kind in ("ours-tensorwise", "ours-tensorwise:uncounted"):
        variant = bench_llama.build_variant(kind, base, "cpu", None)
        assert (variant.kind, variant.count_statistics) == (kind, kind == "ours-tensorwise")
        bench_llama.forward_backward(variant, x)
        readings[kind] = FP8Stats(variant.model).read().layers
    for name, layer in readings["ours-tensorwise:uncounted"].items():
        assert all(c == 0 for role in layer.counts for c in role), name
        assert all(c == 0 for role in layer.amax_bins for c in role), name
        assert layer.scale == readings["ours-tensorwise"][name].scale, name  # the scales were recorded
        assert all(v not in (0.0, 1.0) for v in layer.scale), name
        assert sum(readings["ours-tensorwise"][name].counts[0]) > 0, name
    assert bench_llama.variant_name("ours-tensorwise:uncounted") == "ours tensorwise, steps not counting"
    for bad in ("torchao-tensorwise:uncounted", "bf16:uncounted", "ours-nonsense:uncounted", "ours-tensorwise:x"):
        assert not bench_llama.valid_kind(bad), bad
        with pytest.raises(ValueError, match="unknown variant"):
            bench_llama.build_variant(bad, base, "cpu", None)


def test_result_file_structure(result):
    assert {"environment", "command", "device", "config", "peaks", "sizes", "load_average_end"} <= set(result)
    assert result["environment"]["load average at start"]
    variants = result["sizes"]["test"]["variants"]
    assert set(variants) == set(KINDS) | {f"{k}+compile" for k in COMPILED}
    for key, v in variants.items():
        assert v["status"] == "measured", (key, v["status"])
        assert len(v["times"]) == 2 and v["fastest_s"] <= v["median_s"] <= v["slowest_s"]
        for field in ("syncs", "aten_ops", "peak_bytes", "tokens_per_s", "model_tflops", "mfu", "gemm_path"):
            assert field in v, (key, field)
        assert v["mfu"] is None  # no GPU peak on a CPU
        assert v["peak_bytes"] > 0
        if v["compiled"]:
            for field in ("graphs", "graph_breaks", "recompiles_after_warmup", "graph_breaks_after_warmup"):
                assert isinstance(v[field], int), (key, field)
            assert v["first_step_s"] > 0
            # where the first step's compile time went, by torch's phase names (dynamo alone here: no inductor)
            assert set(v["compile_phases_s"]) == set(harness.COMPILE_PHASES)
            assert 0 < v["compile_phases_s"]["bytecode_tracing"] < v["first_step_s"]
            assert v["compile_phases_s"]["compile_file"] == 0
        else:
            for field in ("saved_bytes", "saved_bytes_linear", "activation_bytes", "activation_bytes_linear"):
                assert v[field] > 0, (key, field)
            assert v["fixed_bytes"] > 0 and v["fixed_bytes_linear"] >= 0  # torchao saves the weight itself


def test_compiled_gradients_are_checked_against_eager(result):
    """Each compiled variant's gradients were compared with its eager twin's before it was timed."""
    for key in (f"{k}+compile" for k in COMPILED):
        check = result["sizes"]["test"]["variants"][key]["gradient_check"]
        assert check["reference"] == key.split("+")[0]
        assert check["zero_gradients"] == 0 and check["parameters"] == 9
        assert 0 <= check["relative_difference"] <= bench_llama.GRADIENT_TOLERANCE


class _ZeroGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


def test_gradient_check_flags_a_step_that_trains_wrongly():
    """A variant whose backward sends zeros (what torch 2.11 did to our compiled layers) is 1 off its reference."""
    torch.manual_seed(0)
    size = bench_llama.SIZES["test"]
    base = bench_llama.make_stack(size, "cpu")
    params = list(base.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    x = torch.randn(size.batch, size.seq, size.hidden)
    good = bench_llama.build_variant("bf16", base, "cpu", None)
    broken = bench_llama.build_variant("bf16", base, "cpu", None)
    model = broken.model
    broken.module = type("Broken", (torch.nn.Module,), {"forward": lambda self, t: _ZeroGrad.apply(model(t))})()
    same = bench_llama.gradient_check(bench_llama.build_variant("bf16", base, "cpu", None), good, x, params, optimizer)
    assert same["relative_difference"] == 0 and same["zero_gradients"] == 0
    check = bench_llama.gradient_check(broken, good, x, params, optimizer)
    assert check["relative_difference"] == pytest.approx(1.0) and check["zero_gradients"] == len(params)
    assert all(p.grad is None for p in params)  # leaves no gradients behind


@pytest.mark.parametrize(("difference", "zeros", "status"), [
    (1.0, 0, "invalid: gradients 1 off bf16's (tolerance 0.25)"),
    # a small parameter's gradient lost barely moves the norm over all parameters: zeros are invalid on their own
    (1e-7, 1, "invalid: 1 of 9 gradients zero where bf16's are not"),
])
def test_a_compiled_variant_failing_the_gradient_check_is_not_timed(monkeypatch, difference, zeros, status):
    monkeypatch.setattr(bench_llama, "gradient_check", lambda *args: {
        "reference": "bf16", "relative_difference": difference, "zero_gradients": zeros, "parameters": 9})
    try:
        data = bench_llama.run([bench_llama.SIZES["test"]], ("bf16",), device="cpu", compile_backend="eager",
                               warmup=1, reps=1, log=lambda message: None, compile_kinds=("bf16",))
    finally:
        torch._dynamo.reset()
    variants = data["sizes"]["test"]["variants"]
    assert variants["bf16"]["status"] == "measured" and "median_s" in variants["bf16"]
    compiled = variants["bf16+compile"]
    assert compiled["status"] == status
    assert "median_s" not in compiled and "times" not in compiled


def test_no_host_syncs_graph_breaks_or_recompilations(result):
    """What is true of a step with ``AdamW(fused=True)``: no host sync for any variant (the CPU fused kernel's reads of
    its step counters are counted apart: one per parameter), and one graph per compiled variant, no graph break, no
    recompilation after the warm-up."""
    params = 9  # 7 Linear weights and 2 RMSNorm weights
    for key, v in result["sizes"]["test"]["variants"].items():
        assert v["syncs"] == 0, key
        assert v["fused_optimizer_reads"] == params, key
        if v["compiled"]:
            counts = (v["graphs"], v["graph_breaks"], v["recompiles_after_warmup"], v["graph_breaks_after_warmup"])
            assert counts == (1, 0, 0, 0), key


def test_saved_bytes_split(result):
    """The split of the bytes saved for backward adds up; FP8 about halves what the Linear layers keep."""
    variants = result["sizes"]["test"]["variants"]
    for kind in KINDS:
        v = variants[kind]
        assert v["activation_bytes"] + v["fixed_bytes"] == v["saved_bytes"]
        assert v["activation_bytes_linear"] + v["fixed_bytes_linear"] == v["saved_bytes_linear"]
    bf16, ours = variants["bf16"], variants["ours-tensorwise"]
    assert ours["activation_bytes_linear"] < 0.6 * bf16["activation_bytes_linear"]
    assert ours["fixed_bytes"] < 0.6 * bf16["fixed_bytes"]  # FP8 weight copies against bf16 ones
    # delayed's siblings (q/k/v, gate/up) share one FP8 copy of their input, as tensorwise's do
    assert variants["ours-delayed"]["activation_bytes_linear"] == ours["activation_bytes_linear"]


def test_compiled_saved_bytes_are_measured(tmp_path):
    """A compiled variant's bytes saved for backward are measured (in all: what the compiled graph keeps), here
    through AOTAutograd (``aot_eager``) on one FP8 layer: exactly its FP8 input copy and scale; no recompilation."""
    base = nn.Sequential(nn.Linear(64, 128, bias=False))
    x = torch.randn(32, 64)
    variant = bench_llama.build_variant("ours-tensorwise", base, "cpu", "aot_eager")
    for _ in range(2):
        bench_llama.forward_backward(variant, x)
    before = harness.dynamo_counts()
    saved = bench_llama.saved_for_backward_compiled(variant, x, list(base.parameters()))["saved_bytes"]
    bench_llama.forward_backward(variant, x)
    assert harness.dynamo_counts()["graphs"] == before["graphs"]
    # the FP8 copy of the input and its float32 scale (grad_weight's operand); the input needs no gradient, so the
    # weight's copy is not kept. Under backend "eager" the hooks would see neither.
    assert saved == 32 * 64 + 4


def test_compiled_saved_bytes_in_the_tables(result):
    """The memory table shows compiled bytes saved against compiled bf16's and the targets table judges them; a
    variant compiled with ``backend="eager"`` (the fixture's), whose FP8 copies bypass the hooks, and a result file
    from before the field say why there is no number instead of a blank or "not timed"."""
    variants = result["sizes"]["test"]["variants"]
    assert variants["ours-tensorwise+compile"]["saved_bytes_unmeasured"] == bench_llama.SAVED_UNMEASURED_EAGER_BACKEND
    assert bench_llama.SAVED_UNMEASURED_EAGER_BACKEND in docs_tables.llama_memory(result)
    data = copy.deepcopy(result)
    v = data["sizes"]["test"]["variants"]
    v["bf16+compile"] = dict(variants["bf16"], kind="bf16", compiled=True, name="bf16 autocast + compile")
    v["ours-tensorwise+compile"]["saved_bytes"] = v["bf16"]["saved_bytes"] // 2
    memory = docs_tables.llama_memory(data)
    assert "saved for backward, compiled: MiB" in memory
    row = next(line for line in memory.splitlines() if line.startswith("| ours tensorwise |"))
    assert f"| {v['bf16']['saved_bytes'] // 2 / 2**20:.2f} | 0.50× |" in row
    assert ("`tensorwise`, compiled: saved for backward, in all, at this size ≤ 0.55 × bf16 compiled | 0.50×: met"
            in docs_tables.llama_targets(data))
    del v["ours-tensorwise+compile"]["saved_bytes"], v["ours-tensorwise+compile"]["saved_bytes_unmeasured"]
    assert "not measured in this run" in docs_tables.llama_memory(data)
    assert ("`tensorwise`, compiled: saved for backward, in all, at this size ≤ 0.55 × bf16 compiled | "
            "not measured in this run: n/a") in docs_tables.llama_targets(data)

def test_docs_tables_render_the_result(result):
    tables = docs_tables.llama_tables(result)
    assert set(tables) == {"llama_step_time.md", "llama_memory.md", "llama_compile.md", "llama_targets.md"}
    assert set(tables) <= set(docs_tables.RENDERERS)
    for name, text in tables.items():
        assert text.startswith("*Measured ") and "emulated" in text.splitlines()[0], name
        assert "**test**" in text or name == "llama_targets.md", name
    targets = tables["llama_targets.md"]
    assert "no CUDA GPU in this run" in targets
    assert "host syncs per step = 0 (eager and compiled) | max 0: met" in targets


def test_targets_compare_rowwise_with_torchao_rowwise_too(result):
    """Every recipe is held to torchao tensorwise; ``rowwise`` also to torchao's own rowwise (like for like)."""
    data = copy.deepcopy(result)
    data["config"]["compile_backend"] = "inductor"
    data["config"]["kinds"] = [*data["config"]["kinds"], "torchao-rowwise", "ours-rowwise"]
    variants = data["sizes"]["test"]["variants"]
    measured = variants["ours-tensorwise+compile"]
    variants["torchao-tensorwise+compile"] = {**measured, "median_s": 1.0, "cpu_s": 1.0}
    variants["torchao-rowwise+compile"] = {**measured, "median_s": 1.25, "cpu_s": 1.25}
    variants["ours-rowwise+compile"] = {**measured, "median_s": 1.2, "cpu_s": 1.2}
    targets = docs_tables.llama_targets(data)
    assert "`rowwise` step time ≤ torchao tensorwise compiled (emulated) | 1.20× (CPU time 1.20×): **missed**" in targets
    assert "`rowwise` step time ≤ torchao rowwise compiled (emulated) | 0.96× (CPU time 0.96×): met" in targets
    assert "`tensorwise` step time ≤ torchao rowwise" not in targets  # torchao's rowwise is no reference for it


def test_plot_is_written(result, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plot.png"
    bench_llama.plot(result, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_help_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        bench_llama.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--large", "--sizes", "--no-compile", "--cold-compile", "--compile-budget", "--reps", "--warmup", "--threads", "--json",
                 "--plot", "--replot", "--peak-bf16-tflops", "--peak-fp8-tflops"):
        assert flag in text, flag


def test_the_cold_compile_cache_is_removed_when_the_benchmark_exits(tmp_path):
    """A cold cache holds about a hundred MB of compiled code: it must not stay in the temporary folder after a run."""
    code = "import bench_llama; print(bench_llama.fresh_compile_cache())"
    # PYTHONPATH extended, not replaced: .ci/run's second run lays a Lightning release over the installed one there
    path = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.parent == tmp_path and path.name.startswith("bench_llama_compile_")
    assert not path.exists() and not any(tmp_path.iterdir())


def test_cold_compile_uses_an_empty_cache_and_says_so(result, monkeypatch):
    """``--cold-compile``: inductor's and Triton's caches point at a new empty directory (so no variant compiles from
    an earlier run's cache), and the compile table's caption says the caches were emptied at the start of the run."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent-before")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/nonexistent-before")
    path = Path(bench_llama.fresh_compile_cache())
    try:
        assert path.is_dir() and not any(path.iterdir())
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path)
        assert os.environ["TRITON_CACHE_DIR"].startswith(str(path))
        assert cache_dir() == str(path)  # what inductor reads
    finally:
        shutil.rmtree(path)
    data = copy.deepcopy(result)
    data["config"]["compile_backend"] = "inductor"
    assert "`(cached)`" in docs_tables.llama_compile(data)
    data["config"]["cold_compile"] = True
    text = docs_tables.llama_compile(data)
    # cold: the caches were emptied once, at the start; a "(cached)" variant reused a graph of the same run
    assert "caches emptied at the start of the run" in text and "compiled earlier in the same run" in text
    assert "from an earlier run" not in text


def test_blocks_compile_scope_compiles_each_block_into_one_shared_graph():
    """``--compile-scope blocks``: each block compiled in its place (torchtitan's way), the identical blocks sharing
    graphs (no recompilation after the warm-up), the variant checked against its eager twin and timed, the scope in
    the result's config and on the command line."""
    size = dataclasses.replace(bench_llama.SIZES["test"], blocks=3)
    try:
        data = bench_llama.run([size], ("ours-tensorwise",), device="cpu", compile_backend="eager", warmup=2, reps=1,
                               log=lambda message: None, compile_scope="blocks")
    finally:
        torch._dynamo.reset()
    assert data["config"]["compile_scope"] == "blocks"
    compiled = data["sizes"]["test"]["variants"]["ours-tensorwise+compile"]
    assert compiled["status"] == "measured" and "median_s" in compiled
    assert compiled["gradient_check"]["relative_difference"] < 1e-6  # dynamo alone: the eager twin's gradients
    # two graphs for three blocks: the first block's input is the batch, which does not require grad, the others' do
    # (bf16's blocks compile the same two); blocks two and three share one
    counts = (compiled["graphs"], compiled["graph_breaks"], compiled["recompiles_after_warmup"])
    assert counts == (2, 0, 0)
    model = bench_llama.make_stack(size, "cpu")
    module = bench_llama.compile_in_scope(model, "blocks", "eager")
    assert module is model and all(isinstance(block, torch._dynamo.OptimizedModule) for block in model)
    with pytest.raises(ValueError, match="unknown compile scope"):
        bench_llama.compile_in_scope(model, "layers", "eager")
    args = argparse.Namespace(large=False, sizes="test", no_compile=False, cold_compile=False, kinds="", compile_kinds="", threads=0,
                              warmup=3, reps=11, compile_budget=bench_llama.COMPILE_BUDGET_S, backend="inductor",
                              compile_scope="blocks")
    assert "--compile-scope blocks" in bench_llama.command_line(args)


# ------------------------------------------------------------------------------ a run stopped by a time limit


def _stop_at(monkeypatch, target: str, call: int) -> None:
    """Send this process ``SIGTERM`` at the ``call``-th call (1-based) of ``harness.interleaved``'s timed functions
    (``target="timing"``) or of the steps ``make_step`` builds (``target="steps"``), just before the call runs."""
    import signal

    calls = [0]

    def stopping(fn):
        def run():
            calls[0] += 1
            if calls[0] == call:
                signal.raise_signal(signal.SIGTERM)
            return fn()

        return run

    if target == "timing":
        real = harness.interleaved
        monkeypatch.setattr(harness, "interleaved",
                            lambda variants, **kw: real({k: stopping(f) for k, f in variants.items()}, **kw))
    else:
        real_step = bench_llama.make_step
        monkeypatch.setattr(bench_llama, "make_step", lambda *a: stopping(real_step(*a)))


def _main(tmp_path, *flags: str) -> tuple[int, dict]:
    import json

    out = tmp_path / "llama.json"
    rc = bench_llama.main(["--no-compile", "--kinds", "bf16,ours-tensorwise", "--warmup", "1", "--threads", "1",
                           "--json", str(out), "--plot", str(tmp_path / "plot.png"), *flags])
    return rc, json.loads(out.read_text())


def test_sigterm_while_timing_keeps_the_rounds_completed(tmp_path, monkeypatch, capsys):
    """``timeout``'s SIGTERM in the second timing round: the result file is still written, with the round both
    variants completed and the one bf16 completed before the signal (ours was cut short), the run marked stopped and
    the tables saying how many steps each timing has; the exit status says the run is incomplete, and the signal
    handler is put back."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    _stop_at(monkeypatch, "timing", call=4)  # round 2: bf16's call is the 3rd, ours-tensorwise's the 4th
    rc, data = _main(tmp_path, "--sizes", "test", "--reps", "3")
    assert rc == 1 and signal.getsignal(signal.SIGTERM) is before
    assert data["stopped"].startswith("stopped by SIGTERM after ") and "measuring test" in data["stopped"]
    variants = data["sizes"]["test"]["variants"]
    assert [len(variants[k]["times"]) for k in ("bf16", "ours-tensorwise")] == [2, 1]
    assert all(v["status"] == "measured" and v["syncs"] == 0 for v in variants.values())  # profiled before timing
    assert variants["ours-tensorwise"]["saved_bytes"] > 0
    text = docs_tables.llama_step_time(data)
    assert "**Incomplete run (stopped by SIGTERM" in text
    assert ", 2 of 3 steps |" in text and ", 1 of 3 steps |" in text
    assert "incomplete: stopped by SIGTERM" in capsys.readouterr().err


def test_sigterm_before_timing_says_where_the_run_stopped(tmp_path, monkeypatch):
    """SIGTERM during the warm-up of the second variant: nothing is timed, every variant's status says where the run
    stopped, the sizes after it are listed as not run, and the tables render it."""
    _stop_at(monkeypatch, "steps", call=2)  # warm-up: bf16's one step, then ours-tensorwise's
    rc, data = _main(tmp_path, "--sizes", "test,tiny", "--reps", "2")
    assert rc == 1 and list(data["sizes"]) == ["test"]
    assert data["stopped"].endswith("measuring test; not run: tiny")
    for v in data["sizes"]["test"]["variants"].values():
        assert "median_s" not in v
        assert v["status"] == 'not timed: run stopped by SIGTERM at "test: warm-up ours-tensorwise"'
    text = docs_tables.llama_step_time(data)
    assert text.count('not timed: run stopped by SIGTERM at "test: warm-up ours-tensorwise"') == 2
    docs_tables.llama_tables(data)  # every table renders an incomplete run


def test_timeout_on_the_command_line_still_writes_the_result(tmp_path):
    """The real thing: the script in its own process, a SIGTERM from outside once it is timing (as `timeout` sends
    it): exit status 1, and a result file with the timings of the rounds completed."""
    import json
    import signal
    import subprocess

    out = tmp_path / "llama.json"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "bench_llama.py"), "--sizes", "test", "--no-compile", "--kinds",
         "bf16,ours-tensorwise", "--warmup", "1", "--reps", "1000000", "--threads", "1", "--json", str(out),
         "--plot", str(tmp_path / "plot.png")],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        for line in proc.stderr:
            if "timing 2 variants" in line:
                break
        else:
            pytest.fail(f"the script ended without timing (exit {proc.wait()})")
        import time

        time.sleep(1.0)  # some rounds
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 1, rest
    finally:
        proc.kill()
    data = json.loads(out.read_text())
    assert "stopped by SIGTERM" in data["stopped"] and "incomplete: stopped by SIGTERM" in rest
    variants = data["sizes"]["test"]["variants"]
    assert all(0 < len(v["times"]) < 1000000 and v["median_s"] > 0 for v in variants.values())


def test_timings_keep_only_whole_rounds():
    """A stop between a round's wall-time and CPU-time appends leaves one list longer: the timing keeps the rounds
    both have (it used to take the median of an empty list, and the error replaced the stop: no result file)."""
    timings = harness._timings({"a": [1.0, 2.0, 3.0], "b": [5.0]}, {"a": [0.5, 1.0], "b": []}, calls=1)
    assert list(timings) == ["a"] and timings["a"].walls == [1.0, 2.0] and timings["a"].calls == 2


def test_second_sigterm_while_writing_is_ignored(tmp_path, monkeypatch):
    """A second SIGTERM while the result file is being written (``timeout`` sends one; a job scheduler may send
    another) is ignored until the file is written."""
    import signal

    _stop_at(monkeypatch, "timing", call=2)
    real = harness.write_result

    def write_after_another_signal(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "write_result", write_after_another_signal)
    rc, data = _main(tmp_path, "--sizes", "test", "--reps", "2")
    assert rc == 1 and "stopped by SIGTERM" in data["stopped"]


def test_sigterm_before_a_size_or_after_the_last_still_writes(tmp_path, monkeypatch):
    """A stop while the first size's model is being built writes a file with no sizes (no plot, tables render); one
    after the last size, while the end of the run is noted, keeps every size."""
    import signal

    real_stack = bench_llama.make_stack

    def stop_then_build(*args):
        signal.raise_signal(signal.SIGTERM)
        return real_stack(*args)

    monkeypatch.setattr(bench_llama, "make_stack", stop_then_build)
    rc, data = _main(tmp_path, "--sizes", "test", "--reps", "2")
    assert rc == 1 and data["sizes"] == {} and data["stopped"].endswith("measuring test")
    docs_tables.llama_tables(data)
    monkeypatch.setattr(bench_llama, "make_stack", real_stack)
    real_load = harness.load_average
    calls = [0]

    def stop_at_the_end():
        calls[0] += 1
        if calls[0] == 2:  # the first is the environment's, at the start
            signal.raise_signal(signal.SIGTERM)
        return real_load()

    monkeypatch.setattr(harness, "load_average", stop_at_the_end)
    rc, data = _main(tmp_path, "--sizes", "test", "--reps", "2")
    assert rc == 1 and data["stopped"].endswith("after the last size")
    assert all("median_s" in v for v in data["sizes"]["test"]["variants"].values())


def test_compiled_saved_bytes_target_names_a_missing_reference(result):
    """Ours measured, compiled bf16 not: the target row says the reference is missing, not that ours was not
    measured."""
    data = copy.deepcopy(result)
    v = data["sizes"]["test"]["variants"]
    v["ours-tensorwise+compile"]["saved_bytes"] = 1000
    v.pop("bf16+compile", None)
    assert ("`tensorwise`, compiled: saved for backward, in all, at this size ≤ 0.55 × bf16 compiled | "
            "no compiled bf16 reference (not run): n/a") in docs_tables.llama_targets(data)


def test_gpu_targets_have_a_row_for_the_steps_that_do_not_count(result):
    """On a GPU run with ``ours-tensorwise:uncounted`` compiled, the tokens/s targets are also read for the steps that
    ``statistics_every_n_steps`` does not count, each against the same reference."""
    data = copy.deepcopy(result)
    data["device"] = "cuda:0"
    data["sizes"] = {docs_tables.LLAMA_GPU_SIZE: data["sizes"]["test"]}
    variants = data["sizes"][docs_tables.LLAMA_GPU_SIZE]["variants"]
    variants["bf16+compile"] = {**variants["ours-tensorwise+compile"]}
    variants["torchao-tensorwise+compile"] = {**variants["ours-tensorwise+compile"]}
    for key, tokens in (("bf16", 100.0), ("torchao-tensorwise", 110.0), ("ours-tensorwise", 105.0),
                        ("ours-tensorwise:uncounted", 132.0)):
        variants[key + "+compile"]["tokens_per_s"] = tokens
    rows = [line for line in docs_tables.llama_targets(data).splitlines() if "H100-class" in line]
    assert rows == [
        "| H100-class GPU, compiled, llama3-8b at 8192 tokens per step: `tensorwise` ≥ 1.3 × bf16's tokens/s | "
        "1.05×: **missed** |",
        "| H100-class GPU, compiled, llama3-8b at 8192 tokens per step: `tensorwise`, steps not counting ≥ 1.3 × bf16's "
        "tokens/s | 1.32×: met |",
        "| H100-class GPU, compiled, llama3-8b at 8192 tokens per step: `tensorwise` tokens/s ≥ torchao tensorwise's | "
        "0.95×: **missed** |",
        "| H100-class GPU, compiled, llama3-8b at 8192 tokens per step: `tensorwise`, steps not counting tokens/s ≥ "
        "torchao tensorwise's | 1.20×: met |",
    ]


def test_a_failure_keeps_the_kernel_and_the_error_a_compile_worker_reported():
    """An inductor error from a compile worker says only that a subprocess failed on its first line: the status keeps
    that line (for the tables), the detail the kernel's name and the final error (the H200 run lost both)."""
    message = ("SubprocException: An exception occurred in a subprocess:\n\nName=triton_red_fused_cast_0\nTraceback "
               "(most recent call last):\n  File \"x.py\", line 1\ntriton.runtime.errors.PTXASError: PTXAS error: "
               "`ptxas` failed with error code -11\n`ptxas` stderr:\n")
    status, detail = bench_llama.failure(RuntimeError(message))
    assert status == "failed: RuntimeError: SubprocException: An exception occurred in a subprocess:"
    assert detail == ("Name=triton_red_fused_cast_0 | triton.runtime.errors.PTXASError: PTXAS error: `ptxas` failed "
                      "with error code -11")
    assert bench_llama.failure(ValueError("")) == ("failed: ValueError: ", "")


def test_gpu_check_asks_for_variants_the_benchmarks_know():
    """``benchmarks/gpu_check.sh`` runs on a lent GPU with no second try: its default variants (bench and profile)
    are ones the scripts accept, and the compiled ones are among the run's variants."""
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    import re

    kinds = re.search(r"kinds=\$\{KINDS:-([^}]*)\}", script).group(1).split(",")
    compiled = re.search(r"COMPILE_KINDS:-([^}]*)\}", script).group(1).split(",")
    profiled = re.search(r"PROFILE_KINDS:-([^}]*)\}", script).group(1).split(",")
    assert all(bench_llama.valid_kind(k) for k in kinds + compiled), (kinds, compiled)
    assert set(compiled) <= set(kinds)
    assert all(bench_llama.valid_kind(k.removesuffix(":nostats")) for k in profiled), profiled
