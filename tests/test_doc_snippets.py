"""The code on the documentation pages runs, as a reader would run it.

Pages: ``README.md``, ``examples/README.md`` and every ``docs/**/*.md``. Fenced code blocks are found at any
indentation (inside list items and admonitions too; the fence's indentation is removed from the block).

**```python blocks** run page by page, in page order, in one namespace per page (a later block may use what an
earlier one defined), each page in its own process whose working directory is a fresh temporary directory (files a
snippet writes land there) and whose environment hides every GPU (``CUDA_VISIBLE_DEVICES=""``): the snippets must
run on a CPU. To spare each page the ~7 s import of torch and Lightning, the page processes are forked from one
runner process that has imported ``torch``, ``lightning`` and ``lightning_fp8`` and done nothing else; each page
still starts from an empty namespace. A failure names the page, the line of the block's opening fence and the
traceback, whose line numbers are the page's own.

**The fence convention.** A python block whose fence carries one of these titles is only compiled
(``compile(source, page, "exec")``), never run; mkdocs-material shows the title above the block, so the reader sees
it too:

* ```` ```python title="excerpt" ```` : a fragment that uses names the page does not define (your model, your data);
* ```` ```python title="needs a GPU" ```` : a complete snippet that needs a CUDA device;
* ```` ```python title="needs several processes" ```` : a complete snippet that launches or needs several processes.

Any other title (say ``title="train.py"``) is just a label and the block runs. A title that looks like a marker but
is not one of the three exactly (``Excerpt``, ``needs GPU``) is an error. Keep runnable snippets fast: tiny models,
tiny data, a few steps (a snippet that trains should take seconds on a CPU); say in the prose to raise
``max_steps`` for a real run.

**```bash / ```shell / ```sh / ```console blocks.** Every command on a page (comments dropped, ``\\`` continuations
joined, ``&&`` chains split; in ``console`` blocks the lines starting with ``$``) must be a key of ``SHELL_COMMANDS``
below, which says how a test runs or checks it in a short form, and every key must still be on some page: a new or
changed command fails ``test_every_shell_command_is_in_the_table`` until the table says how to check it. The kinds:

* ``Covered(test)``: run, shortened, by another test (``tests/test_examples.py``, ``tests/test_compare.py``), checked
  to exist and to name the script and config; not run a second time here;
* ``RunExample(...)``: run in-process, through the example's own entry point, with the page's arguments plus
  overrides that shorten it to a couple of steps, then the settings the flags ask for are checked;
* ``Pip()``: ``pip install`` lines are checked, never run (no network, and an unpinned torch must never be
  installed): pip's own parser accepts the options; a pinned requirement (``torch==2.13.0``) is satisfied by the
  installed version and allowed by ``pyproject.toml``; a bare name is a dependency of the project; a local project
  (``-e ".[test,docs]"``) has a ``pyproject.toml``, every extra named exists there, and the requirements of those
  extras are satisfied in this environment. Whether an index URL answers is not checked;
* ``Help(...)``: scripts too slow to run in a test (the benchmarks): the script runs with ``--help`` and every flag
  the page uses must be in its help;
* ``TensorBoardFlags()``: the ``tensorboard`` command line is parsed by TensorBoard itself (no server is started);
* ``Self()``: the command that runs this test suite.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "examples" / "README.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda p: p.relative_to(ROOT).as_posix(),
)
COMPILE_ONLY_TITLES = ("excerpt", "needs a GPU", "needs several processes")
PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"bash", "shell", "sh", "console"}
PAGE_TIMEOUT_S = 240


# ------------------------------------------------------------------------------------------- extraction
@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    title: str | None
    code: str


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_TITLE = re.compile(r"""\btitle=(?:"([^"]*)"|'([^']*)')""")


def extract_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown page, with its indentation removed."""
    return parse_blocks(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())


def parse_blocks(text: str, page: str) -> list[Block]:
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match or (match["fence"][0] == "`" and "`" in match["info"]):
            i += 1
            continue
        indent, fence, info = len(match["indent"]), match["fence"], match["info"].strip()
        lang = info.split()[0].lstrip("{.").rstrip("}").lower() if info else ""
        title = _TITLE.search(info)
        body, j = [], i + 1
        while j < len(lines):
            close = _FENCE.match(lines[j])
            if (
                close
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"].strip()
            ):
                break
            text = lines[j]
            body.append(text[indent:] if text[:indent].strip() == "" else text.lstrip())
            j += 1
        blocks.append(Block(page, i + 1, lang, (title[1] or title[2]) if title else None, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    return [b for b in extract_blocks(path) if b.lang in PYTHON_LANGS]


def runs(block: Block) -> bool:
    return block.title not in COMPILE_ONLY_TITLES


def shell_commands(block: Block) -> list[str]:
    """The commands of a shell block, normalised: shell words joined by single spaces, quotes removed."""
    text = block.code
    if block.lang == "console":
        text = "\n".join(line.lstrip()[1:].lstrip() for line in text.splitlines() if line.lstrip().startswith("$"))
    text = re.sub(r"\\\n", " ", text)
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in [*words, "&&"]:
            if word == "&&":
                if current:
                    commands.append(" ".join(current))
                current = []
            else:
                current.append(word)
    return commands


def all_shell_commands() -> dict[str, list[str]]:
    """command -> the places (page:line) that show it."""
    found: dict[str, list[str]] = {}
    for path in PAGES:
        for block in extract_blocks(path):
            if block.lang in SHELL_LANGS:
                for command in shell_commands(block):
                    found.setdefault(command, []).append(f"{block.page}:{block.line}")
    return found


# ------------------------------------------------------------------------------------- python blocks
def test_fence_titles_follow_the_convention():
    bad = []
    for path in PAGES:
        for block in python_blocks(path):
            title = block.title
            if title and title not in COMPILE_ONLY_TITLES and re.match(r"(?i)\s*(excerpt|needs)", title):
                bad.append(f"{block.page}:{block.line}: title={title!r}; the markers are {COMPILE_ONLY_TITLES}")
    assert not bad, "\n".join(bad)


def test_the_extractor_finds_indented_and_titled_blocks():
    text = (
        "1. A list item:\n   ```python\n   import torch\n   if True:\n       x = 1\n   ```\n"
        '!!! note\n    ```python title="excerpt"\n    model.fit()\n    ```\n'
        "````markdown\n```bash\nnot a block of its own\n```\n````\n"
        "```bash\npip install -e . \\\n  --no-deps  # comment\necho 'a && b' && ls\n```\n"
    )
    first, second, outer, shell = parse_blocks(text, "page.md")
    assert (first.line, first.lang, first.title, first.code) == (
        2,
        "python",
        None,
        "import torch\nif True:\n    x = 1\n",
    )
    assert (second.line, second.title, second.code) == (8, "excerpt", "model.fit()\n")
    assert outer.lang == "markdown" and "not a block" in outer.code
    assert shell_commands(shell) == ["pip install -e . --no-deps", "echo a && b", "ls"]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_compile_only_blocks_compile(path):
    for block in python_blocks(path):
        if not runs(block):
            try:
                compile("\n" * block.line + block.code, str(path), "exec")
            except SyntaxError as error:
                pytest.fail(f"{block.page}:{block.line} ({block.title}) does not compile: {error}")


RUN_PAGES = [p for p in PAGES if any(runs(b) for b in python_blocks(p))]


def _runner_env() -> dict[str, str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg"}
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads make a busy 2-core machine crawl
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _pages_run(work: Path) -> dict:
    """The runner's command on a spec of every page's python blocks (one forked process per page)."""
    spec = []
    for path in RUN_PAGES:
        page = path.relative_to(ROOT).as_posix()
        blocks = [{"line": b.line, "code": b.code} for b in python_blocks(path) if runs(b)]
        workdir = work / page.replace("/", "__")
        spec.append({"page": page, "path": str(path), "workdir": str(workdir), "blocks": blocks})
    (work / "spec.json").write_text(json.dumps(spec))
    args = [sys.executable, __file__, str(work / "spec.json")]
    return {"args": args, "cwd": work, "env": _runner_env(), "timeout": PAGE_TIMEOUT_S * len(spec) + 60}


# started when collection ends and run while other tests run (tests/conftest.py, "subprocesses started early")
EARLY_RUNS = {"page_results": _pages_run}


@pytest.fixture(scope="module")
def page_results(early_runs) -> dict[str, dict]:
    """Runs every page's python blocks (one forked process per page) and returns each page's result."""
    proc = early_runs.result(__name__, "page_results")
    spec = json.loads((proc.workdir / "spec.json").read_text())
    results = {}
    for entry in spec:
        result = Path(entry["workdir"]) / "result.json"
        if result.exists():
            results[entry["page"]] = json.loads(result.read_text())
    if proc.returncode != 0 or len(results) != len(spec):
        results["_runner"] = {
            "returncode": proc.returncode,
            "stdout": proc.stdout[-3000:],
            "stderr": proc.stderr[-5000:],
        }
    return results


@pytest.mark.parametrize("path", RUN_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(path, page_results):
    page = path.relative_to(ROOT).as_posix()
    result = page_results.get(page)
    assert result is not None, f"{page}: no result from the runner: {page_results.get('_runner')}"
    for block in result["blocks"]:
        if not block["ok"]:
            output = result.get("output_tail", "")
            pytest.fail(
                f"{page}:{block['line']}: the python block starting at line {block['line']} failed "
                f"(blocks run in order, one namespace per page):\n{block['error']}\n--- output (tail) ---\n{output}",
                pytrace=False,
            )
    expected = [b.line for b in python_blocks(path) if runs(b)]
    assert [b["line"] for b in result["blocks"]] == expected, result.get("output_tail", "")


def _run_pages(spec_path: str) -> None:
    """The runner (this file run as a script): import once, then fork one process per page."""
    import lightning  # noqa: F401  (the imports every page starts with; paid once here)
    import torch  # noqa: F401

    import lightning_fp8  # noqa: F401

    for entry in json.loads(Path(spec_path).read_text()):
        workdir = Path(entry["workdir"])
        workdir.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the page's own process
            code = 1
            try:
                os.chdir(workdir)
                out = os.open(workdir / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(out, 1)
                os.dup2(out, 2)
                namespace: dict = {"__name__": "__main__"}
                blocks = []
                for block in entry["blocks"]:
                    start = time.perf_counter()
                    try:
                        # padded so that traceback line numbers are the page's own
                        code_object = compile("\n" * block["line"] + block["code"], entry["path"], "exec")
                        exec(code_object, namespace)  # noqa: S102  (running the page's code is the point)
                        blocks.append({"line": block["line"], "ok": True, "seconds": time.perf_counter() - start})
                    except BaseException:  # noqa: BLE001  (SystemExit too: a snippet must not exit)
                        error = traceback.format_exc()
                        blocks.append({"line": block["line"], "ok": False, "error": error})
                        break  # later blocks build on this one
                sys.stdout.flush()
                sys.stderr.flush()
                tail = (workdir / "output.txt").read_text(errors="replace")[-3000:]
                (workdir / "result.json").write_text(json.dumps({"blocks": blocks, "output_tail": tail}))
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                error = f"timed out after {PAGE_TIMEOUT_S} s"
                (workdir / "result.json").write_text(
                    json.dumps({"blocks": [{"line": 0, "ok": False, "error": error}], "output_tail": ""})
                )
                break
            time.sleep(0.05)
        print(f"{entry['page']}: done", flush=True)


# -------------------------------------------------------------------------------------- shell commands
def _example(name: str, relpath: str):
    from test_examples import load_example  # the same loader the examples' tests use

    return load_example(ROOT / relpath, name)


def _in_root(words: list[str]) -> list[str]:
    """Paths as the page writes them are relative to the repository root; the test runs elsewhere."""
    return [str(ROOT / w) if w.startswith(("examples/", "benchmarks/")) and (ROOT / w).exists() else w for w in words]


@dataclasses.dataclass(frozen=True)
class Covered:
    """Run (shortened) by another test, ``"test_file.py::test_name"``: checked to exist and to name what the command
    runs (read from its source, not imported). A test that reads a run started early (tests/conftest.py) names it in
    the builder its module's ``EARLY_RUNS`` gives for one of the test's fixtures: that builder's source counts too."""

    test: str
    names: tuple[str, ...]

    def check(self, command: str, tmp_path: Path, monkeypatch) -> None:
        import ast

        filename, _, function = self.test.partition("::")
        source = (ROOT / "tests" / filename).read_text()
        tree = ast.parse(source)
        (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
        body = ast.get_source_segment(source, node)
        early = [n.value for n in tree.body if isinstance(n, ast.Assign) and "EARLY_RUNS" in ast.unparse(n.targets[0])]
        fixtures = {a.arg for a in node.args.args}
        for key, value in zip(early[0].keys, early[0].values) if early else ():
            if isinstance(key, ast.Constant) and key.value in fixtures and isinstance(value, ast.Name):
                (builder,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == value.id]
                body += "\n" + ast.get_source_segment(source, builder)
        for name in self.names:
            assert name in body, f"tests/{self.test} no longer mentions {name!r}"


# Shortens an fp8_lm run to 2 steps, with one validation batch.
FP8_LM_SHORT = [
    "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
    "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false", "--data.val_windows", "32",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RunExample:
    """``python examples/fp8_lm/train.py ARGS`` run in-process as ``main(ARGS + FP8_LM_SHORT)``; ``script`` replaces
    a placeholder script name of the page (``main.py``)."""

    expect: Callable
    script: str | None = None

    def check(self, command: str, tmp_path: Path, monkeypatch) -> None:
        words = command.split(" ")
        assert words[0] == "python"
        script = words[1] if self.script is None else self.script
        assert script == "examples/fp8_lm/train.py", script
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", ["train.py"])
        lm = _example("fp8_lm_train", script)
        cli = lm.main(_in_root(words[2:]) + FP8_LM_SHORT)
        assert cli.trainer.global_step == 2
        self.expect(cli)


def _fp8(cli):
    import lightning_fp8 as lf

    (stats,) = [c for c in cli.trainer.callbacks if isinstance(c, lf.FP8StatsCallback)]
    assert isinstance(cli.trainer.precision_plugin, lf.FP8Precision)
    return cli.trainer.precision_plugin, stats


def _expect_flags_on_bf16_config(cli):
    import torch

    plugin, stats = _fp8(cli)
    assert plugin.recipe.name == "delayed" and plugin.recipe.amax_history_len == 16
    assert plugin.compute_dtype is torch.bfloat16 and stats.log_every_n_steps == 10
    assert Path(cli.trainer.logger.log_dir).parts[-2] == "fp8_flags"


def _expect_nested_flags(cli):
    import torch

    plugin, stats = _fp8(cli)
    assert plugin.recipe.name == "tensorwise" and plugin.compute_dtype is torch.float16
    assert stats.log_every_n_steps == 5


def _expect_main_py_flags(cli):
    import torch

    plugin, stats = _fp8(cli)
    assert plugin.recipe.name == "delayed" and plugin.compute_dtype is torch.bfloat16
    assert stats.log_every_n_steps == 10


@dataclasses.dataclass(frozen=True)
class Pip:
    """``pip install ...``: checked, never run (see the module docstring)."""

    def check(self, command: str, tmp_path: Path, monkeypatch) -> None:
        from packaging.requirements import Requirement
        from packaging.version import Version
        from pip._internal.commands import create_command

        words = command.split(" ")
        assert words[:2] == ["pip", "install"], command
        options, args = create_command("install").parse_args(words[2:])  # pip's own option parser
        if options.index_url != "https://pypi.org/simple":
            assert options.index_url.startswith("https://"), options.index_url
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            from pip._vendor import tomli as tomllib

        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        dependencies = {Requirement(r).name: Requirement(r) for r in pyproject["dependencies"]}
        for target in [*options.editables, *args]:
            path, _, extras = target.partition("[")
            if path.startswith((".", "/")):
                assert (ROOT / path / "pyproject.toml").is_file(), f"{target}: no pyproject.toml in {path}"
                assert options.editables == [target], f"{target}: the pages install the project editable"
                for extra in filter(None, extras.rstrip("]").split(",")):
                    available = pyproject["optional-dependencies"]
                    assert extra in available, f"extra {extra!r} is not in pyproject.toml: {sorted(available)}"
                    for requirement in map(Requirement, available[extra]):
                        installed = importlib.metadata.version(requirement.name)
                        assert requirement.specifier.contains(installed, prereleases=True), (requirement, installed)
                continue
            requirement = Requirement(target)
            assert requirement.name in dependencies, f"{requirement.name} is not a dependency of the project"
            if requirement.specifier:
                installed = Version(importlib.metadata.version(requirement.name)).public  # 2.13.0+cpu -> 2.13.0
                assert requirement.specifier.contains(installed), f"{target}: the tests run with {installed}"
                allowed = dependencies[requirement.name].specifier
                assert all(allowed.contains(s.version) for s in requirement.specifier), (target, str(allowed))


@dataclasses.dataclass(frozen=True)
class Help:
    """The script runs with ``--help`` (in-process) and knows every ``--flag`` the page gives it."""

    def check(self, command: str, tmp_path: Path, monkeypatch, capsys=None) -> None:
        import runpy

        words = command.split(" ")
        assert words[0] == "python"
        script = ROOT / words[1]
        monkeypatch.setattr(sys, "argv", [str(script), "--help"])
        monkeypatch.setattr(sys, "path", list(sys.path))
        monkeypatch.chdir(tmp_path)
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(script), run_name="__main__")
        assert exit_info.value.code in (0, None)
        out = capsys.readouterr().out
        for flag in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
            assert flag in out, f"{script.name} --help does not list {flag}"


@dataclasses.dataclass(frozen=True)
class TensorBoardFlags:
    def check(self, command: str, tmp_path: Path, monkeypatch) -> None:
        from tensorboard import program

        words = command.split(" ")
        assert words[0] == "tensorboard"
        program.TensorBoard().configure(argv=[None, *words[1:]])  # parses and validates; starts nothing


@dataclasses.dataclass(frozen=True)
class Self:
    def check(self, command: str, tmp_path: Path, monkeypatch) -> None:
        words = command.split(" ")
        assert words[:3] == ["python", "-m", "pytest"] and (ROOT / words[3]).is_dir()
        assert Path(__file__).resolve().parent == ROOT / words[3]


FP8_LM = "python examples/fp8_lm/train.py"
SHELL_COMMANDS: dict[str, object] = {
    # installation
    "pip install torch==2.13.0": Pip(),
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": Pip(),
    "pip install torch": Pip(),
    "pip install -e .": Pip(),
    "pip install -e .[examples]": Pip(),
    "pip install -e .[test,docs]": Pip(),
    "python -m pytest tests -q": Self(),
    # the LightningCLI example
    f"{FP8_LM} fit --config examples/fp8_lm/configs/cpu.yaml": Covered(
        "test_examples.py::test_headline_example_runs_end_to_end", ("train.py", "cpu.yaml")
    ),
    f"{FP8_LM} fit --config examples/fp8_lm/configs/bf16.yaml": Covered(
        "test_examples.py::test_bf16_config_runs", ("bf16.yaml",)
    ),
    "tensorboard --logdir lightning_logs": TensorBoardFlags(),
    f"{FP8_LM} fit --config examples/fp8_lm/configs/bf16.yaml --trainer.precision null --trainer.logger.name fp8_flags"
    " --trainer.plugins lightning_fp8.FP8Precision --trainer.plugins.recipe delayed --trainer.plugins.amax_history_len"
    " 16 --trainer.callbacks lightning_fp8.FP8StatsCallback --trainer.callbacks.log_every_n_steps 10": RunExample(
        _expect_flags_on_bf16_config
    ),
    f"{FP8_LM} fit --config examples/fp8_lm/configs/cpu.yaml --trainer.plugins.recipe tensorwise"
    " --trainer.plugins.compute_dtype torch.float16 --trainer.callbacks.log_every_n_steps 5": RunExample(
        _expect_nested_flags
    ),
    # quickstart: main.py is "any script that calls LightningCLI"; the example's is one
    "python main.py fit --trainer.plugins=lightning_fp8.FP8Precision --trainer.plugins.recipe=delayed"
    " --trainer.plugins.compute_dtype=torch.bfloat16 --trainer.callbacks+=lightning_fp8.FP8StatsCallback"
    " --trainer.callbacks.log_every_n_steps=10": RunExample(_expect_main_py_flags, script="examples/fp8_lm/train.py"),
    # the Fabric example: test_examples runs it and resumes from the default checkpoint name
    "python examples/fabric_fp8.py": Covered(
        "test_examples.py::test_fabric_example_runs_and_resumes", ("fabric_fp8.py",)
    ),
    "python examples/fabric_fp8.py --steps 100 --resume fabric_fp8.ckpt": Covered(
        "test_examples.py::test_fabric_example_runs_and_resumes", ("fabric_fp8.py", '"--resume", "fabric_fp8.ckpt"')
    ),
    # the FSDP2 example (tests/test_fsdp2.py runs it with tensor parallelism, a few steps)
    "python examples/fsdp2_fp8.py": Covered("test_fsdp2.py::test_the_fsdp2_example_runs", ("fsdp2_fp8.py",)),
    "python examples/fsdp2_fp8.py --tensor-parallel 2": Covered(
        "test_fsdp2.py::test_the_fsdp2_example_runs", ("fsdp2_fp8.py", '"--tensor-parallel", "2"')
    ),
    # docs/distributed.md: consolidating a ModelParallelStrategy checkpoint folder (run by tests/test_fsdp2.py)
    "python -m lightning.fabric.utilities.consolidate_checkpoint epoch1.ckpt --output_file epoch1.consolidated.ckpt": Covered(
        "test_fsdp2.py::test_trainer_fsdp2_checkpoint_consolidates_into_an_unconverted_model",
        ("lightning.fabric.utilities.consolidate_checkpoint", "--output_file"),
    ),
    # docs/compare.md: run on the example (gpu.yaml shrunk, 3 steps) by tests/test_compare.py
    "python -m lightning_fp8.compare --config examples/fp8_lm/configs/cpu.yaml --model-class"
    " examples/fp8_lm/train.py:ByteTransformerLM --data-class examples/fp8_lm/train.py:StdlibBytes --recipes"
    " tensorwise delayed rowwise --steps 30 --warmup 5 --out fp8_compare": Covered(
        "test_compare.py::test_command_line_on_the_example_config",
        ("lightning_fp8.compare", "ByteTransformerLM", "StdlibBytes", "--recipes", "--steps", "--warmup", "--out"),
    ),
    # benchmarks: minutes even with --quick
    "python benchmarks/bench_linear.py": Help(),
    "python benchmarks/bench_linear.py --quick": Help(),
    "python benchmarks/bench_linear.py --small": Help(),
    "python benchmarks/bench_compare.py": Help(),
    "python benchmarks/bench_fsdp2.py": Help(),
    # docs/benchmarks.md, "Llama-style blocks" (tests/test_bench_llama.py runs its measurement code on a tiny size)
    "python benchmarks/bench_llama.py --threads 1 --cold-compile": Help(),
    "python benchmarks/bench_llama.py --large": Help(),
    "python benchmarks/bench_llama.py --no-compile": Help(),
    "python benchmarks/bench_convergence.py": Help(),
    "python benchmarks/bench_convergence.py --recipes blockwise,mxfp8": Help(),
    # its --check mode runs in tests/test_doc_numbers.py
    "python benchmarks/docs_tables.py": Help(),
}


def test_every_shell_command_is_in_the_table():
    found = all_shell_commands()
    missing = {c: where for c, where in found.items() if c not in SHELL_COMMANDS}
    unused = [c for c in SHELL_COMMANDS if c not in found]
    message = []
    if missing:
        message.append("commands on the pages that SHELL_COMMANDS does not say how to check:")
        message += [f"  {where}: {c!r}" for c, where in missing.items()]
    if unused:
        message.append("SHELL_COMMANDS entries no page shows any more (remove or update them):")
        message += [f"  {c!r}" for c in unused]
    assert not message, "\n".join(message)


@pytest.mark.parametrize("command", list(SHELL_COMMANDS))
def test_shell_command(command, tmp_path, monkeypatch, capsys):
    check = SHELL_COMMANDS[command]
    if isinstance(check, Help):
        check.check(command, tmp_path, monkeypatch, capsys)
    else:
        check.check(command, tmp_path, monkeypatch)


if __name__ == "__main__":
    _run_pages(sys.argv[1])
