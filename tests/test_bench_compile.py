"""benchmarks/bench_compile.py on a tiny stack: the measurement code runs, its result file has what the docs table
needs, and it shows what the experiment exists to show: compiled block by block, our layers' blocks share one graph
whatever the depth, so no block is left to run eager past torch's recompile limit (no timing is asserted: speed is
only reported, as a ratio)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_compile
import docs_tables
import harness
from utils import bench_result

DEPTHS = (1, 2)
KINDS = ("bf16", "ours-tensorwise")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    """One run of the script's measurement code: the test size at depths 1 and 2, bf16 and our tensorwise, both
    compile scopes, with dynamo alone (``backend="eager"``: the frames, graphs and recompilations without inductor's
    compile time), written and read back as the script does. One thread: steadier on a loaded machine."""
    return bench_result(
        tmp_path_factory, "compile", "python benchmarks/bench_compile.py --depths 1,2",
        lambda: bench_compile.run(DEPTHS, KINDS, bench_compile.SCOPES, backend="eager", width="test", warmup=1, reps=2,
                                  log=lambda message: None),
    )


def test_result_file_structure(result):
    assert {"environment", "command", "device", "config", "depths", "torchao", "load_average_end",
            "compiler_warmup_s"} <= set(result)
    assert result["environment"]["load average at start"]
    config = result["config"]
    assert config["backend"] == "eager" and config["scopes"] == ["model", "blocks"] and config["kinds"] == list(KINDS)
    assert config["recompile_limit"] == torch._dynamo.config.recompile_limit
    assert set(result["depths"]) == {str(d) for d in DEPTHS}
    for depth, res in result["depths"].items():
        assert res["size"]["blocks"] == int(depth) and res["size"]["hidden"] == 64
        assert set(res["variants"]) == set(KINDS)
        for kind, v in res["variants"].items():
            assert v["eager"]["status"] == "measured" and len(v["eager"]["times"]) == 2
            for scope in bench_compile.SCOPES:
                c = v[scope]
                assert c["status"] == "measured", (depth, kind, scope, c["status"])
                assert c["first_step_s"] > 0 and len(c["times"]) == 2
                assert c["fastest_s"] <= c["median_s"] and c["cpu_s"] > 0
                for field in ("frames", "frames_attempted", "graphs", "graph_breaks", "recompiles", "limit_failures",
                              "compiled_regions_per_step", "blocks_run_eager", "recompiles_after_warmup"):
                    assert isinstance(c[field], int), (depth, kind, scope, field)
                assert isinstance(c["recompile_limit_hit"], bool) and isinstance(c["recompile_reasons"], list)
                # where the first step's compile time went, by torch's phase names (dynamo alone here: no inductor)
                assert set(c["compile_phases_s"]) == set(harness.COMPILE_PHASES)
                assert 0 < c["compile_phases_s"]["bytecode_tracing"] < c["first_step_s"]
                assert c["compile_phases_s"]["compile_file"] == 0
                check = c["gradient_check"]
                assert check["zero_gradients"] == 0 and check["relative_difference"] <= 0.25


def test_no_block_runs_eager_no_graph_break_no_recompilation(result):
    for depth, res in result["depths"].items():
        for kind, v in res["variants"].items():
            for scope in bench_compile.SCOPES:
                c = v[scope]
                where = (depth, kind, scope)
                assert (c["graph_breaks"], c["recompiles"], c["recompiles_after_warmup"]) == (0, 0, 0), where
                assert not c["recompile_limit_hit"] and c["limit_failures"] == 0, where
                assert c["frames_attempted"] == c["frames"], where
                assert c["blocks_run_eager"] == 0, where


def test_model_scope_is_one_frame_one_graph_one_region(result):
    for res in result["depths"].values():
        for v in res["variants"].values():
            c = v["model"]
            assert (c["frames"], c["graphs"], c["compiled_regions_per_step"]) == (1, 1, 1)


def test_blocks_share_one_graph_whatever_the_depth(result):
    """What the experiment exists to show: compiled block by block, our layers' blocks share the graph of the first
    (a layer's row in the state table is no constant of the graph), so the graphs do not grow with the depth; and
    every block runs compiled (one compiled region per block and step)."""
    for kind in KINDS:
        graphs = {d: result["depths"][str(d)]["variants"][kind]["blocks"]["graphs"] for d in DEPTHS}
        assert graphs == {d: 1 for d in DEPTHS}, (kind, graphs)
        regions = {d: result["depths"][str(d)]["variants"][kind]["blocks"]["compiled_regions_per_step"] for d in DEPTHS}
        assert regions == {d: d for d in DEPTHS}, (kind, regions)


class _Numbered(nn.Module):
    """A block whose forward reads an int attribute that differs per block: a constant of the graph, so every block
    compiles a graph of its own (what a layer's row in the state table was)."""

    def __init__(self, number: int) -> None:
        super().__init__()
        self.number = number
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.number


def test_recompile_limit_hit_is_detected():
    """What torch 2.13 records when identical blocks compiled one by one each need a graph and there are more of
    them than the recompile limit: a failed compile ``Dynamo recompile limit exceeded``, and the blocks after it run
    eager (no compiled region)."""
    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    depth = limit + 3
    blocks = nn.Sequential(*(_Numbered(i) for i in range(depth)))
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, backend="eager")
    x = torch.randn(2, 8, requires_grad=True)
    try:
        with bench_compile.DynamoRecord() as record:
            blocks(x).sum().backward()
        summary = record.summary()
        regions = bench_compile.compiled_regions(lambda: blocks(x))
    finally:
        torch._dynamo.reset()
    assert summary["recompile_limit_hit"] and summary["limit_failures"] == 1
    assert summary["graphs"] == limit and summary["recompiles"] == limit - 1
    assert summary["frames_attempted"] == summary["frames"] + 1
    assert all("self.number ==" in reason for reason in summary["recompile_reasons"])
    assert regions == limit  # the blocks past the limit ran eager


def test_docs_table_renders_the_result(result):
    text = docs_tables.compile_depth(result)
    head = text.splitlines()[0]
    assert head.startswith("*Measured ") and "emulated" in head and "bench_compile.py" in head
    assert "| 2 | ours tensorwise | `blocks` | 1 | 1 | 0 | 0 | 2 | no |" in text
    assert text.count("| `model` |") == len(DEPTHS) * len(KINDS)
    # the table is registered once its result file exists (before the first run, no table and no page asks for one)
    exists = os.path.exists(os.path.join(docs_tables.RESULTS, "compile.json"))
    assert ("compile_depth.md" in docs_tables.RENDERERS) == exists
    assert docs_tables.PENDING["compile_depth.md"][0] == "compile.json"


def test_command_line(capsys):
    with pytest.raises(SystemExit):
        bench_compile.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--depths", "--size", "--kinds", "--scopes", "--backend", "--warmup", "--reps", "--threads", "--device",
                 "--json"):
        assert flag in text, flag
    with pytest.raises(SystemExit):
        bench_compile.main(["--scopes", "layers"])
    assert "unknown ['layers']" in capsys.readouterr().err
