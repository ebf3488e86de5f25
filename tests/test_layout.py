"""The module tables of README.md ("Layout") and docs/architecture.md ("Modules, bottom to top") are true: each lists
every module of ``lightning_fp8/`` (the package's ``__init__.py`` aside) and no other, and each module imports, at
import time or inside a function, only modules of its own row or of the rows above it, as both pages say. And the
test helpers' Trainers leave no folder behind in the temporary folder.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_fp8"
PAGES = {"README.md": "## Layout", "docs/architecture.md": "## Modules, bottom to top"}


def module_rows(page: str) -> list[set[str]]:
    """The modules named in the first column of each row of the page's module table, in order."""
    text = (ROOT / page).read_text()
    section = text.split(PAGES[page], 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        names = {Path(name).stem for name in re.findall(r"`([^`]+\.py)`", first)}
        if names:
            rows.append(names)
    return rows


def imported_modules(module: str) -> set[str]:
    """The ``lightning_fp8`` modules a module imports anywhere in its source (top level or in a function)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_fp8."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("lightning_fp8.")}
    return found - {module}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_module_table_lists_every_module_once(page):
    rows = module_rows(page)
    listed = [name for row in rows for name in row]
    on_disk = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert len(listed) == len(set(listed)), f"{page}: a module listed twice"
    missing, extra = sorted(on_disk - set(listed)), sorted(set(listed) - on_disk)
    assert not missing and not extra, f"{page}: missing {missing}, not a module {extra}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_each_module_imports_only_the_rows_above_it(page):
    rows = module_rows(page)
    above: set[str] = set()
    wrong = []
    for row in rows:
        allowed = above | row
        for module in sorted(row):
            if (PACKAGE / f"{module}.py").exists():
                wrong += [f"{module} imports {other}" for other in sorted(imported_modules(module) - allowed)]
        above |= row
    assert not wrong, f"{page}: a module imports one listed below it: {wrong}"


def test_the_trainers_of_the_test_helpers_leave_no_folder_behind(tmp_path):
    """``tests/utils.py``'s ``make_trainer`` gives each Trainer a temporary ``default_root_dir``; a suite makes
    hundreds of them, and they are removed when the process exits."""
    code = "import utils; a, b = utils.make_trainer(), utils.make_trainer(); print(a.default_root_dir, b.default_root_dir)"  # noqa: E501
    # PYTHONPATH extended, not replaced: .ci/run's second run lays a Lightning release over the installed one there
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = map(Path, proc.stdout.split()[-2:])
    assert first != second and tmp_path in first.parents and tmp_path in second.parents
    assert not any(tmp_path.iterdir())
