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
``results/compare_example.json`` (``bench_compare.py``: ``lightning_fp8.compare`` on the example's config),
``results/convergence.json`` (``bench_convergence.py``: validation loss of FP8 training against bf16),
``results/llama.json``, ``results/llama_gpu.json`` and ``results/llama_gpu_nov29.json`` (``bench_llama.py`` on this
CPU and twice on an H200: Llama-style decoder blocks under bf16, torchao and every recipe, eager and compiled),
``results/compiled_saved.json``
(``compiled_saved.py``: what those blocks keep for backward compiled on the GPU's GEMM path, forced on a CPU),
``results/compile.json``
(``bench_compile.py``: those blocks compiled whole or block by block, cold, at several depths; its table is rendered
once the file exists: see ``PENDING``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
TABLES = os.path.join(RESULTS, "tables")
#: The recipes of the core v2 result files (``bench_core.py``); the linear tables take theirs from ``linear.json``.
RECIPES = ("tensorwise", "delayed", "rowwise")


def load(name: str) -> dict[str, Any]:
    """One result file of ``benchmarks/results``."""
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def caption(env: dict[str, str], command: str, emulated_note: str | None = None, gemm_note: str | None = None) -> str:
    """The line above every table: when, where, which versions, which command, emulated or native
    (``emulated_note``: what the emulation means for this table, instead of the note about speed ratios;
    ``gemm_note``: what to say about the GEMMs instead, for a run that is neither)."""
    cpu = env.get("cpu", "unknown CPU")
    flags = env.get("cpu matrix flags", "")
    if flags and not flags.startswith("none"):
        cpu += f" ({flags})"
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "torchao", "lightning") if k in env)
    path = env.get("GEMM path", "")
    emulated = "emulated" in path or "cuda" not in env.get("device", "cpu")
    what = gemm_note or ("**CPU, emulated FP8 GEMMs**: " + (emulated_note or "no FP8 hardware, so the ratios show the "
                                                             "cost of the emulation, not FP8 speed")
                         if emulated else "native FP8 GEMMs")
    busy = ""
    load, cores = env.get("load average at start", ""), re.match(r"\d+", env.get("cores", ""))
    if load and cores and float(load.split()[0]) > int(cores.group(0)) / 2:
        busy = (f" The machine was busy (load average {load.split()[0]} on {cores.group(0)} CPUs): wall-clock "
                "ratios are noisy.")
    device = env.get("device", "")
    if device.startswith("cuda"):  # a GPU run: the GPU first, the host after it
        cpu = f"{device.split(': ', 1)[-1]}, host {cpu}"
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


def _linear_recipes(data: dict[str, Any]) -> list[str]:
    """Our recipes in the run (older result files list none: their three)."""
    return data.get("recipes", list(RECIPES))


def _not_measured(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The torchao variants the run could not measure (kind -> status with the reason)."""
    return {kind: info for kind, info in data.get("torchao", {}).items() if not info["measured"]}


def _with_not_measured(data: dict[str, Any], keys: list[str]) -> list[str]:
    """``keys`` (a table's variants) with the torchao variants that were not measured, each placed after the
    torchao variant before it in torchao's order (or before the one after it)."""
    order = list(data.get("torchao", {}))
    out = list(keys)
    for kind in _not_measured(data):
        i = order.index(kind)
        before = [k for k in order[:i] if k in out]
        after = [k for k in order[i + 1:] if k in out]
        out.insert(out.index(before[-1]) + 1 if before else out.index(after[0]) if after else len(out), kind)
    return out


def _not_measured_row(data: dict[str, Any], kind: str, cells: int) -> list[str]:
    return [data["torchao"][kind]["name"], "not measured", *([""] * (cells - 1))]


def _not_measured_notes(data: dict[str, Any]) -> str:
    """The reasons, one line per torchao variant that was not measured (empty if none)."""
    return "".join(f"\n\n*Not measured: {info['name']}: {info['reason']}.*" for info in _not_measured(data).values())


def linear_saved_bytes() -> str:
    data, cap = _linear()
    mem = data["saved_bytes"]
    m, k, n = mem["shape"]
    rows = []
    ref_a, ref_d = mem["rows"]["bf16"]["A"]["bytes"], mem["rows"]["bf16"]["D"]["bytes"]
    failed = []
    for kind in _with_not_measured(data, list(mem["rows"])):
        if kind not in mem["rows"]:
            rows.append(_not_measured_row(data, kind, 3))
            continue
        a, d = mem["rows"][kind]["A"], mem["rows"][kind]["D"]
        cells = [a["name"]]
        cells += [f"{a['bytes'] / 2**20:.1f}", x(a["bytes"] / ref_a)] if a["bytes"] is not None else ["failed", "failed"]
        cells.append(x(d["bytes"] / ref_d) if d["bytes"] is not None else "failed")
        failed += [f"{cell['name']} with a {what} input: {cell['error']}"
                   for what, cell in (("float32", a), ("bf16", d)) if cell["bytes"] is None]
        rows.append(cells)
    notes = "".join(f"\n\n*Failed: {line}.*" for line in failed)
    return cap + "\n\n" + table(
        [f"layer (M = {m}, K = {k}, N = {n})", "MiB, float32 input", "× `nn.Linear` bf16, float32 input",
         "× `nn.Linear` bf16, bf16 input"], rows) + notes + _not_measured_notes(data)


def _speed(data: dict[str, Any]) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    speed = data["step_time"]
    med = {k: statistics.median(v) for k, v in speed["times"].items()}
    low = {k: min(v) for k, v in speed["times"].items()}
    cpu = {k: statistics.median(v) for k, v in speed["cpu"].items()}
    return med, low, cpu


def _same_recipe(data: dict[str, Any], kind: str, values: dict[str, float]) -> str:
    """``values[kind]`` against torchao's variant of the same recipe, for our eager variants."""
    if not kind.startswith("ours-") or "+" in kind:
        return ""
    twin = "torchao-" + kind.split("-", 1)[1]
    if twin in values:
        return x(values[kind] / values[twin])
    return "not measured" if twin in data.get("torchao", {}) else "none in torchao"


def linear_step_time() -> str:
    data, cap = _linear()
    cfg, speed = data["config"], data["step_time"]
    med, low, cpu = _speed(data)
    ao = med.get("torchao-tensorwise")
    same_recipe = "torchao" in data  # older result files measured torchao tensorwise only
    rows = []
    for k in _with_not_measured(data, list(med)):
        if k not in med:
            rows.append(_not_measured_row(data, k, 5 if same_recipe else 4))
            continue
        row = [speed["names"][k], x(med[k] / med["bf16"]), x(low[k] / low["bf16"]), x(cpu[k] / cpu["bf16"]),
               x(med[k] / ao) if ao else "n/a"]
        rows.append(row + ([_same_recipe(data, k, med)] if same_recipe else []))
    what = (f"Forward + backward of a block stack (hidden {cfg['hidden']}, MLP {cfg['mlp_ratio']}×, {cfg['tokens']} "
            f"tokens), {cfg['reps']} interleaved timed steps per variant; ratios of the median wall time, the "
            "fastest step and the median process CPU time"
            + (", and of the median wall time to torchao's layer for the same recipe." if same_recipe else "."))
    headers = ["variant", "× bf16 (median wall)", "× bf16 (fastest)", "× bf16 (CPU time)", "× torchao tensorwise"]
    return cap + "\n\n" + what + "\n\n" + table(
        headers + (["× torchao, same recipe"] if same_recipe else []), rows) + _not_measured_notes(data)


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
            rows.append([data["step_time"]["names"].get(kind, kind) + " + torch.compile", info["error"], "", "", ""])
            continue
        rows.append([data["step_time"]["names"][key], f"{info['compile_s']:.0f} s", info["graph_breaks"],
                     x(med[key] / med[kind]), x(med[key] / med["bf16"])])
    return cap + "\n\n" + table(["variant (inductor)", "compile time (first 2 steps)", "graph breaks",
                                 "× eager, same variant", "× bf16 eager"], rows)


def linear_syncs() -> str:
    data, cap = _linear()
    syncs = data["syncs"]
    rows = []
    for kind in _with_not_measured(data, list(syncs["rows"])):
        if kind not in syncs["rows"]:
            rows.append(_not_measured_row(data, kind, 3))
            continue
        r = syncs["rows"][kind]
        rows.append([r["name"], r["syncs"], r["ops"], f"{r['ops'] / syncs['linears']:.0f}"])
    return cap + "\n\n" + table(["variant", "host syncs per fwd+bwd", "aten ops per fwd+bwd",
                                 "aten ops per Linear layer"], rows) + _not_measured_notes(data)


def linear_statistics() -> str:
    data, cap = _linear()
    st = data["statistics"]
    m, k, n = st["shape"]
    md = {key: statistics.median(v) for key, v in st["public"].items()}
    mn = {key: min(v) for key, v in st["public"].items()}
    rows = []
    for r in _linear_recipes(data):
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
    rows = []
    for kind in _with_not_measured(data, list(s["rows"])):
        if kind not in s["rows"]:
            rows.append(_not_measured_row(data, kind, len(s["tensors"])))
            continue
        rows.append([s["rows"][kind]["name"]] + [f"{v:.2f}" for v in s["rows"][kind]["db"]])
    return cap + "\n\n" + table(["variant", *(f"{t} (dB)" for t in s["tensors"])], rows) + _not_measured_notes(data)


def recipes_measured() -> str:
    data, cap = _linear()
    recipes = _linear_recipes(data)
    sq = data["sqnr"]["rows"]
    mem = data["saved_bytes"]["rows"]
    _, _, cpu = _speed(data)

    def db(key: str) -> str:
        return " / ".join(f"{v:.1f}" for v in sq[key]["db"]) + " dB" if key in sq else "n/a"

    rows = [
        ["SQNR output / grad_input / grad_weight, `hybrid`"] + [db(f"ours-{r}-hybrid") for r in recipes],
        ["same, `e4m3`"] + [db(f"ours-{r}-e4m3") for r in recipes],
        ["bytes saved for backward vs `nn.Linear` under bf16 autocast"]
        + [x(mem[f"ours-{r}"]["A"]["bytes"] / mem["bf16"]["A"]["bytes"]) for r in recipes],
        # against the peer that emulates the same way: a ratio to bf16 mostly measures the CPU's bf16 matmul speed
        ["eager step time vs torchao tensorwise (both emulated), process CPU time"]
        + [x(cpu[f"ours-{r}"] / cpu["torchao-tensorwise"]) if "torchao-tensorwise" in cpu else "n/a" for r in recipes],
    ]
    if "torchao" in data:  # older result files measured torchao tensorwise only
        rows.append(["same, vs torchao's layer for the same recipe"]
                    + [_same_recipe(data, f"ours-{r}", cpu) for r in recipes])
    return cap + "\n\n" + table(["measured", *(f"`{r}`" for r in recipes)], rows) + _not_measured_notes(data)


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


# ---------------------------------------------------------------------------------------- bench_convergence

CONVERGENCE_BASELINE, CONVERGENCE_TORCHAO = "bf16", "torchao"
#: Issue 12's targets for the plain model: gap to bf16 at most this (%), for these recipes, and at most this many
#: percentage points above torchao's gap in the same run.
CONVERGENCE_TARGET_PCT, CONVERGENCE_TARGET_RECIPES, CONVERGENCE_TORCHAO_PP = 0.5, ("fp8-tensorwise", "fp8-delayed"), 0.2


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def _most_underflow(stats: dict[str, Any]) -> tuple[float, str] | None:
    fracs = [(v, k) for k, v in stats.items() if k.endswith("/underflow_frac") and not k.startswith("fp8/worst/")]
    if not fracs:
        return None
    value, key = max(fracs)
    layer, tensor = key[len("fp8/"):].rsplit("/", 2)[:2]
    return value, f"{layer} {tensor}"


def convergence_summary(data: dict[str, Any], scenario: str) -> dict[str, dict[str, Any]]:
    """Per variant of a scenario of ``results/convergence.json``: the final validation loss over the seeds, the
    per-seed relative gap to bf16 (%) and its spread, the gap minus torchao's (percentage points), and the largest
    FP8 underflow fraction of the run (the FP8 statistics of the whole run, mean over the seeds)."""
    variants = data["scenarios"][scenario]["variants"]
    base = variants.get(CONVERGENCE_BASELINE, {})
    ao = variants.get(CONVERGENCE_TORCHAO, {})

    def gap(runs: dict[str, Any], seed: str) -> float:
        return 100 * (runs[seed]["final_val_loss"] / base[seed]["final_val_loss"] - 1)

    out: dict[str, dict[str, Any]] = {}
    for name, runs in variants.items():
        seeds = sorted(runs, key=int)
        entry: dict[str, Any] = {"seeds": [int(s) for s in seeds],
                                 "final_val_loss": _spread([runs[s]["final_val_loss"] for s in seeds])}
        paired = [s for s in seeds if s in base]
        if name != CONVERGENCE_BASELINE and paired:
            entry["gap_pct"] = _spread([gap(runs, s) for s in paired])
            hp = [s for s in paired if runs[s].get("final_val_loss_bf16_eval") is not None]
            if hp:  # the same weights evaluated without FP8: the part of the gap the training made
                entry["gap_bf16_eval_pct"] = _spread(
                    [100 * (runs[s]["final_val_loss_bf16_eval"] / base[s]["final_val_loss"] - 1) for s in hp])
            with_ao = [s for s in paired if s in ao]
            if name != CONVERGENCE_TORCHAO and with_ao:
                entry["minus_torchao_pp"] = _spread([gap(runs, s) - gap(ao, s) for s in with_ao])
        worst = [w for w in (_most_underflow(runs[s].get("fp8_stats") or {}) for s in seeds) if w is not None]
        if worst:
            entry["most_underflow"] = {"mean_frac": statistics.fmean(v for v, _ in worst),
                                       "where": statistics.mode(w for _, w in worst)}
        if runs[seeds[0]].get("exclude") is not None:
            entry["exclude"] = sorted({n for s in seeds for n in runs[s]["exclude"]})
        out[name] = entry
    return out


def convergence_table(data: dict[str, Any], scenario: str) -> str:
    """The table of one scenario of ``bench_convergence.py``'s result file (also printed by the script)."""
    cfg = data["config"]
    summary = convergence_summary(data, scenario)
    plain = scenario == "plain"
    headers = ["variant", "seeds", "final val loss (mean)", "gap to bf16 (mean ± std)", "gap per seed (min … max)",
               "gap − torchao's (pp, mean)", "gap, evaluated in bf16 (mean)", "largest underflow fraction (where)"]
    if plain:
        headers.append("target (≤ 0.5 %, ≤ torchao + 0.2 pp)")
    rows = []
    for name, s in summary.items():
        g, d, u, h = s.get("gap_pct"), s.get("minus_torchao_pp"), s.get("most_underflow"), s.get("gap_bf16_eval_pct")
        row = [f"`{name}`", len(s["seeds"]), f"{s['final_val_loss']['mean']:.4f}",
               f"{g['mean']:+.2f} % ± {g['std']:.2f}" if g else "reference",
               f"{g['min']:+.2f} … {g['max']:+.2f} %" if g else "",
               f"{d['mean']:+.2f}" if d else "",
               f"{h['mean']:+.2f} %" if h else "",
               f"{100 * u['mean_frac']:.1f} % ({u['where']})" if u else "n/a"]
        if plain:
            if name in CONVERGENCE_TARGET_RECIPES and g and d:
                met = g["mean"] <= CONVERGENCE_TARGET_PCT and d["mean"] <= CONVERGENCE_TORCHAO_PP
                row.append("met" if met else "**missed**")
            else:
                row.append("")
        rows.append(row)
    base = summary.get(CONVERGENCE_BASELINE)
    spread = ""
    if base:
        b = base["final_val_loss"]
        spread = (f" Seed-to-seed spread of bf16's final validation loss: std {100 * b['std'] / b['mean']:.2f} % of the "
                  f"mean ({b['min']:.4f} … {b['max']:.4f}).")
    tokens = cfg["seq_len"] * cfg["batch_size"]
    what = (f"`ByteTransformerLM` of `examples/fp8_lm/train.py` (dim {cfg['dim']}, {cfg['n_layers']} blocks, "
            f"{cfg['n_heads']} heads) on the standard library's source, {cfg['steps']} steps of {cfg['batch_size']} × "
            f"{cfg['seq_len']} bytes ({tokens} tokens), AdamW lr {cfg['lr']:g} with {cfg['warmup_steps']} warm-up steps "
            f"and cosine decay, gradient clipping {cfg['gradient_clip_val']:g}; each variant from the same initial weights "
            f"on the same batches per seed. Final val loss: {cfg['val_windows']} validation windows after the last "
            "step (FP8 variants evaluate in FP8; \"evaluated in bf16\": the same weights with `fp8_eval=False`, "
            "what the training alone cost). Gap: per seed, (loss − bf16's loss) / bf16's loss, then the mean and "
            "sample std over the seeds; positive is worse than bf16. `torchao`: `convert_to_float8_training`, "
            f"`Float8LinearConfig(emulate=True)`, {cfg['torchao_recipe']}, under `bf16-mixed`.")
    if not plain:
        factor = cfg["outlier_factor"]
        exp = math.log2(factor)
        what += (f" Planted massive activations: the input tokens at positions {cfg['outlier_positions']} of "
                 f"{', '.join(f'`{p}`' for p in cfg['outlier_layers'])} multiplied by 2^{exp:.0f} and the layer's output "
                 "rows by its inverse (the identity in exact arithmetic and in bf16). `+exclude`: the `exclude` list of "
                 f"`sensitivity_report` (tensorwise, {cfg['sensitivity_batches']} training batches of the initial model)")
        excluded = summary.get("fp8-tensorwise+exclude", {}).get("exclude")
        what += f": {', '.join(f'`{n}`' for n in excluded)}." if excluded else "."
        same = [r.get("identical_to_plain") for r in data["scenarios"][scenario]["variants"].get(
            CONVERGENCE_BASELINE, {}).values()]
        if same and all(same):
            what += (" `bf16` is the plain model's run of each seed: the planted model reproduces it bit for bit "
                     f"(training losses equal on the {same[0]['checked_steps']} steps checked per seed).")
    added = ""
    for extra in data.get("additions", []):
        names = sorted({v for vs in extra["variants"].values() for v in vs})
        added += f" {', '.join(f'`{n}`' for n in names)} added {extra['date']} by `{extra['command']}`."
    note = "FP8's numerics exactly (FP8 casts and scales, float32 accumulation); only the speed is not FP8's"
    return (caption(data["environment"], data["command"], note) + "\n\n" + what + spread + added + "\n\n"
            + table(headers, rows, right=1))


def convergence_plain() -> str:
    return convergence_table(load("convergence.json"), "plain")


def convergence_outliers() -> str:
    return convergence_table(load("convergence.json"), "outliers")


# ---------------------------------------------------------------------------------------- bench_llama

LLAMA_BF16, LLAMA_TORCHAO = "bf16", "torchao-tensorwise"
#: torchao recipes that one of ours matches (same scaling granularity): compared like for like too
LLAMA_TORCHAO_LIKE = ("torchao-rowwise",)
#: Issue 11's targets: bytes saved for backward at most this times bf16's, for these recipes.
LLAMA_SAVED_TARGET, LLAMA_SAVED_RECIPES = 0.55, ("tensorwise", "delayed", "rowwise")
#: On an H100-class GPU, compiled, Llama3-8B-shaped blocks at 8192 tokens per step: at least this times bf16's tokens/s.
LLAMA_GPU_SPEEDUP, LLAMA_GPU_SIZE = 1.3, "llama3-8b"


def _llama_caption(data: dict[str, Any]) -> str:
    note = ("no FP8 hardware: the FP8 GEMMs multiply FP8 values in float32 (ours) or dequantized values (torchao), so "
            "the speed ratios show the cost of the emulation, not FP8 speed")
    text = caption(data["environment"], data["command"], note)
    if data.get("stopped"):  # a run cut short by a time limit: say so above every table
        text += (f"\n\n**Incomplete run ({data['stopped']}): variants timed in fewer rounds than asked for say so, the "
                 "others say where the run stopped.**")
    return text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _llama_size_head(size: dict[str, Any]) -> str:
    return (f"**{size['name']}**: {_plural(size['blocks'], 'block')}, hidden {size['hidden']}, FFN {size['ffn']}, "
            f"{_plural(size['heads'], 'head')}, {_plural(size['kv_heads'], 'KV head')}, {size['batch']} × {size['seq']} = "
            f"{size['tokens']} tokens per step")


def _llama_kinds(data: dict[str, Any]) -> list[str]:
    return list(data["config"]["kinds"])


def _llama_ok(v: dict[str, Any] | None) -> bool:
    return v is not None and "median_s" in v


def _llama_status(v: dict[str, Any] | None) -> str:
    if v is None:
        return "not run"
    return "not timed" if v["status"] == "measured" else v["status"]


def _llama_unmeasured(v: dict[str, Any] | None) -> str:
    """The cell of a field a variant lacks: its status, or, for a variant that was measured, that the run predates
    the field."""
    if v is None:
        return ""
    if v["status"] != "measured":
        return v["status"]
    return v.get("saved_bytes_unmeasured", "not measured in this run")


def _llama_ratio(variants: dict[str, Any], key: str, ref: str, field: str = "median_s") -> str:
    a, b = variants.get(key), variants.get(ref)
    if not (_llama_ok(a) and _llama_ok(b)) or a.get(field) is None or not b.get(field):
        return "n/a"
    return x(a[field] / b[field])


def _ms_spread(v: dict[str, Any], reps: int) -> str:
    """The median in ms and the spread; ``reps``: the rounds asked for (an incomplete run may have fewer)."""
    med = v["median_s"]
    rounds = len(v.get("times", ())) or reps
    return (f"{med * 1e3:.1f} ({100 * (v['fastest_s'] / med - 1):+.0f} % … "
            f"{100 * (v['slowest_s'] / med - 1):+.0f} %)" + (f", {rounds} of {reps} steps" if rounds < reps else ""))


def llama_step_time(data: dict[str, Any] | None = None) -> str:
    data = data or load("llama.json")
    cuda = "cuda" in data.get("device", "cpu")
    out = [_llama_caption(data), "",
           f"Training step (forward, backward, `AdamW(fused=True)` step; our recipes also roll the amax histories), "
           f"{_plural(data['config']['reps'], 'step')} per variant after {_plural(data['config']['warmup'], 'warm-up step')}, "
           "interleaved round-robin across all variants. ms: the median, in brackets the fastest and the slowest step "
           "against it. Ratios of the medians, each mode against the same mode (eager against eager, compiled against "
           "compiled); `(CPU time)`: the same ratio of the median process CPU times, steadier than wall time on a shared "
           "machine; `compiled ÷ eager`: the same variant."
           + (" MFU: model FLOPs per second over the GPU's dense peak (bf16 peak for bf16, FP8 peak for the FP8 "
              "variants)." if cuda else "")]
    for res in data["sizes"].values():
        variants = res["variants"]
        rows = []
        for kind in _llama_kinds(data):
            e, c = variants.get(kind), variants.get(kind + "+compile")
            row = [e["name"] if e else kind]
            for v, key, suffix in ((e, kind, ""), (c, kind + "+compile", "+compile")):
                if _llama_ok(v):
                    row += [_ms_spread(v, data['config']['reps']), _llama_ratio(variants, key, LLAMA_BF16 + suffix),
                            _llama_ratio(variants, key, LLAMA_TORCHAO + suffix),
                            _llama_ratio(variants, key, LLAMA_TORCHAO + suffix, "cpu_s")]
                else:
                    row += [_llama_status(v), "", "", ""]
            row.append(_llama_ratio(variants, kind + "+compile", kind))
            if cuda:
                for v in (e, c):
                    row.append(f"{v['tokens_per_s']:,.0f}" if _llama_ok(v) else "")
                for v in (e, c):
                    row.append(f"{100 * v['mfu']:.1f} %" if _llama_ok(v) and v.get("mfu") is not None else "")
            rows.append(row)
        headers = ["variant", "eager: ms", "× bf16", "× torchao tensorwise", "(CPU time)", "compiled: ms",
                   "× bf16 compiled", "× torchao tensorwise compiled", "(CPU time)", "compiled ÷ eager"]
        if cuda:
            headers += ["tokens/s eager", "tokens/s compiled", "MFU eager", "MFU compiled"]
        out += ["", _llama_size_head(res["size"]) + ":", "", table(headers, rows)]
    emulated = sorted({v["name"].replace(" + compile", "") for res in data["sizes"].values()
                       for v in res["variants"].values() if v.get("gemm_path") == "emulated"})
    if cuda and emulated:
        out += ["", f"*Emulated FP8 GEMMs on this GPU: {', '.join(emulated)}.*"]
    if cuda and data.get("peaks"):
        out += ["", f"*Peaks for MFU: {data['peaks']['source']}.*"]
    return "\n".join(out)


def llama_memory(data: dict[str, Any] | None = None) -> str:
    data = data or load("llama.json")
    peak_source = next((v["peak_source"] for res in data["sizes"].values() for v in res["variants"].values()
                        if "peak_source" in v), "")
    what = ("Bytes saved for backward by one forward (`saved_tensors_hooks`; each storage once, parameters not "
            "counted): eager, in all at this size, then split by a second forward at twice the batch into the "
            "activations (the part that grows with the tokens; in all, and the Linear layers' alone) and the part that "
            "does not (the weights' bf16 or FP8 copies); compiled, in all only (what the compiled graphs keep after "
            "the partitioner chose what to save and what to recompute in the backward; a second batch size would "
            "compile again). Peak memory: one "
            f"training step, above its start after `zero_grad` ({peak_source}). Ratios to bf16 in the same mode. None "
            "of these depends on the speed of the machine.")
    out = [_llama_caption(data), "", what]
    compiled = any(v["compiled"] for res in data["sizes"].values() for v in res["variants"].values())

    def mib(v: dict[str, Any] | None, field: str) -> str:
        return f"{v[field] / 2**20:.2f}" if v and v.get(field) is not None else ""

    def rel(v: dict[str, Any] | None, ref: dict[str, Any] | None, field: str) -> str:
        if not v or not ref or v.get(field) is None or not ref.get(field):
            return ""
        return x(v[field] / ref[field])

    for res in data["sizes"].values():
        variants = res["variants"]
        b, bc = variants.get(LLAMA_BF16), variants.get(LLAMA_BF16 + "+compile")
        rows = []
        for kind in _llama_kinds(data):
            e, c = variants.get(kind), variants.get(kind + "+compile")
            row = [e["name"] if e else kind, mib(e, "saved_bytes"), rel(e, b, "saved_bytes"),
                   rel(e, b, "activation_bytes"), rel(e, b, "activation_bytes_linear"), rel(e, b, "fixed_bytes"),
                   mib(e, "peak_bytes"), rel(e, b, "peak_bytes")]
            if compiled:
                row += [mib(c, "saved_bytes") or _llama_unmeasured(c), rel(c, bc, "saved_bytes"),
                        mib(c, "peak_bytes"), rel(c, bc, "peak_bytes")]
            rows.append(row)
        headers = ["variant", "saved for backward, eager: MiB", "× bf16", "activations × bf16",
                   "Linear layers' activations × bf16", "weight copies × bf16", "peak, eager: MiB", "× bf16"]
        if compiled:
            headers += ["saved for backward, compiled: MiB", "× bf16 compiled", "peak, compiled: MiB",
                        "× bf16 compiled"]
        out += ["", _llama_size_head(res["size"]) + ":", "", table(headers, rows)]
    return "\n".join(out)


def _llama_syncs_only(data: dict[str, Any]) -> str:
    parts = []
    for res in data["sizes"].values():
        rows = [[v["name"], v.get("syncs", ""), v.get("aten_ops", "")] for v in res["variants"].values()]
        parts += ["", _llama_size_head(res["size"]) + ":", "",
                  table(["variant", "host syncs / step", "aten ops / step"], rows)]
    return "\n".join(parts)


def llama_compile(data: dict[str, Any] | None = None) -> str:
    data = data or load("llama.json")
    backend = data["config"].get("compile_backend")
    out = [_llama_caption(data), ""]
    if not backend:
        return "\n".join(out + ["`torch.compile` was not measured in this run (`--no-compile`); host syncs, eager:",
                                _llama_syncs_only(data)])
    out.append(f"Host syncs (`aten::_local_scalar_dense`, `aten::equal`) and aten ops dispatched in one profiled "
               f"training step after the warm-up, eager and compiled (`torch.compile`, {backend}); the compiled "
               "variants' time to compile (the first step; "
               + ("the on-disk caches emptied at the start of the run (`--cold-compile`); `(cached)`: the cache "
                  "served a graph compiled earlier in the same run"
                  if data["config"].get("cold_compile") else
                  "`(cached)`: inductor's or AOTAutograd's on-disk cache served it, from an earlier run")
               + "), the graphs and graph breaks of the warm-up steps, and the "
               "recompilations (new graphs) and graph breaks in all steps after the warm-up."
               + (" Synchronizing CUDA calls (`torch.cuda.set_sync_debug_mode`) in brackets."
                  if "cuda" in data.get("device", "cpu") else ""))
    for res in data["sizes"].values():
        variants = res["variants"]
        rows = []
        for kind in _llama_kinds(data):
            e, c = variants.get(kind), variants.get(kind + "+compile")

            def syncs(v: dict[str, Any] | None) -> str:
                if not v or v.get("syncs") is None:
                    return ""
                return str(v["syncs"]) + (f" ({v['cuda_syncs']})" if v.get("cuda_syncs") is not None else "")

            row = [e["name"] if e else kind, syncs(e), syncs(c), e.get("aten_ops", "") if e else "",
                   c.get("aten_ops", "") if c else ""]
            if c and "first_step_s" in c:
                cached = " (cached)" if c.get("compile_cache_hits") else ""
                row += [f"{c['first_step_s']:.0f} s{cached}", c["graphs"], c["graph_breaks"],
                        c.get("recompiles_after_warmup", "n/a"), c.get("graph_breaks_after_warmup", "n/a")]
            else:
                row += [_llama_status(c), "", "", "", ""]
            rows.append(row)
        out += ["", _llama_size_head(res["size"]) + ":", "",
                table(["variant", "host syncs / step, eager", "compiled", "aten ops / step, eager", "compiled",
                       "compile (first step)", "graphs (warm-up)", "graph breaks (warm-up)",
                       "recompilations after warm-up", "graph breaks after warm-up"], rows)]
    reasons = sorted({r for res in data["sizes"].values() for v in res["variants"].values()
                      for r in v.get("graph_break_reasons", [])})
    if reasons:
        out += ["", "*Graph breaks: " + "; ".join(reasons) + ".*"]
    return "\n".join(out)


def llama_targets(data: dict[str, Any] | None = None) -> str:
    """Issue 11's targets, each against this run's numbers: met, missed, or not measurable here."""
    data = data or load("llama.json")
    sizes = list(data["sizes"])
    ours = [k for k in _llama_kinds(data) if k.startswith("ours-")]
    compiled = bool(data["config"].get("compile_backend"))
    cuda = "cuda" in data.get("device", "cpu")
    rows = []

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else "met" if ok else "**missed**"

    def cells(fn: Callable[[dict[str, Any]], tuple[str, bool | None]]) -> list[str]:
        out = []
        for name in sizes:
            text, ok = fn(data["sizes"][name]["variants"])
            out.append(f"{text}: {verdict(ok)}" if text else verdict(ok))
        return out

    # every recipe against torchao tensorwise, and a recipe torchao also has against torchao's own (like for like)
    references = [(kind, LLAMA_TORCHAO) for kind in ours]
    references += [(kind, "torchao-" + kind[5:]) for kind in ours if "torchao-" + kind[5:] in LLAMA_TORCHAO_LIKE]
    for kind, torchao in references if not cuda else []:
        def speed(variants: dict[str, Any], kind: str = kind, torchao: str = torchao) -> tuple[str, bool | None]:
            key, ref = kind + "+compile", torchao + "+compile"
            if not compiled or not (_llama_ok(variants.get(key)) and _llama_ok(variants.get(ref))):
                return (_llama_status(variants.get(key)) if compiled else "not compiled"), None
            r = variants[key]["median_s"] / variants[ref]["median_s"]
            cpu = variants[key]["cpu_s"] / variants[ref]["cpu_s"]
            return f"{x(r)} (CPU time {x(cpu)})", r <= 1.0

        label = torchao.replace("-", " ")
        rows.append([f"CPU, compiled: `{kind[5:]}` step time ≤ {label} compiled (emulated)", *cells(speed)])
    for recipe in LLAMA_SAVED_RECIPES:
        kind = f"ours-{recipe}"
        for field, what in (("saved_bytes", "in all, at this size"), ("activation_bytes", "activations"),
                            ("activation_bytes_linear", "the Linear layers' activations")):
            def saved(variants: dict[str, Any], kind: str = kind, field: str = field) -> tuple[str, bool | None]:
                v, b = variants.get(kind), variants.get(LLAMA_BF16)
                if not v or not b or v.get(field) is None or not b.get(field):
                    return "", None
                r = v[field] / b[field]
                return x(r), r <= LLAMA_SAVED_TARGET

            rows.append([f"`{recipe}`: saved for backward, {what} ≤ {LLAMA_SAVED_TARGET:.2f} × bf16", *cells(saved)])
        if compiled:
            def saved_compiled(variants: dict[str, Any], kind: str = kind) -> tuple[str, bool | None]:
                v, b = variants.get(kind + "+compile"), variants.get(LLAMA_BF16 + "+compile")
                if not v or v.get("saved_bytes") is None:
                    return _llama_unmeasured(v), None
                if not b or not b.get("saved_bytes"):  # ours measured, the reference not
                    return f"no compiled bf16 reference ({_llama_unmeasured(b) or 'not run'})", None
                r = v["saved_bytes"] / b["saved_bytes"]
                return x(r), r <= LLAMA_SAVED_TARGET

            rows.append([f"`{recipe}`, compiled: saved for backward, in all, at this size ≤ {LLAMA_SAVED_TARGET:.2f} × "
                         "bf16 compiled", *cells(saved_compiled)])

    def worst(field: str, compiled_only: bool) -> Callable[[dict[str, Any]], tuple[str, bool | None]]:
        def fn(variants: dict[str, Any]) -> tuple[str, bool | None]:
            values = [v[field] for k, v in variants.items() if k.split("+")[0] in ours and v.get(field) is not None
                      and (v["compiled"] or not compiled_only)]
            if not values:
                return "", None
            return f"max {max(values)}", max(values) == 0
        return fn

    rows.append(["our recipes: host syncs per step = 0 (eager and compiled)", *cells(worst("syncs", False))])
    if compiled:
        rows.append(["our recipes, compiled: graph breaks = 0", *cells(worst("graph_breaks", True))])
        rows.append(["our recipes, compiled: recompilations after warm-up = 0",
                     *cells(worst("recompiles_after_warmup", True))])
    gpu_note = ("not measured: no CUDA GPU in this run" if not cuda else
                f"not measured: size {LLAMA_GPU_SIZE} not in this run" if LLAMA_GPU_SIZE not in data["sizes"] else "")
    for target, ref, need in ((f"≥ {LLAMA_GPU_SPEEDUP} × bf16's tokens/s", LLAMA_BF16, LLAMA_GPU_SPEEDUP),
                              ("tokens/s ≥ torchao tensorwise's", LLAMA_TORCHAO, 1.0)):
        label = f"H100-class GPU, compiled, {LLAMA_GPU_SIZE} at 8192 tokens per step: `tensorwise` {target}"
        if gpu_note:
            rows.append([label, *([gpu_note] * len(sizes))])
            continue
        variants = data["sizes"][LLAMA_GPU_SIZE]["variants"]
        # the steps that do not count (statistics_every_n_steps) too, where the run has them
        for kind, what in (("ours-tensorwise", ""), ("ours-tensorwise:uncounted", ", steps not counting")):
            a, b = variants.get(kind + "+compile"), variants.get(ref + "+compile")
            if what and a is None:
                continue
            cell = "n/a"
            if _llama_ok(a) and _llama_ok(b):
                r = a["tokens_per_s"] / b["tokens_per_s"]
                cell = f"{x(r)}: {verdict(r >= need)}"
            rows.append([label.replace("`tensorwise`", f"`tensorwise`{what}"),
                         *(cell if n == LLAMA_GPU_SIZE else "" for n in sizes)])
    return "\n".join([_llama_caption(data), "", table(["target", *sizes], rows, right=1)])


def llama_tables(data: dict[str, Any] | None = None) -> dict[str, str]:
    """The four tables of ``bench_llama.py``'s result (printed by the script, written by this one)."""
    return {"llama_step_time.md": llama_step_time(data), "llama_memory.md": llama_memory(data),
            "llama_compile.md": llama_compile(data), "llama_targets.md": llama_targets(data)}


# ---------------------------------------------------------------------------------------- bench_fsdp2

#: The issue's target: bytes moved by FSDP2's parameter all-gathers per step, at most this times the bf16 gathers'.
FSDP2_GATHER_TARGET = 0.57


def compiled_saved(data: dict[str, Any] | None = None) -> str:
    """``compiled_saved.py``'s result: what compiled graphs keep for backward on the GPU's GEMM path, forced on a CPU
    (bytes in all against compiled bf16 and against torchao's same recipe, and the FP8 tensors kept)."""
    data = data or load("compiled_saved.json")
    results, size = data["results"], data["size"]
    note = ("**CPU, the GPU's GEMM path forced**: ours calls `torch._scaled_mm` and torchao runs with `emulate=False`, "
            "as on a GPU, and those FP8 GEMMs are emulated by torch on the CPU; graphs partitioned as inductor partitions "
            "them: bytes saved for backward, no time")
    bf16 = results.get("bf16", {}).get("saved_bytes")
    rows = []
    for kind, v in results.items():
        twin = results.get(_compiled_saved_twin(kind), {}).get("saved_bytes")
        kept = ", ".join(f"{n} × {what}" for what, n in v["fp8_tensors"].items()) or "none"
        rows.append([kind.replace("-", " ") + ", compiled", f"{v['saved_bytes'] / 1024:.1f}",
                     x(v["saved_bytes"] / bf16) if bf16 else "n/a",
                     x(v["saved_bytes"] / twin) if twin else "", kept])
    headers = ["variant", "saved for backward: KiB", "× bf16 compiled", "× torchao (same recipe; tensorwise for "
               "delayed)", "FP8 tensors kept (count × dtype shape)"]
    return "\n\n".join([caption(data["environment"], data["command"], gemm_note=note), _llama_size_head(size),
                         table(headers, rows)])


def gpu_kernels(data: dict[str, Any] | None = None) -> str:
    """``gpu_kernels.py``'s result: the Triton kernels inductor writes for a GPU (H100 device properties) on one
    compiled step, per graph: launches, inductor's estimate of the bytes they move, against bf16 and torchao."""
    data = data or load("gpu_kernels.json")
    results, size = data["results"], data["size"]
    note = ("**CPU, no kernel run**: inductor's Triton code for an H100 written on this CPU, the GPU's GEMM path forced "
            "(the FP8 GEMMs neither run nor emulated: extern calls); "
            "launches and inductor's byte estimates (buffer sizes, no caches): no time")
    total = {spec: r["forward"]["gb"] + r["backward"]["gb"] for spec, r in results.items()}
    rows = []
    for spec, r in results.items():
        fwd, bwd = r["forward"], r["backward"]
        rows.append([spec.replace("-", " ", 1), f"{fwd['launches']}", f"{bwd['launches']}", f"{fwd['gb'] * 1e3:,.0f}",
                     f"{bwd['gb'] * 1e3:,.0f}"]
                    + [x(total[spec] / total[ref]) if ref in total else "n/a" for ref in ("bf16", "torchao-tensorwise")])
    headers = ["variant (`:uncounted`: a step that does not count)", "forward launches", "backward launches",
               "forward MB moved", "backward MB moved", "bytes × bf16", "bytes × torchao tensorwise"]
    return "\n\n".join([caption(data["environment"], data["command"], gemm_note=note), _llama_size_head(size),
                         table(headers, rows)])


def _compiled_saved_twin(kind: str) -> str:
    """The torchao variant ``compiled_saved.py`` compares a variant of ours with."""
    if not kind.startswith("ours-"):
        return ""
    return "torchao-rowwise" if kind == "ours-rowwise" else "torchao-tensorwise"


def fsdp2_all_gather() -> str:
    data = load("fsdp2.json")
    model, configs = data["model"], data["configs"]
    note = "the bytes FSDP2 moves do not depend on the hardware, nor on the emulation"
    measured = {name: c for name, c in configs.items() if c["status"] == "measured"}
    base, fp8_compute = measured.get("bf16"), measured.get("tensorwise-bf16-gather")
    any_config = next(iter(measured.values()))
    what = (f"A GPT of {model['blocks']} blocks, hidden {model['hidden']} ({any_config['parameters']} parameters, "
            f"{any_config['linear_weight_fraction']:.0%} of them Linear weights), {model['ranks']} ranks of FSDP2 through "
            f"`ModelParallelStrategy`, `MixedPrecisionPolicy(param_dtype=torch.bfloat16)` for what is not gathered in "
            f"FP8, {model['tokens_per_rank_per_step']} tokens per rank per step, {model['steps']} steps; bytes per "
            f"training step (forward and backward) as FSDP2 hands them to its all-gather and reduce-scatter.")
    rows = []
    for name, c in configs.items():
        if c["status"] != "measured":
            rows.append([f"`{name}`", f"not measured: {c['reason']}", "", "", "", "", ""])
            continue
        gather = c["all_gather_bytes"]
        target = ""
        if base and name in ("tensorwise", "delayed"):
            target = "met" if gather <= FSDP2_GATHER_TARGET * base["all_gather_bytes"] else "**missed**"
        rows.append([
            f"`{name}`",
            f"{gather / 1024:.0f} KiB",
            x(gather / base["all_gather_bytes"]) if base else "",
            x(gather / fp8_compute["all_gather_bytes"]) if fp8_compute else "",
            f"{c['reduce_scatter_bytes'] / 1024:.0f} KiB",
            f"{c['loss']:.3f}",
            target,
        ])
    headers = ["configuration", "all-gather per step", "vs `bf16`", "vs `tensorwise-bf16-gather`", "reduce-scatter per step",
               "last loss", f"≤ {FSDP2_GATHER_TARGET} × bf16"]
    return caption(data["environment"], data["command"], note) + "\n\n" + what + "\n\n" + table(headers, rows)


# ---------------------------------------------------------------------------------------- bench_compile

COMPILE_MODEL_SCOPE = "model"


def _compile_ok(v: dict[str, Any] | None) -> bool:
    return v is not None and "first_step_s" in v


def _compile_ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, field: str) -> str:
    if not a or not b or a.get(field) is None or not b.get(field):
        return ""
    return x(a[field] / b[field])


def _limit_hit(v: dict[str, Any]) -> str:
    if not v["recompile_limit_hit"]:
        return "no"
    eager = v.get("blocks_run_eager")
    return "**yes**" + (f": {eager} of {v['depth']} blocks ran eager" if eager is not None else "")


def compile_depth(data: dict[str, Any] | None = None) -> str:
    """``bench_compile.py``'s result: compiling the whole stack or each block, cold, as the stack gets deeper."""
    data = data or load("compile.json")
    cfg = data["config"]
    note = ("no FP8 hardware: the FP8 GEMMs are emulated; compile times and graph counts do not depend on it, the step "
            "time ratios show the cost of the emulation, not FP8 speed")
    size = next(iter(data["depths"].values()))["size"]
    what = (f"Llama-style decoder blocks of `bench_llama.py` (hidden {size['hidden']}, FFN {size['ffn']}, "
            f"{_plural(size['heads'], 'head')}, {_plural(size['kv_heads'], 'KV head')}, {size['tokens']} tokens per "
            f"step), training steps under `torch.compile` ({cfg['backend']}) of the whole stack (`model`) or of each "
            "block in its place (`blocks`, torchtitan's way), each compiled cold (a fresh inductor cache, "
            "`torch._dynamo.reset()` before it). First step: the compile and one step. Frames, graphs, "
            "recompilations and graph breaks: torch's records of the first step and the "
            f"{_plural(cfg['warmup'], 'warm-up step')}; recompile limit ({cfg['recompile_limit']}) hit: torch records a "
            "failed compile (`Dynamo recompile limit exceeded`) and then runs the calls no cached graph matches "
            "eagerly; blocks that ran eager: the depth minus the compiled regions one step runs (`torch.profiler`). "
            "Tracing: dynamo's share of the first step (`bytecode_tracing`). Ratios of the first step to the same "
            "variant's `model` scope and to torchao tensorwise in the same scope and depth; steady step: the median "
            f"of {_plural(cfg['reps'], 'step')} after the warm-up, against the same variant eager at the same depth.")
    rows = []
    notes: list[str] = []
    for depth, res in data["depths"].items():
        variants = res["variants"]
        for kind in cfg["kinds"]:
            v = variants.get(kind)
            if v is None:
                continue
            for scope in cfg["scopes"]:
                c = v.get(scope)
                if not _compile_ok(c):
                    rows.append([depth, v["name"], f"`{scope}`", (c or {}).get("status", "not run"),
                                 *([""] * 10)])
                    continue
                c = {**c, "depth": int(depth)}
                ref = v.get(COMPILE_MODEL_SCOPE)
                ao = variants.get(LLAMA_TORCHAO, {}).get(scope)
                steady = _compile_ratio(c, v.get("eager"), "median_s") or c["status"]
                rows.append([depth, v["name"], f"`{scope}`", c["frames"], c["graphs"], c["recompiles"],
                             c["graph_breaks"], c["compiled_regions_per_step"], _limit_hit(c),
                             f"{c['first_step_s']:.1f} s",
                             f"{c['compile_phases_s']['bytecode_tracing']:.1f} s",
                             _compile_ratio(c, ref, "first_step_s") if scope != COMPILE_MODEL_SCOPE else "",
                             _compile_ratio(c, ao, "first_step_s") if kind != LLAMA_TORCHAO else "", steady])
                notes += c["recompile_reasons"]
    out = [caption(data["environment"], data["command"], note), "", what, "",
           table(["blocks", "variant", "scope", "frames", "graphs", "recompilations", "graph breaks",
                  "compiled regions / step", "recompile limit hit", "first step", "tracing", "× `model` scope",
                  "× torchao tensorwise", "steady step ÷ eager"], rows, right=3)]
    if notes:
        out += ["", "*Recompilation reasons (the guard that failed): " + "; ".join(
            f"`{r}`" for r in sorted(set(notes))) + ".*"]
    return "\n".join(out)


def kernels_gpu(name: str = "kernels_gpu.json") -> str:
    """``profile_kernels.py`` on a GPU (``name``: its result file): each compiled variant's kernel time per step of one
    block, and its largest kernels outside the GEMMs and attention (classified again here with the script's current
    classifier)."""
    from profile_kernels import kernel_class  # beside this file, like bench_llama's import of docs_tables

    data = load(name)
    results, size = data["results"], data["size"]
    out = [caption(data["environment"], data["command"]), "",
           f"Device time of the kernels of one training step ({data['mode']}; forward, backward, `AdamW(fused=True)`), "
           f"summed over kernels, not wall time: one {size['name']}-shaped block, {size['batch'] * size['seq']} tokens. "
           "Each variant against bf16 and against torchao with the same scaling; then the largest kernels that are "
           "neither a GEMM nor attention (casts, scales, statistics, scatters), with their share of the step.", ""]
    rows = []
    bf16 = results.get("bf16", {}).get("total_us")
    for kind, r in results.items():
        torchao = "torchao-" + kind.partition(":")[0].split("-", 1)[1] if kind.startswith("ours-") else None
        same = x(r["total_us"] / results[torchao]["total_us"]) if torchao in results else ""
        others = [t for t in r["top"] if kernel_class(t["name"]) not in ("gemm", "attention", "optimizer")][:2]
        largest = "; ".join(f"`{t['name'][:48]}…` {t['us'] / 1e3:.2f} ms ({100 * t['us'] / r['total_us']:.0f} %)"
                            for t in others)
        rows.append([kind, f"{r['total_us'] / 1e3:.2f}", x(r["total_us"] / bf16) if bf16 else "n/a", same,
                     largest])
    out.append(table(["variant", "kernel ms / step", "× bf16", "× torchao, same scaling",
                      "largest kernels besides GEMMs and attention"], rows, right=1))
    return "\n".join(out)


RENDERERS: dict[str, Callable[[], str]] = {
    "convergence.md": convergence_plain,
    "convergence_outliers.md": convergence_outliers,
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
    "llama_step_time.md": llama_step_time,
    "llama_memory.md": llama_memory,
    "llama_compile.md": llama_compile,
    "llama_targets.md": llama_targets,
    "llama_gpu_step_time.md": lambda: llama_step_time(load("llama_gpu.json")),
    "llama_gpu_memory.md": lambda: llama_memory(load("llama_gpu.json")),
    "llama_gpu_compile.md": lambda: llama_compile(load("llama_gpu.json")),
    "llama_gpu_targets.md": lambda: llama_targets(load("llama_gpu.json")),
    # the second H200 run (2026-11-29): ours tensorwise counting and not counting (statistics_every_n_steps)
    "llama_gpu_nov29_step_time.md": lambda: llama_step_time(load("llama_gpu_nov29.json")),
    "llama_gpu_nov29_memory.md": lambda: llama_memory(load("llama_gpu_nov29.json")),
    "llama_gpu_nov29_compile.md": lambda: llama_compile(load("llama_gpu_nov29.json")),
    "llama_gpu_nov29_targets.md": lambda: llama_targets(load("llama_gpu_nov29.json")),
    "compiled_saved.md": compiled_saved,
    "gpu_kernels.md": gpu_kernels,
    "fsdp2_all_gather.md": fsdp2_all_gather,
    "kernels_gpu.md": kernels_gpu,
    "kernels_gpu_uncounted.md": lambda: kernels_gpu("kernels_gpu_uncounted.json"),
}
#: Tables of a benchmark whose result file is not committed yet, and the file: each is registered once its file
#: exists, so that before the first run ``--check`` and ``tests/test_doc_numbers.py`` ask for no table (and no page
#: may include one), and after it they ask for the table and for a page that includes it, as for any other.
PENDING: dict[str, tuple[str, Callable[[], str]]] = {
    "compile_depth.md": ("compile.json", compile_depth),
}
RENDERERS.update({name: fn for name, (source, fn) in PENDING.items() if os.path.exists(os.path.join(RESULTS, source))})


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
