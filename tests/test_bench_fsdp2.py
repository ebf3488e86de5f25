"""benchmarks/bench_fsdp2.py: its result file says what the docs table shows, and the script's configurations are the
ones the docs describe. (The measurement itself, 2 processes per configuration, runs in tests/test_fsdp2.py's
gathered-bytes test on the same model; the full benchmark is too slow for the suite.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_fsdp2  # noqa: E402
import docs_tables  # noqa: E402


def test_result_file_holds_every_configuration_measured():
    data = json.loads((ROOT / "benchmarks" / "results" / "fsdp2.json").read_text())
    assert list(data["configs"]) == bench_fsdp2.CONFIGS
    configs = data["configs"]
    assert all(c["status"] == "measured" for c in configs.values()), configs
    bf16 = configs["bf16"]["all_gather_bytes"]
    for name in ("tensorwise", "delayed"):  # FP8 all-gather: the target, as the table reports it
        assert configs[name]["all_gather_bytes"] <= docs_tables.FSDP2_GATHER_TARGET * bf16
    for name in ("tensorwise-bf16-gather", "rowwise"):  # high-precision gathers move the bf16 bytes
        assert configs[name]["all_gather_bytes"] == bf16
    assert "met" in docs_tables.fsdp2_all_gather()


def test_worker_configurations_parse():
    """Every configuration name maps to a recipe the plugin accepts (or to bf16 / torchao)."""
    import lightning_fp8 as lf

    for name in bench_fsdp2.CONFIGS:
        if name == "bf16" or name.startswith("torchao"):
            continue
        lf.FP8Precision(recipe=name.split("-")[0])
