#!/usr/bin/env python
"""Render the documentation's benchmark tables from the result files, so that no number is copied by hand.

Usage::

    python benchmarks/docs_tables.py            # rewrite benchmarks/results/tables/*.md from benchmarks/results/*.json
    python benchmarks/docs_tables.py --check    # exit 1 if a table is missing or differs from its JSON

Each table starts with a caption that says what was measured, on which machine, with which versions and
command, and whether the FP8 GEMMs were emulated. The docs pages include the tables with the snippets
extension (``--8<-- "benchmarks/results/tables/<name>.md"``); ``tests/test_doc_numbers.py`` checks that every
table is up to date with its JSON and that the pages carry no hand-typed measurements.

Sources: ``results/linear.json`` (``bench_linear.py``), ``results/core_before.json`` and
``results/core_after.json`` (``bench_core.py`` on lightning-fp8 0.1 and on the core v2),
``results/core_instructions.json`` (callgrind counts of ``layer_overhead_workload.py``),
``results/compare_example.json`` (``bench_compare.py``: ``lightning_fp8.compare`` on the example's config).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
TABLES = os.path.join(RESULTS, "tables")
RECIPES = ("tensorwise", "delayed", "rowwise")


def load(name: str) -> dict[str, Any]:
    """One result file of ``benchmarks/results``."""
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def caption(env: dict[str, str], command: str) -> str:
    """The line above every table: when, where, which versions, which command, emulated or native."""
    cpu = env.get("cpu", "unknown CPU")
    flags = env.get("cpu matrix flags", "")
    if flags and not flags.startswith("none"):
        cpu += f" ({flags})"
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "torchao", "lightning") if k in env)
    path = env.get("GEMM path", "")
    emulated = "emulated" in path or "cuda" not in env.get("device", "cpu")
    what = ("**CPU, emulated FP8 GEMMs**: no FP8 hardware, so the ratios show the cost of the emulation, not FP8 "
            "speed" if emulated else "native FP8 GEMMs")
    busy = ""
    load, cores = env.get("load average at start", ""), re.match(r"\d+", env.get("cores", ""))
    if load and cores and float(load.split()[0]) > int(cores.group(0)) / 2:
        busy = (f" The machine was busy (load average {load.split()[0]} on {cores.group(0)} CPUs): wall-clock "
                "ratios are noisy.")
    return (f"*Measured {env.get('date', '?')} on {cpu}, {env.get('cores', '?')}; {versions}; "
            f"`{command}`. {what}.{busy}*")


def table(headers: list[str], rows: list[list[Any]], right: int = 1) -> str:
    """A Markdown table; the columns from ``right`` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def x(value: float) -> str:
    return f"{value:.2f}×"


# ---------------------------------------------------------------------------------------- bench_linear


def _linear() -> tuple[dict[str, Any], str]:
    data = load("linear.json")
    return data, caption(data["environment"], data["command"])


def linear_saved_bytes() -> str:
    data, cap = _linear()
    mem = data["saved_bytes"]
    m, k, n = mem["shape"]
    rows = []
    for row in mem["rows"].values():
        a, d = row["A"], row["D"]
        ref_a, ref_d = mem["rows"]["bf16"]["A"]["bytes"], mem["rows"]["bf16"]["D"]["bytes"]
        rows.append([a["name"], f"{a['bytes'] / 2**20:.1f}", x(a["bytes"] / ref_a), x(d["bytes"] / ref_d)])
    return cap + "\n\n" + table(
        [f"layer (M = {m}, K = {k}, N = {n})", "MiB, float32 input", "× `nn.Linear` bf16, float32 input",
         "× `nn.Linear` bf16, bf16 input"], rows)


def _speed(data: dict[str, Any]) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    speed = data["step_time"]
    med = {k: statistics.median(v) for k, v in speed["times"].items()}
    low = {k: min(v) for k, v in speed["times"].items()}
    cpu = {k: statistics.median(v) for k, v in speed["cpu"].items()}
    return med, low, cpu


def linear_step_time() -> str:
    data, cap = _linear()
    cfg, speed = data["config"], data["step_time"]
    med, low, cpu = _speed(data)
    ao = med.get("torchao-tensorwise")
    rows = [[speed["names"][k], x(med[k] / med["bf16"]), x(low[k] / low["bf16"]), x(cpu[k] / cpu["bf16"]),
             x(med[k] / ao) if ao else "n/a"] for k in med]
    what = (f"Forward + backward of a block stack (hidden {cfg['hidden']}, MLP {cfg['mlp_ratio']}×, {cfg['tokens']} "
            f"tokens), {cfg['reps']} interleaved timed steps per variant; ratios of the median wall time, the "
            "fastest step and the median process CPU time.")
    return cap + "\n\n" + what + "\n\n" + table(
        ["variant", "× bf16 (median wall)", "× bf16 (fastest)", "× bf16 (CPU time)", "× torchao tensorwise"], rows)


def linear_compile() -> str:
    data, cap = _linear()
    med, _, _ = _speed(data)
    comp = data["step_time"]["compile"]
    if not comp:
        return cap + "\n\n`torch.compile` was not measured in this run (`--quick` or `--no-compile`)."
    rows = []
    for key, info in comp.items():
        kind = key.split("+")[0]
        if "error" in info:
            rows.append([key, info["error"], "", "", ""])
            continue
        rows.append([data["step_time"]["names"][key], f"{info['compile_s']:.0f} s", info["graph_breaks"],
                     x(med[key] / med[kind]), x(med[key] / med["bf16"])])
    return cap + "\n\n" + table(["variant (inductor)", "compile time (first 2 steps)", "graph breaks",
                                 "× eager, same variant", "× bf16 eager"], rows)


def linear_syncs() -> str:
    data, cap = _linear()
    syncs = data["syncs"]
    rows = [[r["name"], r["syncs"], r["ops"], f"{r['ops'] / syncs['linears']:.0f}"] for r in syncs["rows"].values()]
    return cap + "\n\n" + table(["variant", "host syncs per fwd+bwd", "aten ops per fwd+bwd",
                                 "aten ops per Linear layer"], rows)


def linear_statistics() -> str:
    data, cap = _linear()
    st = data["statistics"]
    m, k, n = st["shape"]
    md = {key: statistics.median(v) for key, v in st["public"].items()}
    mn = {key: min(v) for key, v in st["public"].items()}
    rows = []
    for r in RECIPES:
        cells = [r]
        for what in ("fwd+bwd", "fwd"):
            tr, ev = f"{r}|train|{what}", f"{r}|eval|{what}"
            cells += [x(md[tr] / md[ev]), x(mn[tr] / mn[ev])]
        rows.append(cells)
    internal = st["internal"]
    plain = internal["plain (x * scale).clamp().to(fp8) [reference]"]
    counted = internal["cast_with_statistics(x, scale) [cast + counts]"]
    return (cap + f"\n\nOne `FP8Linear` (M = {m}, K = {k}, N = {n}): the same layer in `train()` (casts with "
            "statistics, state update) against `eval()` (the same casts without statistics):\n\n"
            + table(["recipe", "fwd+bwd train ÷ eval (median)", "(fastest)", "forward train ÷ eval (median)",
                     "(fastest)"], rows)
            + f"\n\nOne {m} × {k} float32 cast to E4M3 with its overflow/underflow counts took "
            f"{x(counted / plain)} a plain saturating cast on this CPU (eager; on CUDA the fused Triton kernel "
            "counts in the same pass).")


def sqnr() -> str:
    data, cap = _linear()
    s = data["sqnr"]
    rows = [[r["name"]] + [f"{v:.2f}" for v in r["db"]] for r in s["rows"].values()]
    return cap + "\n\n" + table(["variant", *(f"{t} (dB)" for t in s["tensors"])], rows)


def recipes_measured() -> str:
    data, cap = _linear()
    sq = data["sqnr"]["rows"]
    mem = data["saved_bytes"]["rows"]
    _, _, cpu = _speed(data)

    def db(key: str) -> str:
        return " / ".join(f"{v:.1f}" for v in sq[key]["db"]) + " dB" if key in sq else "n/a"

    rows = [
        ["SQNR output / grad_input / grad_weight, `hybrid`"] + [db(f"ours-{r}-hybrid") for r in RECIPES],
        ["same, `e4m3`"] + [db(f"ours-{r}-e4m3") for r in RECIPES],
        ["bytes saved for backward vs `nn.Linear` under bf16 autocast"]
        + [x(mem[f"ours-{r}"]["A"]["bytes"] / mem["bf16"]["A"]["bytes"]) for r in RECIPES],
        # against the peer that emulates the same way: a ratio to bf16 mostly measures the CPU's bf16 matmul speed
        ["eager step time vs torchao tensorwise (both emulated), process CPU time"]
        + [x(cpu[f"ours-{r}"] / cpu["torchao-tensorwise"]) if "torchao-tensorwise" in cpu else "n/a" for r in RECIPES],
    ]
    return cap + "\n\n" + table(["measured", *(f"`{r}`" for r in RECIPES)], rows)


# ---------------------------------------------------------------------------------------- core v2


def core_bookkeeping() -> str:
    before, after = load("core_before.json"), load("core_after.json")
    rows = []
    for r in RECIPES:
        b, a = before["bookkeeping_ops"][r], after["bookkeeping_ops"][r]
        rows.append([f"`{r}`", f"{b['8']} / {b['96']}", f"{a['8']} / {a['96']}"])
    return (caption(after["environment"], "python benchmarks/bench_core.py") + "\n\n"
            + table(["recipe", "0.1: 8 / 96 layers", "core v2: 8 / 96 layers"], rows))


def core_step_time() -> str:
    before, after = load("core_before.json"), load("core_after.json")
    cfg = after["config"]
    rows = []
    for r in RECIPES:
        cells = [f"`{r}`"]
        for res in (before, after):
            t = res["times"]["step"]
            cells.append(f"{x(t[r]['median'] / t['plain']['median'])} wall, {x(t[r]['cpu'] / t['plain']['cpu'])} CPU")
        rows.append(cells)
    return (caption(after["environment"], "python benchmarks/bench_core.py")
            + f"\n\nForward + backward + bookkeeping of {cfg['layers']} FP8 layers ({cfg['width']} × {cfg['width']}, "
            f"{cfg['tokens']} tokens, float32) against {cfg['layers']} `nn.Linear`, one run of each tree:\n\n"
            + table(["recipe", "0.1", "core v2"], rows))


def core_instructions() -> str:
    data = load("core_instructions.json")
    env = data["environment"]
    cap = (f"*Measured {env['date']} on {env['cpu']}, {env['cores']}; torch {env['torch']}; callgrind instruction "
           f"counts of `benchmarks/layer_overhead_workload.py`: {env['before']} against {env['after']}. Instruction "
           "counts do not depend on the load of the machine.*")
    rows = []
    for mode, label in (("fwd", "forward"), ("step", "training step")):
        for r, v in data["per_layer"][mode].items():
            b, a = v["before"], v["after"]
            change = f"{(a - b) / b:+.1%}" if b else "not measured"
            rows.append([f"`{r}`", label, f"{b:,}" if b else "not measured", f"{a:,}", change])
    return cap + "\n\n" + table(["recipe", "per layer", "0.1", "core v2", "change"], rows)


# ---------------------------------------------------------------------------------------- compare


def compare_example() -> str:
    from lightning_fp8.compare import PrecisionComparison

    data = load("compare_example.json")
    report = PrecisionComparison.from_dict(data["comparison"]).to_markdown()
    return caption(data["environment"], data["command"]) + "\n\n" + report.rstrip("\n")


RENDERERS: dict[str, Callable[[], str]] = {
    "compare_example.md": compare_example,
    "linear_saved_bytes.md": linear_saved_bytes,
    "linear_step_time.md": linear_step_time,
    "linear_compile.md": linear_compile,
    "linear_syncs.md": linear_syncs,
    "linear_statistics.md": linear_statistics,
    "sqnr.md": sqnr,
    "recipes_measured.md": recipes_measured,
    "core_bookkeeping.md": core_bookkeeping,
    "core_step_time.md": core_step_time,
    "core_instructions.md": core_instructions,
}


def render_all() -> dict[str, str]:
    """Every table, by file name, rendered from the result files as they are now."""
    return {name: fn() + "\n" for name, fn in RENDERERS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    os.makedirs(TABLES, exist_ok=True)
    for name, text in render_all().items():
        path = os.path.join(TABLES, name)
        current = None
        if os.path.exists(path):
            with open(path) as f:
                current = f.read()
        if args.check:
            if current != text:
                stale.append(name)
        elif current != text:
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote {os.path.relpath(path)}")
    if stale:
        print(f"stale tables (run python benchmarks/docs_tables.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
