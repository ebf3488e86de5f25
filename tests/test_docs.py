"""The documentation site builds with ``mkdocs build --strict``: a broken cross-reference, link or anchor fails it.

Needs the ``docs`` extra (``pip install -e ".[docs]"``); without it the test fails rather than skips, so CI
cannot pass without building the docs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def _build_run(workdir: Path) -> dict:
    args = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
            "--site-dir", str(workdir / "site")]  # fmt: skip
    return {"args": args, "cwd": ROOT, "env": {**os.environ, "NO_MKDOCS_2_WARNING": "1"}, "timeout": 300}


# started when collection ends and run while other tests run (tests/conftest.py, "subprocesses started early")
EARLY_RUNS = {"site": _build_run}


@pytest.fixture(scope="module")
def site(early_runs) -> Path:
    missing = [name for name in DOCS_PACKAGES if not _importable(name)]
    if missing:
        pytest.fail(f"{missing} not installed: install the docs extra with pip install -e '.[docs]'")
    proc = early_runs.result(__name__, "site")
    out = proc.workdir / "site"
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out


def test_strict_build_produces_every_page(site):
    pages = ["index.html", "installation/index.html", "quickstart/index.html", "recipes/index.html",
             "stats/index.html", "troubleshooting/index.html", "distributed/index.html", "checkpoints/index.html",
             "benchmarks/index.html", "compare/index.html", "changelog/index.html", "api/index.html", "api/precision/index.html",
             "api/callbacks/index.html", "api/linear/index.html", "api/convert/index.html", "api/recipe/index.html",
             "api/state/index.html", "api/gemm/index.html", "api/distributed/index.html", "architecture/index.html",
             "api/stats/index.html", "api/region/index.html", "api/quantize/index.html", "api/loss_scaling/index.html",
             "sensitivity/index.html", "api/sensitivity/index.html", "api/calibration/index.html"]
    for page in pages:
        assert (site / page).is_file(), page
    assert (site / "assets" / "fp8_amax_heatmap.png").is_file()
    assert "[Unreleased]" in (site / "changelog" / "index.html").read_text()


def test_troubleshooting_anchors_the_code_points_to_exist(site):
    """The stats callback's alerts link to docs/troubleshooting.md#<anchor>: every such anchor must exist."""
    source = (ROOT / "lightning_fp8" / "callbacks.py").read_text()
    anchors = set(re.findall(r"\{TROUBLESHOOTING\}#([a-z0-9-]+)", source))
    assert anchors >= {"nan-or-divergence", "overflows"}
    html = (site / "troubleshooting" / "index.html").read_text()
    for anchor in anchors | {"no-speedup-on-small-models", "shapes-not-multiples-of-16", "checkpoints"}:
        assert f'id="{anchor}"' in html, anchor


def test_api_reference_is_rendered_from_the_docstrings(site):
    precision = (site / "api" / "precision" / "index.html").read_text()
    for text in ('id="lightning_fp8.FP8Precision"', 'id="lightning_fp8.fabric.FP8Precision"', "amax_history_len",
                 "growth_interval"):
        assert text in precision, text
    recipe = (site / "api" / "recipe" / "index.html").read_text()
    assert "fp8_max / amax_ref / 2**margin" in recipe  # the delayed-scaling formula of the module docstring
    for page in (site / "api").rglob("*.html"):
        html = page.read_text()
        # reST roles were turned into links by docs/_griffe/rst_markup.py, none is left as text
        assert not re.search(r":(class|func|mod|meth|data|attr):", html), page
