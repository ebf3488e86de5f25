import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

# Keep the suite deterministic and light on a 2-core CPU machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Idle OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning threads slow steps ~6x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def assert_cuda_scaled_mm_contract(a, b, scale_a, scale_b, out_dtype):
    """CUDA ``torch._scaled_mm``'s operand rules, written independently of ``lightning_fp8.gemm``."""
    assert a.dim() == 2 and b.dim() == 2, "operands must be 2-D"
    assert a.dtype in _FP8 and b.dtype in _FP8, (a.dtype, b.dtype)
    assert not (a.dtype == b.dtype == torch.float8_e5m2), "e5m2 x e5m2"
    m, k = a.shape
    assert b.shape[0] == k, (a.shape, b.shape)
    n = b.shape[1]
    assert a.stride(1) == 1 and (m <= 1 or a.stride(0) == k), f"a not row-major: {a.stride()}"
    assert b.stride(0) == 1 and (n <= 1 or b.stride(1) == k), f"b not column-major: {b.stride()}"
    assert k % 16 == 0 and n % 16 == 0, f"K={k}, N={n} not multiples of 16"
    assert scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        assert scale_a.dim() <= 1 and scale_b.dim() <= 1
    else:
        assert tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n), (scale_a.shape, scale_b.shape)
        assert a.dtype == b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
        assert scale_a.is_contiguous() and scale_b.is_contiguous()


@pytest.fixture(autouse=True)
def _check_every_emulated_gemm(monkeypatch):
    """Every emulated FP8 GEMM in the suite must satisfy the CUDA contract (checked independently of the
    library's own check), so CPU runs catch what the CUDA kernel would reject."""
    from lightning_fp8 import gemm

    original = gemm.emulated_scaled_mm

    def checked(a, b, inv_a, inv_b, out_dtype):
        assert_cuda_scaled_mm_contract(a, b, inv_a, inv_b, out_dtype)
        return original(a, b, inv_a, inv_b, out_dtype)

    monkeypatch.setattr(gemm, "emulated_scaled_mm", checked)
    yield


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank in this process (FSDP2 and DTensor need one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------ the floor stage of .ci/run: Lightning-facing modules only


def pytest_addoption(parser):
    parser.addoption(
        "--lightning-facing",
        action="store_true",
        help="run only the test modules that reach Lightning (tests/lightning_reach.py): .ci/run's second stage, on "
        "Lightning's oldest supported release, where the tests of the FP8 core alone would rerun unchanged",
    )


_LIGHTNING_FREE = pytest.StashKey[list]()


def pytest_collection_modifyitems(config, items):
    if not config.getoption("lightning_facing"):
        return
    from lightning_reach import reaches_lightning

    paths = sorted({item.path for item in items})
    facing = {path: path.suffix != ".py" or reaches_lightning(path) for path in paths}
    dropped = [item for item in items if not facing[item.path]]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if facing[item.path]]
    config.stash[_LIGHTNING_FREE] = sorted(path.name for path, reaches in facing.items() if not reaches)


def pytest_terminal_summary(terminalreporter, config):
    free = config.stash.get(_LIGHTNING_FREE, None)
    if free:
        terminalreporter.write_line(f"--lightning-facing: deselected the Lightning-free modules {', '.join(free)}")


# ----------------------------------------------------------------------- subprocesses started early, run in the background
#
# The suite's slow subprocesses (the 2-process checks, the Triton interpreter, the documentation pages, the examples
# run as a user runs them, ...) are mostly one busy process each, and so are most in-process tests: on this 2-core
# machine one core idled through most of the session. So they start when collection ends, one at a time in a
# background thread, in the order the tests need them, and run while the in-process tests run; a test waits for the
# run it reads (and starts it itself if the background thread has not reached it yet). The commands, their checks and
# the assertions on their results are the tests' own; only when the command runs changes.
#
# A test module declares its runs as ``EARLY_RUNS = {fixture name: builder}``, the builder taking a fresh folder and
# returning the run's ``dict(args=..., cwd=..., env=..., timeout=...)``; the run starts when a collected test uses
# that fixture, and the fixture reads it with ``early_runs.result(__name__, fixture name)``. A run that reads another
# one's files names it, ``after=(module, fixture)``, and may give ``args`` as a function of that run's result. The
# background runs are niced (the tests' own process comes first).


# Background runs yield the CPU to the tests' own process (a run a test waits for gets it anyway: that process idles).
EARLY_NICENESS = 10


@dataclasses.dataclass
class EarlyResult:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would have returned, and the run's folder."""

    args: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    workdir: Path
    timed_out: bool


class _Run:
    def __init__(self, builder: Callable[[Path], dict], workdir: Path) -> None:
        workdir.mkdir(parents=True)
        spec = builder(workdir)
        self.after = spec.get("after")  # the key of a run this one reads: it starts once that one is done
        self.make_args = spec["args"] if callable(spec["args"]) else None  # a function of that run's result
        self.args = [] if self.make_args else [str(a) for a in spec["args"]]
        self.cwd = str(spec.get("cwd", workdir))
        self.env = dict(spec.get("env") or os.environ)  # the environment when collection ended, not when it starts
        self.timeout = spec.get("timeout", 600)
        self.workdir = workdir
        self.state = "queued"
        self.proc: subprocess.Popen | None = None
        self.done = threading.Event()
        self.result: EarlyResult | None = None

    def execute(self, niceness: int = 0) -> None:
        out, err = self.workdir / "early_stdout.txt", self.workdir / "early_stderr.txt"
        timed_out = False
        try:
            with open(out, "w") as stdout, open(err, "w") as stderr:  # files, not pipes: nobody reads them meanwhile
                self.proc = proc = subprocess.Popen(
                    self.args,
                    cwd=self.cwd,
                    env=self.env,
                    stdout=stdout,
                    stderr=stderr,
                    text=True,
                    start_new_session=True,
                )
                if niceness:  # the whole process group (a launcher's children too): the tests' process comes first
                    try:
                        os.setpriority(os.PRIO_PGRP, proc.pid, niceness)
                    except OSError:
                        pass
                try:
                    proc.wait(timeout=self.timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole session: a launcher's children too
                    proc.wait()
                    timed_out = True
            returncode = proc.returncode
        except Exception as error:  # noqa: BLE001  (reported to the test that reads the run)
            returncode, timed_out = None, False
            err.write_text(f"could not run {self.args}: {error!r}")
        stderr_text = err.read_text(errors="replace")
        if timed_out:
            stderr_text += f"\n[killed after {self.timeout} s]"
        self.result = EarlyResult(
            self.args, returncode, out.read_text(errors="replace"), stderr_text, self.workdir, timed_out
        )
        self.done.set()


class EarlyRuns:
    """The session's early runs: queued in the order the tests need them, run one at a time by a background thread."""

    def __init__(self, config) -> None:
        factory = getattr(config, "_tmp_path_factory", None)  # pytest's basetemp: kept for the last 3 sessions
        self.root = factory.mktemp("early_runs") if factory is not None else Path(tempfile.mkdtemp(prefix="early_runs"))
        self.runs: dict[tuple[str, str], _Run] = {}
        self.order: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, key: tuple[str, str], builder: Callable[[Path], dict]) -> None:
        if key not in self.runs:
            self.runs[key] = _Run(builder, self.root / f"{len(self.runs):02d}_{key[1]}")
            self.order.append(key)

    def _claim(self, key: tuple[str, str] | None = None) -> _Run | None:
        with self.lock:
            keys = [key] if key is not None else self.order
            for k in keys:
                if self.runs[k].state == "queued":
                    self.runs[k].state = "running"
                    return self.runs[k]
        return None

    def _execute(self, run: _Run, niceness: int = 0) -> None:
        try:
            if run.after is not None:
                before = self.runs[run.after]
                if (mine := self._claim(run.after)) is not None:
                    self._execute(mine, niceness)
                before.done.wait()
                if run.make_args is not None:
                    run.args = [str(a) for a in run.make_args(before.result)]
        except Exception as error:  # noqa: BLE001  (a test waits for this run: it must end, with the error)
            run.result = EarlyResult(run.args, None, "", f"could not start: {error!r}", run.workdir, False)
            run.done.set()
            return
        run.execute(niceness)

    def _work(self) -> None:
        while (run := self._claim()) is not None:
            self._execute(run, niceness=EARLY_NICENESS)

    def start(self) -> None:
        if self.order:
            self.thread = threading.Thread(target=self._work, name="early-runs", daemon=True)
            self.thread.start()

    def result(self, module: str, fixture: str, builder: Callable[[Path], dict] | None = None) -> EarlyResult:
        key = (module, fixture)
        if key not in self.runs:  # not announced at collection (a fixture requested another way): run it now
            assert builder is not None, f"no early run {key}"
            self.add(key, builder)
        run = self.runs[key]
        if (mine := self._claim(key)) is not None:  # the background thread has not reached it: run it here
            self._execute(mine)
        run.done.wait()
        assert run.result is not None
        return run.result

    def stop(self) -> None:
        """At the end of the session: runs no test read (an interrupted or failed-fast session) do not outlive it."""
        with self.lock:
            for run in self.runs.values():
                if run.state == "queued":
                    run.state = "cancelled"
                elif run.proc is not None and run.proc.poll() is None:
                    try:
                        os.killpg(run.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:  # it ended meanwhile
                        pass


_EARLY_RUNS = pytest.StashKey[EarlyRuns]()


def _early_runs(config) -> EarlyRuns:
    if _EARLY_RUNS not in config.stash:
        config.stash[_EARLY_RUNS] = EarlyRuns(config)
    return config.stash[_EARLY_RUNS]


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    runs = _early_runs(session.config)
    for item in session.items:
        if any(item.iter_markers("gloo")):
            runs.add(("conftest", "gloo_runs"), lambda workdir: _gloo_spec(session, workdir))
        module = getattr(item, "module", None)
        declared = getattr(module, "EARLY_RUNS", {})
        for fixture in item.fixturenames:
            if fixture in declared:
                runs.add((module.__name__, fixture), declared[fixture])
    runs.start()


def pytest_sessionfinish(session):
    if _EARLY_RUNS in session.config.stash:
        session.config.stash[_EARLY_RUNS].stop()


@pytest.fixture(scope="session")
def early_runs(request) -> EarlyRuns:
    return _early_runs(request.config)


# ------------------------------------------------------------------------- the 2-process checks, one launch per session

GLOO_CHECKS = Path(__file__).parent / "scripts" / "gloo_checks.py"
GLOO_TIMEOUT_S = 900


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gloo(*checks): checks of tests/scripts/gloo_checks.py the test reads through the gloo_runs fixture (all the "
        "checks of a session's tests run in one 2-process launch)",
    )


def _gloo_checks(session) -> list[str]:
    return list(dict.fromkeys(c for item in session.items for mark in item.iter_markers("gloo") for c in mark.args))


def gloo_launch(workdir: Path, checks: list[str], world: int = 2, timeout: int = GLOO_TIMEOUT_S) -> dict:
    """The early run of one launch of tests/scripts/gloo_checks.py: ``checks`` on ``world`` processes, in
    ``workdir / "checks"`` (which :class:`GlooRuns` reads)."""
    out = workdir / "checks"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_WORLD_SIZE": str(world)}
    return {"args": [sys.executable, GLOO_CHECKS, out, *checks], "cwd": out, "env": env, "timeout": timeout}


def _gloo_spec(session, workdir: Path) -> dict:
    return gloo_launch(workdir, _gloo_checks(session))


class GlooRuns:
    """The folders of the checks run by tests/scripts/gloo_checks.py, and that run's output."""

    def __init__(self, out: Path, checks: list[str], run: EarlyResult) -> None:
        self.out, self.checks, self.run = out, checks, run

    def folder(self, check: str) -> Path:
        """The check's folder; fails with the check's traceback, or the run's output, unless every rank completed it."""
        assert check in self.checks, f"{check!r} did not run: mark the test with @pytest.mark.gloo({check!r})"
        # imported here, not with conftest: utils imports Lightning, whose logger must be set up after pytest's logging
        from utils import gloo_check_folder

        path = gloo_check_folder(self.run, check)
        tail = (
            f"\n--- gloo_checks.py (exit code {self.run.returncode}), output tail ---\n"
            f"{self.run.stdout[-3000:]}\n{self.run.stderr[-6000:]}"
        )
        errors = sorted(path.glob("error_rank*.txt"))
        if errors:
            pytest.fail(
                f"{check} raised:\n" + "\n".join(f"{e.name}:\n{e.read_text()}" for e in errors) + tail, pytrace=False
            )
        plan = json.loads((self.out / "plan.json").read_text()) if (self.out / "plan.json").exists() else {}
        ranks = (0,) if check in plan.get("single", ()) else tuple(range(plan.get("world", 2)))
        missing = [rank for rank in ranks if not (path / f"done_rank{rank}").exists()]
        if missing:
            pytest.fail(f"{check} did not complete on rank(s) {missing}" + tail, pytrace=False)
        return path


@pytest.fixture(scope="session")
def gloo_runs(request, early_runs) -> GlooRuns:
    """Every check named by a ``gloo`` mark of the session's tests, run in one launch of tests/scripts/gloo_checks.py
    (2 processes on gloo, started early); the tests read the results from the checks' folders."""
    run = early_runs.result("conftest", "gloo_runs", lambda workdir: _gloo_spec(request.session, workdir))
    return GlooRuns(run.workdir / "checks", _gloo_checks(request.session), run)
