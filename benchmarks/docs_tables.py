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
``results/convergence.json`` (``bench_convergence.py``: validation loss of FP8 training against bf16).
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


def caption(env: dict[str, str], command: str, emulated_note: str | None = None) -> str:
    """The line above every table: when, where, which versions, which command, emulated or native
    (``emulated_note``: what the emulation means for this table, instead of the note about speed ratios)."""
    cpu = env.get("cpu", "unknown CPU")
    flags = env.get("cpu matrix flags", "")
    if flags and not flags.startswith("none"):
        cpu += f" ({flags})"
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "torchao", "lightning") if k in env)
    path = env.get("GEMM path", "")
    emulated = "emulated" in path or "cuda" not in env.get("device", "cpu")
    what = ("**CPU, emulated FP8 GEMMs**: " + (emulated_note or "no FP8 hardware, so the ratios show the cost of the "
                                                "emulation, not FP8 speed") if emulated else "native FP8 GEMMs")
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
