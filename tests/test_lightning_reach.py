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

import lightning_reach
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
        # added after a review: each of these was classified Lightning-free
        "from utils import make_trainer\nFACTORY: object = make_trainer\n\ndef test_a():\n    FACTORY()\n",
        "from utils import make_trainer\nFACTORY, N = make_trainer, 1\n\ndef test_a():\n    FACTORY()\n",
        "import utils\nutils.make_trainer()\n",  # top-level code runs on import
        "import lightning_fp8 as lf\nif True:\n    def test_a():\n        lf.calibrate(None)\n",
        "try:\n    import torch\nexcept ImportError:\n    pass\nelse:\n    from lightning import Trainer\n\n"
        "def test_a():\n    Trainer()\n",
        "from lightning_fp8 import *\n\ndef test_a():\n    calibrate()\n",
        "from lightning.pytorch import *\n\ndef test_a():\n    Trainer()\n",
        "import docs_tables\n\ndef test_a():\n    docs_tables.render_all()\n",  # renders compare_example
        "import runpy\n\ndef test_a():\n    runpy.run_path('examples/x.py')\n",
        "import subprocess\n\ndef test_a():\n    subprocess.run(['python', 'x.py'])\n",
        "import torch.multiprocessing as mp\n\ndef test_a():\n    mp.spawn(print, nprocs=2)\n",
        "from tests.utils import make_trainer\n\ndef test_a():\n    make_trainer()\n",
        "from benchmarks import docs_tables\n\ndef test_a():\n    docs_tables.main([])\n",
        "import pytest\n\ndef test_a():\n    L = pytest.importorskip('lightning')\n",
        "import lightning_fp8 as lf\n\ndef test_a():\n    lf.__dict__['FP8Precision']()\n",
        "import lightning_fp8.precision as p\n\ndef test_a():\n    p\n",
        "import lightning_fp8.calibration\n\ndef test_a():\n    lightning_fp8.calibration.calibrate()\n",
        "def test_a():\n    __import__('lightning')\n",
        "import importlib.util as u\n\ndef test_a():\n    u.spec_from_file_location('x', 'x.py')\n",
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
        "import lightning_fp8.quantize\n\ndef test_a():\n    lightning_fp8.quantize.quantize\n",
        "import docs_tables\n\ndef test_a():\n    docs_tables.caption({}, 'x')\n",
        "if __name__ == '__main__':\n    import lightning\n",  # a script's body: not run on import
        "print(f'python benchmarks/{1}')\n",  # text that reads like a command
    ],
)
def test_what_runs_only_the_fp8_core_is_lightning_free(tmp_path, source):
    assert not reaches_lightning(_module(tmp_path, source))


def _with_helpers(tmp_path, monkeypatch, helpers: dict[str, str]) -> None:
    folder = tmp_path / "helpers"
    folder.mkdir()
    for name, source in helpers.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.setattr(lightning_reach, "LOCAL_DIRS", (folder, *lightning_reach.LOCAL_DIRS))
    lightning_reach.reset()


@pytest.fixture
def fresh_reach():
    lightning_reach.reset()
    yield
    lightning_reach.reset()  # the next question solves the real suite again (monkeypatch restores the folders)


def test_a_helper_that_uses_one_that_reaches_lightning_reaches_it(tmp_path, monkeypatch, fresh_reach):
    """Through the definitions of a local helper module, one using another."""
    _with_helpers(
        tmp_path,
        monkeypatch,
        {
            "probe_helpers": """
                import lightning as L

                def trainer():
                    return L.Trainer()

                def fit():
                    return trainer().fit

                def plain():
                    return 1
            """
        },
    )
    facing, free = tmp_path / "test_facing.py", tmp_path / "test_free.py"
    facing.write_text("from probe_helpers import fit\n\ndef test_a():\n    fit()\n")
    free.write_text("from probe_helpers import plain\n\ndef test_a():\n    plain()\n")
    assert reaches_lightning(facing)
    assert not reaches_lightning(free)


def test_helpers_that_import_each_other_get_one_answer_whichever_is_asked_first(tmp_path, monkeypatch, fresh_reach):
    """A cycle of lazy imports between helper modules: the least fixpoint, whatever the order of the questions
    (before, the first module asked answered "everything reaches" for the others, depending on the hash seed)."""
    helpers = {
        "cycle_a": "def plain():\n    from cycle_b import other\n    return other\n\n"
        "def facing():\n    from cycle_b import trainer\n    return trainer()\n",
        "cycle_b": "import lightning as L\n\ndef other():\n    from cycle_a import plain\n    return plain\n\n"
        "def trainer():\n    return L.Trainer()\n",
    }
    _with_helpers(tmp_path, monkeypatch, helpers)
    plain, facing = tmp_path / "test_plain.py", tmp_path / "test_facing.py"
    plain.write_text("from cycle_a import plain\n\ndef test_a():\n    plain()\n")
    facing.write_text("from cycle_a import facing\n\ndef test_a():\n    facing()\n")
    for order in ((plain, facing), (facing, plain)):
        lightning_reach.reset()
        answers = {path: reaches_lightning(path) for path in order}
        assert answers == {plain: False, facing: True}


def test_a_fixture_of_conftest_that_reaches_lightning_counts(tmp_path, monkeypatch, fresh_reach):
    """A test that requests, by parameter name, a conftest fixture that uses Lightning."""
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "conftest.py").write_text("import lightning as L\n\ndef trainer():\n    return L.Trainer()\n")
    monkeypatch.setattr(lightning_reach, "LOCAL_DIRS", (folder,))
    monkeypatch.setattr(lightning_reach, "_CONFTEST", folder / "conftest.py")
    lightning_reach.reset()
    probe = folder / "test_probe.py"
    probe.write_text("def test_a(trainer):\n    trainer.fit\n")
    assert reaches_lightning(probe)
    probe.write_text("def test_a(tmp_path):\n    tmp_path\n")
    lightning_reach.reset()
    assert not reaches_lightning(probe)


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


def test_relative_imports_inside_the_package_are_followed(tmp_path, monkeypatch, fresh_reach):
    """The package's modules use absolute imports today; a relative one must still be followed, not skipped."""
    package = tmp_path / "lightning_fp8"
    package.mkdir()
    files = {
        "__init__.py": "from lightning_fp8.core import cast\n",
        "core.py": "from . import helpers\n",
        "helpers.py": "import math\n",
        "plugin.py": "from .glue import Plugin\n",
        "glue.py": "from lightning.pytorch.plugins import Precision as Plugin\n",
    }
    for name, source in files.items():
        (package / name).write_text(source)
    monkeypatch.setattr(lightning_reach, "REPO", tmp_path)
    lightning_reach.reset()
    assert lightning_reach._package_reaching() == {"lightning_fp8.plugin", "lightning_fp8.glue"}
