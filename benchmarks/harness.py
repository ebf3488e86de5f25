"""The small harness every benchmark script shares: machine facts, timing, ratios, tables, result files.

A benchmark script should read like the experiment it runs; what it needs around the experiment is here:

* :func:`environment`: the date, CPU (model and matrix-unit flags), cores and threads, load average, the
  versions of Python, torch, torchao, lightning and lightning_fp8 (with its path and git revision, so a
  before/after comparison can tell the two trees apart) and the GEMM path;
* :func:`interleaved`: times several variants in alternation (round-robin), so load drift on a shared
  machine hits all of them alike; reports the median and the fastest wall time and the process CPU time;
* :func:`ratio`, :func:`markdown_table`, :func:`write_report`: numbers as ratios to a baseline from the same
  run, a Markdown report and a JSON file with the raw numbers.

Speed is only meaningful as a ratio measured in one run on one machine: never put a wall-clock number in
a test.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpuinfo(field: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name."""
    return _cpuinfo("model name") or platform.processor() or "unknown"


def cpu_matrix_flags() -> str:
    """The CPU flags that decide bf16 matrix speed (AMX, AVX-512 bf16)."""
    flags = (_cpuinfo("flags") or "").split()
    keep = [f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f"))]
    return " ".join(sorted(keep)) or "none of amx/avx512 (bf16 matrix products are slow here)"


def package_version(name: str) -> str:
    """The installed version of a distribution, or ``"not installed"``."""
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "not installed"


def git_revision(path: str) -> str:
    """The short git revision of the tree that holds ``path``, marked if that package has uncommitted changes."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=path, capture_output=True, text=True)
        return rev.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")
    except Exception:
        return "unknown"


def environment() -> dict[str, str]:
    """Machine and versions, for the top of every report."""
    import lightning_fp8 as lf

    package = os.path.dirname(os.path.abspath(lf.__file__))
    describe = getattr(lf.gemm, "describe_gemm_path", lambda device: "")
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu_model(),
        "cpu matrix flags": cpu_matrix_flags(),
        "cores": f"{os.cpu_count()} logical CPUs, torch uses {torch.get_num_threads()} threads",
        "load average at start": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchao": package_version("torchao"),
        "lightning": package_version("lightning"),
        "lightning_fp8": f"{lf.__version__} from {package} (git {git_revision(package)})",
        "GEMM path": f"{lf.gemm_path('cpu')}: {describe('cpu')}",
    }


@dataclass
class Timing:
    """Seconds per call of one variant."""

    median: float
    fastest: float
    cpu: float  #: median process CPU time per call (robust to other processes on the machine)
    calls: int


def interleaved(variants: dict[str, Callable[[], Any]], rounds: int = 7, calls: int = 3, warmup: int = 2) -> dict[str, Timing]:
    """Time each variant ``rounds`` times (``calls`` calls per measurement), round-robin across variants."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                fn()
            wall[name].append((time.perf_counter() - t0) / calls)
            cpu[name].append((time.process_time() - c0) / calls)
    return {
        name: Timing(statistics.median(wall[name]), min(wall[name]), statistics.median(cpu[name]), rounds * calls)
        for name in variants
    }


def ratio(value: float, baseline: float) -> str:
    """``value / baseline`` formatted as ``1.23x``."""
    return f"{value / baseline:.2f}x" if baseline else "n/a"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(path: str, env: dict[str, str], command: str, **data: Any) -> None:
    """Write one result file (JSON): the machine and versions, the command that produced it, and the numbers.
    ``benchmarks/docs_tables.py`` renders the documentation's tables from such files."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": env, "command": command, **data}, f, indent=1, default=lambda o: asdict(o))


def write_report(title: str, env: dict[str, str], sections: Sequence[str], data: dict[str, Any],
                 out_md: str | None, out_json: str | None) -> str:
    """Print the Markdown report and write it (and the raw numbers as JSON) where asked."""
    head = [f"# {title}", "", markdown_table(["", ""], list(env.items()))]
    loads = [float(v.split()[0]) for k, v in env.items() if k.endswith("load average at start")]
    if loads and max(loads) > (os.cpu_count() or 1) / 2:
        head += ["", f"**The machine was busy (load {max(loads):.2f}): wall times are noisy; prefer CPU time.**"]
    text = "\n\n".join(["\n".join(head), *sections]) + "\n"
    print(text)
    if out_md:
        with open(out_md, "w") as f:
            f.write(text)
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"environment": env, **data}, f, indent=2, default=lambda o: asdict(o))
    return text
