#!/usr/bin/env python
"""The example of the docs' "Is FP8 faster for my model?" page: ``lightning_fp8.compare`` on the example's config.

Usage::

    python benchmarks/bench_compare.py [--steps 30] [--warmup 5] [--json benchmarks/results/compare_example.json]

Runs ``python -m lightning_fp8.compare`` on ``examples/fp8_lm/configs/cpu.yaml`` (bf16-mixed and the three recipes,
same weights and batches) and writes its result with the machine and versions (``harness.environment``);
``benchmarks/docs_tables.py`` renders the page's example report from that file.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

from lightning_fp8 import compare

ROOT = os.path.dirname(harness.HERE)
DEFAULT_JSON = os.path.join(harness.HERE, "results", "compare_example.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default=DEFAULT_JSON)
    args = parser.parse_args()
    command = [
        "--config", "examples/fp8_lm/configs/cpu.yaml",
        "--model-class", "examples/fp8_lm/train.py:ByteTransformerLM",
        "--data-class", "examples/fp8_lm/train.py:StdlibBytes",
        "--recipes", "tensorwise", "delayed", "rowwise",
        "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]
    env = harness.environment()
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as out:
        result = compare.main([*command, "--out", out])
    harness.write_result(args.json, env, "python -m lightning_fp8.compare " + " ".join(command),
                         comparison=result.to_dict())
    print(f"written to {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
