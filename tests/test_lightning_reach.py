"""tests/lightning_reach.py: which test modules the floor stage of .ci/run (``pytest --lightning-facing``, on
Lightning's oldest supported release) runs. A module classified Lightning-free there is a module whose tests would
not run against that release: every way of reaching Lightning must count."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_reach import reaches_lightning

TESTS = Path(__file__).parent


def _module(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "test_probe.py"
    path.write_text(textwrap.dedent(source))
    return path


@pytest.mark.parametrize(
    "source",
    [
        "import lightning as L\n\ndef test_a():\n    L.Trainer()\n",
        "def test_a():\n    from lightning.pytorch import Trainer\n",
        "def test_a():\n    import pytorch_lightning\n",
        "from lightning.fabric import Fabric\n\ndef test_a():\n    Fabric()\n",
        "from lightning_fp8 import FP8Precision\n\ndef test_a():\n    FP8Precision()\n",
        "from lightning_fp8.calibration import calibrate\n\ndef test_a():\n    calibrate\n",
        "import lightning_fp8 as lf\n\ndef test_a():\n    lf.calibrate()\n",
        "import lightning_fp8 as lf\n\ndef test_a():\n    lf.fabric.FP8Precision()\n",
        "import lightning_fp8 as lf\n\ndef test_a():\n    vars(lf)\n",  # the package passed on bare
        "import lightning_fp8 as lf\n\ndef test_a():\n    lf.not_a_name_of_the_package()\n",
        "from utils import make_trainer\n\ndef test_a():\n    make_trainer()\n",
        "import utils\n\ndef test_a():\n    utils.make_trainer()\n",
        "from models import TinyDecoder\n\ndef test_a():\n    TinyDecoder()\n",
        "import sys, subprocess\n\ndef test_a():\n    subprocess.run([sys.executable, 'x.py'])\n",
        "import importlib\n\ndef test_a():\n    importlib.import_module('x')\n",
        "def test_a(gloo_runs):\n    gloo_runs.folder('x')\n",
        "import pytest\n\n@pytest.mark.gloo('x')\ndef test_a():\n    pass\n",
    ],
)
def test_every_way_of_reaching_lightning_counts(tmp_path, source):
    assert reaches_lightning(_module(tmp_path, source))


@pytest.mark.parametrize(
    "source",
    [
        "import torch\n\ndef test_a():\n    torch.ones(1)\n",
        "import lightning_fp8 as lf\n\ndef test_a():\n    lf.convert_to_fp8(None)\n    lf.fp8_autocast()\n",
        "import lightning_fp8 as lf\n\ndef test_a():\n    lf.__version__\n",
        "from lightning_fp8 import gemm, quantize\n\ndef test_a():\n    gemm.gemm_path(quantize)\n",
        "import lightning_fp8.recipe as recipe_module\n\ndef test_a(m):\n    m.setattr(recipe_module, 'x', 1)\n",
        "from lightning_fp8.linear import FP8Linear\n\ndef test_a():\n    FP8Linear\n",
        "from utils import reference_amax_bins\n\ndef test_a():\n    reference_amax_bins(1)\n",
        '"""A Fabric-style loop, without Fabric (a docstring is not code)."""\n',
        "import subprocess\n\ndef test_a():\n    subprocess.run(['git', 'status'])\n",  # not a Python child
    ],
)
def test_what_runs_only_the_fp8_core_is_lightning_free(tmp_path, source):
    assert not reaches_lightning(_module(tmp_path, source))


def test_a_helper_that_uses_one_that_reaches_lightning_reaches_it(tmp_path, monkeypatch):
    """Through the definitions of a local helper module, one using another."""
    import lightning_reach

    helpers = tmp_path / "helpers"
    helpers.mkdir()
    (helpers / "probe_helpers.py").write_text(
        "import lightning as L\n\ndef trainer():\n    return L.Trainer()\n\n"
        "def fit():\n    return trainer().fit\n\ndef plain():\n    return 1\n"
    )
    monkeypatch.setattr(lightning_reach, "LOCAL_DIRS", (helpers, *lightning_reach.LOCAL_DIRS))
    lightning_reach._local_reaching.cache_clear()
    try:
        facing, free = tmp_path / "test_facing.py", tmp_path / "test_free.py"
        facing.write_text("from probe_helpers import fit\n\ndef test_a():\n    fit()\n")
        free.write_text("from probe_helpers import plain\n\ndef test_a():\n    plain()\n")
        assert reaches_lightning(facing)
        assert not reaches_lightning(free)
    finally:
        lightning_reach._local_reaching.cache_clear()


def _uses_lightning_classes(path: Path) -> bool:
    names = {"Trainer", "Fabric", "LightningModule", "LightningDataModule", "LightningCLI", "Callback"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name) and node.id in names or isinstance(node, ast.Attribute) and node.attr in names:
            return True
    return False


def test_this_suites_modules_that_use_lightnings_classes_are_facing():
    """A cross-check on the suite itself, independent of the analysis: a module whose code names a Trainer, a
    Fabric, a LightningModule, ... is Lightning-facing; and the FP8 core's heavy modules are not (the time the floor
    stage saves)."""
    modules = sorted(TESTS.glob("test_*.py"))
    using = [path.name for path in modules if _uses_lightning_classes(path)]
    assert len(using) > 15
    assert [name for name in using if not reaches_lightning(TESTS / name)] == []
    free = {path.name for path in modules if not reaches_lightning(path)}
    assert {"test_linear.py", "test_compiled_rounding.py", "test_compile_dynamic.py", "test_gemm.py"} <= free
    assert {"test_precision.py", "test_fabric.py", "test_cli.py", "test_fsdp2.py", "test_examples.py"}.isdisjoint(free)


def test_the_option_deselects_the_lightning_free_modules(tmp_path):
    """``pytest --lightning-facing`` keeps the facing modules' tests, deselects the others and names them."""
    args = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--lightning-facing"]
    run = subprocess.run(
        [*args, "tests/test_gemm.py", "tests/test_loss_scaling.py"],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith("tests/test_loss_scaling.py::") for line in collected)
    assert "deselected the Lightning-free modules test_gemm.py" in run.stdout
    assert "deselected" in run.stdout.splitlines()[-1]
