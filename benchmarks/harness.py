"""The small harness every benchmark script shares: machine facts, timing, ratios, tables, result files.

A benchmark script should read like the experiment it runs; what it needs around the experiment is here:

* :func:`environment`: the date, CPU (model and matrix-unit flags), cores and threads, load average, the
  versions of Python, torch, torchao, lightning and lightning_fp8 (with its path and git revision, so a
  before/after comparison can tell the two trees apart) and the GEMM path;
* :func:`interleaved`: times several variants in alternation (round-robin), so load drift on a shared
  machine hits all of them alike; reports the median and the fastest wall time and the process CPU time;
* :func:`stop_on_signals`: a ``SIGTERM`` (``timeout``'s signal) raises :class:`Stopped`, so a script under a time
  limit writes what it measured before the limit instead of losing the whole run;
* :func:`ratio`, :func:`markdown_table`, :func:`write_report`: numbers as ratios to a baseline from the same
  run, a Markdown report and a JSON file with the raw numbers;
* what one step costs besides time: :func:`saved_tensor_bytes` (bytes saved for backward), :func:`profile_step`
  (host syncs, aten ops and peak allocated bytes of one call), :func:`dynamo_counts` (graphs, graph breaks).

Speed is only meaningful as a ratio measured in one run on one machine: never put a wall-clock number in
a test.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
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


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``environment`` records them."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def environment(device: str = "cpu") -> dict[str, str]:
    """Machine and versions, for the top of every report. For a CUDA ``device`` also the GPU (key ``device``), and
    the GEMM path is that device's."""
    import lightning_fp8 as lf

    package = os.path.dirname(os.path.abspath(lf.__file__))
    describe = getattr(lf.gemm, "describe_gemm_path", lambda device: "")
    gpu = {}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {"device": f"{device}: {props.name}, compute capability {props.major}.{props.minor}, "
                         f"{props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"}
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu_model(),
        "cpu matrix flags": cpu_matrix_flags(),
        "cores": f"{os.cpu_count()} logical CPUs, torch uses {torch.get_num_threads()} threads",
        "load average at start": load_average(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchao": package_version("torchao"),
        "lightning": package_version("lightning"),
        "lightning_fp8": f"{lf.__version__} from {package} (git {git_revision(package)})",
        **gpu,
        "GEMM path": f"{lf.gemm_path(device)}: {describe(device)}",
    }


@dataclass
class Timing:
    """Seconds per call of one variant."""

    median: float
    fastest: float
    cpu: float  #: median process CPU time per call (robust to other processes on the machine)
    calls: int
    walls: list[float] = field(default_factory=list)  #: wall seconds per call of each round (the spread)


class Stopped(BaseException):
    """A signal asked the run to stop (see :func:`stop_on_signals`). A ``BaseException``, so the ``except Exception``
    that a benchmark uses to record a failing variant and go on does not swallow it.

    ``timings``: set by :func:`interleaved` when the signal came while it was timing: the rounds completed so far."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.timings: dict[str, Timing] = {}


@contextlib.contextmanager
def stop_on_signals(signals: Sequence[int] = (signal.SIGTERM,)) -> Iterator[None]:
    """Within the block, the first of ``signals`` raises :class:`Stopped` in the main thread (at the next Python
    bytecode: a running kernel, GEMM or compilation finishes first) and later ones are ignored, so that writing the
    partial results is not interrupted again. ``timeout`` sends ``SIGTERM``; run it with ``-k`` so that a process
    stuck outside Python is still killed."""

    def stop(signum: int, frame: Any) -> None:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _timings(wall: dict[str, list[float]], cpu: dict[str, list[float]], calls: int) -> dict[str, Timing]:
    """The rounds each variant completed (a stop between a round's two appends leaves one list a round longer)."""
    out = {}
    for name in wall:
        rounds = min(len(wall[name]), len(cpu[name]))
        if rounds:
            walls = wall[name][:rounds]
            out[name] = Timing(statistics.median(walls), min(walls), statistics.median(cpu[name][:rounds]),
                               rounds * calls, walls)
    return out


def interleaved(variants: dict[str, Callable[[], Any]], rounds: int = 7, calls: int = 3, warmup: int = 2) -> dict[str, Timing]:
    """Time each variant ``rounds`` times (``calls`` calls per measurement), round-robin across variants.

    Stopped by a signal (:func:`stop_on_signals`), the :class:`Stopped` it raises carries the timings of the rounds
    completed so far (a variant whose round was cut short has one round fewer; one with none is left out)."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(rounds):
            for name, fn in variants.items():
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    fn()
                wall[name].append((time.perf_counter() - t0) / calls)
                cpu[name].append((time.process_time() - c0) / calls)
    except Stopped as stop:
        stop.timings = _timings(wall, cpu, calls)
        raise
    return _timings(wall, cpu, calls)


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


# ------------------------------------------------------------------------------ what one step costs besides time

#: Ops that copy a device value to the host (``.item()``, ``bool(tensor)``, ``int(tensor)`` dispatch to the first).
SYNC_OPS = ("aten::_local_scalar_dense", "aten::equal")


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``, or the plain tensors a tensor subclass (torchao's ``Float8TrainingTensor``) is made of."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [p for n in names for p in _parts(getattr(t, n))]
    return [t]


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``; a tensor subclass (torchao's ``Float8TrainingTensor``) has those of its parts."""
    return [p.untyped_storage() for p in _parts(t)]


@dataclass
class SavedTensor:
    """One storage saved for backward (see :func:`saved_tensors`)."""

    shape: tuple[int, ...]  #: of the (first) tensor saved with it
    dtype: str
    nbytes: int  #: the whole storage's
    where: str  #: the bucket ``where()`` named at the save


def saved_tensors(run: Callable[[], Any], params: Iterable[torch.Tensor],
                  where: Callable[[], str] = lambda: "all") -> tuple[list[SavedTensor], Any]:
    """The storages saved for backward while ``run()`` executes (``torch.autograd.graph.saved_tensors_hooks``).

    Each storage counts once; storages of ``params`` do not count (they are alive anyway). ``where()`` is asked at
    each save and names its bucket (say, whether a Linear layer's forward is running). Returns the storages in the
    order they were saved and what ``run`` returned (keep it alive for a backward, or drop it)."""
    skip = {s.data_ptr() for p in params for s in storages(p)}
    seen: set[int] = set()
    saved: list[SavedTensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        for part in _parts(t):
            s = part.untyped_storage()
            ptr = s.data_ptr()
            if ptr in skip or ptr in seen:
                continue
            seen.add(ptr)
            saved.append(SavedTensor(tuple(part.shape), str(part.dtype).removeprefix("torch."), s.nbytes(), where()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return saved, out


def inductor_partitioned_backend() -> Any:
    """A ``torch.compile`` backend that decomposes and partitions as inductor does (its decompositions, its joint-graph
    passes, then AOTAutograd's min-cut partitioner) and runs the forward and backward graphs as they are, without
    inductor's code generation: what a compiled step saves for backward under inductor, in seconds on a CPU."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    return aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=partition_fn,
                        decompositions=select_decomp_table())


def saved_tensor_bytes(run: Callable[[], Any], params: Iterable[torch.Tensor],
                       where: Callable[[], str] = lambda: "all") -> tuple[dict[str, int], Any]:
    """Bytes saved for backward while ``run()`` executes, per ``where()`` bucket (see :func:`saved_tensors`), and what
    ``run`` returned."""
    saved, out = saved_tensors(run, params, where)
    buckets: dict[str, int] = {}
    for t in saved:
        buckets[t.where] = buckets.get(t.where, 0) + t.nbytes
    return buckets, out


@dataclass
class StepProfile:
    """One profiled call."""

    syncs: int  #: host syncs: :data:`SYNC_OPS` dispatched (nested ones once), not those inside a fused kernel
    aten_ops: int  #: aten ops dispatched at the top level (an eager op count; compiled code dispatches few)
    peak_bytes: int  #: peak bytes allocated above the call's start (CUDA caching allocator, or torch's CPU allocator)
    peak_source: str  #: where ``peak_bytes`` comes from
    cuda_syncs: int | None = None  #: synchronizing CUDA calls reported by ``torch.cuda.set_sync_debug_mode`` (CUDA only)
    fused_kernel_reads: int = 0  #: :data:`SYNC_OPS` inside ``aten::_fused_*`` kernels (see :func:`profile_step`)
    #: where the ``cuda_syncs`` come from: the innermost frames of this project at each call, and how often
    cuda_sync_sites: dict[str, int] | None = None


def _note_sync(sites: dict[str, int], message: Warning | str) -> None:
    """Count one synchronising-call warning of ``torch.cuda.set_sync_debug_mode`` under its call site: the innermost
    three frames of this project (``lightning_fp8``, ``benchmarks``) on the stack, innermost first."""
    if "synchroniz" not in str(message):
        return
    import traceback

    ours = [f for f in traceback.extract_stack() if os.path.abspath(f.filename) != os.path.abspath(__file__)
            and ("lightning_fp8" in f.filename or "benchmarks" in f.filename)]
    site = " < ".join(f"{os.path.relpath(f.filename)}:{f.lineno}" for f in reversed(ours[-3:])) or "(no frame of ours)"
    sites[site] = sites.get(site, 0) + 1


def profile_step(fn: Callable[[], Any], device: str = "cpu") -> StepProfile:
    """Run ``fn`` once under ``torch.profiler`` and count its host syncs and aten ops and its peak memory.

    The profiler sees the aten ops that compiled code dispatches too (unlike a ``TorchDispatchMode``, under which
    ``torch.compile`` runs the model eagerly). A sync op inside an ``aten::_fused_*`` kernel (the CPU kernel of
    ``AdamW(fused=True)`` reads each parameter's step counter, a CPU tensor, with ``item()``; the CUDA kernel reads it
    on the device) is counted apart, in ``fused_kernel_reads``. Peak memory: on CUDA ``torch.cuda.max_memory_allocated``
    above the bytes allocated at the start; on a CPU the running sum of the profiler's allocation and free events of
    torch's CPU allocator (tensors only: not the Python heap, not the process RSS)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    cuda_syncs = None
    sites: dict[str, int] | None = None
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=not cuda) as prof:
        if cuda:
            sites = {}
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = lambda message, *args, **kwargs: _note_sync(sites, message)
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    fn()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            cuda_syncs = sum(sites.values())
            torch.cuda.synchronize(device)
        else:
            fn()
    events = prof.events()
    syncs = ops = fused = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        ancestors = []
        parent = e.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        ops += not any(a.startswith("aten::") for a in ancestors)
        if e.name in SYNC_OPS and not any(a in SYNC_OPS for a in ancestors):
            if any(a.startswith("aten::_fused_") for a in ancestors):
                fused += 1
            else:
                syncs += 1
    if cuda:
        return StepProfile(syncs, ops, torch.cuda.max_memory_allocated(device) - base,
                           "torch.cuda.max_memory_allocated", cuda_syncs, fused, sites)
    # every allocation and free, in order (the FunctionEvents fold those inside an op into the op)
    memory = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for e in memory:
        running += e.nbytes()
        peak = max(peak, running)
    return StepProfile(syncs, ops, peak, "torch's CPU allocator, from the profiler's memory events", None, fused)


def dynamo_counts() -> dict[str, int]:
    """torch._dynamo's running totals: ``graphs`` compiled, ``graph_breaks``, ``frames`` compiled. Take the
    difference of two calls around what you measure (a recompilation adds a graph)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values()),
            "frames": counters["frames"].get("ok", 0)}


#: Phases of ``torch.compile`` as ``torch._dynamo.utils.compile_times()`` names them: dynamo interpreting the Python
#: bytecode, AOTAutograd tracing the joint graph, inductor's scheduling and code generation, and compiling the
#: generated code (C++ on a CPU; waiting for the asynchronous compile workers, Triton included). Some overlap (the
#: generated code compiles in workers while the main thread goes on) and other phases are left out: their sum is not
#: the compile time.
COMPILE_PHASES = ("bytecode_tracing", "aot_trace_joint_graph", "GraphLowering.codegen", "compile_file",
                  "async_compile.wait")


def compile_phase_seconds() -> dict[str, float]:
    """torch's running totals of the :data:`COMPILE_PHASES`, in seconds; take the difference of two calls around
    what you measure (where compile time goes: see the compile-time notes in docs/benchmarks.md)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {phase: float(sum(compilation_time_metrics.get(phase, ()))) for phase in COMPILE_PHASES}
