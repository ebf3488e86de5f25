"""The versions lightning-fp8 accepts are the versions its suite runs on: pyproject.toml's floors, the warning on an
older torch, and the Lightning release `.ci/run` runs the suite on a second time."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import lightning_fp8

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _floor(name: str) -> str:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [Requirement(d) for d in dependencies if Requirement(d).name == name]
    (specifier,) = requirement.specifier
    assert specifier.operator == ">=", requirement
    return specifier.version


@pytest.mark.parametrize("version", ["2.10.0+cu128", "2.8.0", "2.10.1", "2.10.0a0+nv", "2.9.0.dev20250101"])
def test_an_older_torch_than_the_tested_ones_is_warned_about(version):
    with pytest.warns(UserWarning, match=rf"tested with torch 2\.11 and newer, and this is torch {re.escape(version)}"):
        lightning_fp8._warn_if_torch_is_untested(version)


@pytest.mark.parametrize(  # pre-releases and vendor builds of 2.11 count as 2.11 (NVIDIA's containers: 2.11.0a0+...)
    "version",
    ["2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0.dev20261101", "2.11.0a0+6c8c5ad5ea.nv26.01",
     "2.11.0rc1", "dev", "2.11.0 (custom)"],
)
def test_a_tested_or_newer_torch_is_not_warned_about(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lightning_fp8._warn_if_torch_is_untested(version)


def test_the_torch_floor_is_the_oldest_tested_torch():
    assert _floor("torch") == ".".join(map(str, lightning_fp8._OLDEST_TESTED_TORCH))


def test_ci_runs_the_suite_on_the_lightning_floor():
    """``.ci/run``'s second run lays exactly pyproject's Lightning floor over the installed release, and checks it."""
    ci = (ROOT / ".ci" / "run").read_text()
    floor = _floor("lightning")
    assert f"--target \"$floor\" lightning=={floor}\n" in ci
    assert f'assert lightning.__version__ == "{floor}"' in ci
    assert re.search(r'PYTHONPATH="\$floor" python -m pytest tests -q', ci)


def test_the_star_import_gives_the_public_api_only():
    namespace: dict = {}
    exec("from lightning_fp8 import *", namespace)
    names = {name for name in namespace if not name.startswith("__")}
    assert names == set(lightning_fp8.__all__)
    assert {"FP8Precision", "FP8StatsCallback", "FP8Stats", "convert_to_fp8", "fp8_autocast"} <= names
    assert not {"state", "stats", "convert", "module", "fabric"} & names  # the submodules stay out
