"""Measured numbers on the docs pages come from the benchmark result files, never from a hand copy.

* every table of ``benchmarks/results/tables`` is what ``benchmarks/docs_tables.py`` renders from the result
  files now (a new run, or an edited table, without re-rendering fails here);
* every table is included by a page, every include names an existing table, and every table says where and how
  it was measured;
* the prose of README.md, examples/README.md and docs/ carries no hand-typed measurement: no decimal speed or
  memory ratio, no millisecond or microsecond timing, no dB figure outside the included tables.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import docs_tables

PAGES = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
INCLUDE = re.compile(r'^\s*--8<--\s+"(benchmarks/results/tables/[^"]+)"\s*$', re.MULTILINE)
FENCE = re.compile(r"^( *)```.*?^\1```", re.DOTALL | re.MULTILINE)
# What a measurement looks like in prose: a decimal or ranged ratio, a ratio with "slower"/"faster", a time in
# ms/µs or with decimals in s, a figure in dB.
MEASUREMENT = re.compile(
    r"\d+\.\d+\s*[×x](?!\s*\d)(?!\w)"
    r"|\d+(?:\.\d+)?\s*[–-]\s*\d+(?:\.\d+)?\s*[×x](?!\s*\d)(?!\w)"
    r"|\d+(?:\.\d+)?\s*[×x]\s+(?:slower|faster)"
    r"|\d+(?:\.\d+)?\s*(?:ms|µs)\b"
    r"|\d+\.\d+\s*s\b"
    r"|\d+(?:\.\d+)?\s*dB\b"
)


def prose(page: Path) -> list[tuple[int, str]]:
    """The page's lines outside code fences (line numbers kept)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    return list(enumerate(text.splitlines(), start=1))


def test_tables_are_rendered_from_the_result_files_as_they_are_now():
    rendered = docs_tables.render_all()
    for name, text in rendered.items():
        path = Path(docs_tables.TABLES) / name
        assert path.is_file(), f"{name} missing: run python benchmarks/docs_tables.py"
        assert path.read_text() == text, f"{name} differs from its result file: run python benchmarks/docs_tables.py"


def test_every_table_is_included_and_says_where_it_was_measured():
    included = {m for page in PAGES for m in INCLUDE.findall(page.read_text())}
    tables = {f"benchmarks/results/tables/{name}" for name in docs_tables.RENDERERS}
    assert included <= tables, f"pages include tables that do not exist: {included - tables}"
    assert tables <= included, f"tables no page includes: {tables - included}"
    for name, text in docs_tables.render_all().items():
        head = text.splitlines()[0]
        assert head.startswith("*Measured ") and " on " in head and "torch " in head, (name, head)
        if "native FP8 GEMMs" in head:  # a GPU run: it must name the GPU and the CUDA version
            assert " on NVIDIA " in head and "CUDA " in head, f"{name}: a native figure must name its GPU: {head}"
        elif "cpu" in head.lower() and "callgrind" not in head:
            assert "emulated" in head, f"{name}: a CPU figure must say the FP8 GEMMs were emulated: {head}"


def test_check_mode_reports_a_stale_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(docs_tables, "TABLES", str(tmp_path))
    assert docs_tables.main(["--check"]) == 1  # nothing rendered there yet
    assert "stale tables" in capsys.readouterr().err
    assert docs_tables.main([]) == 0
    assert docs_tables.main(["--check"]) == 0
    (tmp_path / "sqnr.md").write_text("| hand | edited |\n")
    assert docs_tables.main(["--check"]) == 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_hand_typed_measurements_in_prose(page):
    found = [f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r} in: {line.strip()}"
             for n, line in prose(page) for m in MEASUREMENT.finditer(line)]
    assert not found, ("measured numbers belong in a table rendered from benchmarks/results (see "
                       "benchmarks/docs_tables.py), not in prose:\n" + "\n".join(found))


def test_the_measurement_pattern_finds_what_went_stale_before():
    stale = ["The compiled step took 0.34× the eager one", "about 5–7× slower", "(145 ms against 12 ms)",
             "28.7 / 24.7 / 24.6 dB", "about 3x slower than bf16", "takes about 0.5 s on 2 cores"]
    for text in stale:
        assert MEASUREMENT.search(text), text
    fine = ["margin=1 (2×) or margin=2 (4×)", "for example 4.424 × 101.27 ≈ 448", "MLP 4×", "a 4096×1024 tensor", "hidden 4096, FFN 14336"]
    for text in fine:
        assert not MEASUREMENT.search(text), text
