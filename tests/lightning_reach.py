"""Which test modules reach Lightning, read from their source: the second stage of ``.ci/run`` (the suite on
Lightning's oldest supported release) runs only those, with ``pytest --lightning-facing``.

Why: that stage exists because lightning-fp8 reaches into Lightning's strategies, loops, loggers and CLI, whose
signatures change between releases. About three fifths of the suite's time go to tests of the FP8 core alone (casts,
GEMMs, compiled graphs: ``lightning_fp8.quantize``, ``linear``, ``gemm``, ...), which run no Lightning code and
ran identically in both stages; the real CI took 4090 s of its 90 minutes on a slow machine with both stages whole.

A test module reaches Lightning when it uses something that imports Lightning. Read with ``ast``, without running
anything, and counting what it cannot follow (a wrong "Lightning-free" silently drops tests from that stage; a
wrong "reaches" only costs time):

* a name bound by an ``import`` of ``lightning``, ``pytorch_lightning`` or ``lightning_fabric`` (anywhere in the
  file: a function's local import too; a star import of one counts the module whole);
* a ``lightning_fp8`` module that imports Lightning, itself or through the package modules it imports (a fixpoint
  over the package's import graph: ``calibration``, ``precision``, ``callbacks``, ... do; ``quantize``, ``linear``,
  ``gemm``, ``state`` do not), imported directly, as a name of the package (resolved through
  ``lightning_fp8/__init__.py`` to the submodule it comes from), or read as an attribute of the imported package
  (``lf.fabric.FP8Precision``, ``lf.calibrate``; ``lf.__version__`` is the package's own); the package itself
  passed around bare counts;
* a top-level name of a module of ``tests/`` or ``benchmarks/`` (imported by bare name or as ``tests.x`` /
  ``benchmarks.x``) whose definition uses any of these (``utils.make_trainer`` does, ``utils.reference_amax_bins``
  does not), or uses another such name; definitions inside top-level ``if`` / ``try`` / ``with`` blocks count,
  a ``__main__`` block does not (importing does not run it); a statement that changes a name in place
  (``RENDERERS.update(...)``) is part of its definition; other top-level code that reaches Lightning counts the
  module whole. Solved over all those modules at once (the least fixpoint: helpers that import each other get one
  answer). Names are not scoped: a function's local variable named like a top-level name that reaches counts;
* a fixture of ``tests/conftest.py`` that reaches Lightning, requested as a test's parameter;
* what this cannot follow: a child Python process (``sys.executable``, a command list starting with ``"python"``
  or ``"torchrun"``, ``torch.multiprocessing.spawn``), a module run or imported by name (``runpy``,
  ``importlib.import_module``, ``spec_from_file_location``, ``__import__``, ``pytest.importorskip``), the 2-process
  ``gloo_runs`` checks.

Not seen: fixtures of other plugins (``pytest_plugins``), a command line for a shell in one string, modules of
``examples/`` imported through ``sys.path``. The cross-check in ``tests/test_lightning_reach.py`` (every module whose
code names a Trainer, a Fabric, a LightningModule, ... counts) guards the common cases independently.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "lightning_fp8"
LIGHTNING_ROOTS = frozenset({"lightning", "pytorch_lightning", "lightning_fabric"})
#: folders of the local modules a test or benchmark imports by bare name (both put themselves on ``sys.path``)
LOCAL_DIRS = (REPO / "tests", REPO / "benchmarks")
#: names whose use means a process or an import this cannot follow
OPAQUE_NAMES = frozenset(
    {
        "executable",  # sys.executable: a child Python
        "spawn",  # torch.multiprocessing.spawn, start_processes
        "start_processes",
        "run_path",  # runpy
        "run_module",
        "import_module",  # importlib
        "spec_from_file_location",
        "exec_module",
        "__import__",
        "importorskip",  # pytest.importorskip: an import by name
        "gloo_runs",  # the 2-process checks of tests/scripts/gloo_checks.py
        "gloo",
    }
)
#: commands that run Python: a child process started with one may run Lightning (see :func:`_runs_python`)
CHILD_COMMANDS = frozenset({"python", "python3", "torchrun"})
#: whether a name bound by an import reaches Lightning: every use of it (True), none (False), or, for a module,
#: the attributes read of it: a function of the attribute's name
Binding = bool | functools.partial


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _package_file(module: str) -> Path | None:
    """The file of ``lightning_fp8`` or one of its submodules (``lightning_fp8.x``), if there is one."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _local_file(module: str) -> Path | None:
    """The file of a module of ``tests/`` or ``benchmarks/``, imported by bare name (``utils``) or through its folder
    (``tests.utils``, ``benchmarks.harness``)."""
    parts = module.split(".")
    for folder in LOCAL_DIRS:
        if len(parts) == 2 and parts[0] == folder.name and (folder / f"{parts[1]}.py").is_file():
            return folder / f"{parts[1]}.py"
        if len(parts) == 1 and (folder / f"{module}.py").is_file():
            return folder / f"{module}.py"
    return None


@functools.cache
def _package_names() -> dict[str, str]:
    """``lightning_fp8``'s names: the submodule ``__init__.py`` imports each from (``__init__`` itself for a constant
    it assigns, ``__version__``)."""
    names = {}
    tree = _tree(REPO / PACKAGE / "__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"{PACKAGE}."):
            for alias in node.names:
                names[alias.asname or alias.name] = node.module
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names.update((t.id, f"{PACKAGE}.__init__") for t in node.targets if isinstance(t, ast.Name))
    return names


def _package_member(name: str) -> str:
    """The module ``lightning_fp8.<name>`` comes from: the submodule of that name, else the one that defines it
    (else the package itself, which imports Lightning)."""
    submodule = f"{PACKAGE}.{name}"
    return submodule if _package_file(submodule) else _package_names().get(name, PACKAGE)


@functools.cache
def _package_reaching() -> frozenset[str]:
    """The ``lightning_fp8`` modules that import Lightning, themselves or through the package modules they import."""
    imports: dict[str, set[str]] = {}
    reaching = set()
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        imports[module] = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:  # relative: from the package (its modules use absolute imports today)
                    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    source = ".".join(package + ([source] if source else []))
                names = [source]
                if source == PACKAGE:
                    names = [_package_member(a.name) for a in node.names]
                elif not source.startswith(PACKAGE) and node.level:
                    names = [PACKAGE]  # above the package: count it
            else:
                continue
            if any(name.split(".")[0] in LIGHTNING_ROOTS for name in names):
                reaching.add(module)
            imports[module] |= {name for name in names if _package_file(name) is not None}
    while more := {m for m, edges in imports.items() if m not in reaching and edges & reaching}:
        reaching |= more
    return frozenset(reaching)


#: attributes of the package that are its own, not a submodule's (``lf.__version__``); ``__dict__`` and the like count
_OWN_DUNDERS = frozenset({"__file__", "__version__", "__name__", "__doc__", "__path__", "__spec__"})


def _package_attribute(module: str, attribute: str) -> bool:
    """Whether ``<module>.<attribute>`` reaches Lightning, ``module`` a ``lightning_fp8`` module."""
    if module == PACKAGE:
        return attribute not in _OWN_DUNDERS and _package_member(attribute) in _package_reaching()
    return module in _package_reaching()


def _local_attribute(path: Path, attribute: str) -> bool:
    reaching = _local_reaching(path)
    return "*" in reaching or attribute in reaching


def _bindings(node: ast.Import | ast.ImportFrom) -> dict[str, Binding]:
    """The names one import statement binds, and whether each reaches Lightning (see :data:`Binding`); a star import
    binds ``"*"``."""
    bound: dict[str, Binding] = {}
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.asname or alias.name.split(".")[0]
            if alias.name.split(".")[0] in LIGHTNING_ROOTS:
                bound[name] = True
            elif alias.name.split(".")[0] == PACKAGE:
                if alias.asname and alias.name != PACKAGE:  # ``import lightning_fp8.x as y``: that module
                    bound[name] = alias.name in _package_reaching()
                else:  # ``import lightning_fp8.x`` binds the package: what reaches is the attributes read of it
                    bound[name] = functools.partial(_package_attribute, PACKAGE)
            elif (local := _local_file(alias.name)) is not None:
                bound[name] = functools.partial(_local_attribute, local)
        return bound
    module = node.module or ""
    for alias in node.names:
        name = alias.asname or alias.name
        if node.level or module.split(".")[0] in LIGHTNING_ROOTS:
            bound[name] = True  # Lightning, or a relative import (not followed: tests and benchmarks have none)
        elif module == PACKAGE:
            bound[name] = _package_member(alias.name) in _package_reaching()
        elif _package_file(module) is not None:
            bound[name] = module in _package_reaching()
        elif (local := _local_file(f"{module}.{alias.name}")) is not None:  # ``from benchmarks import harness``
            bound[name] = functools.partial(_local_attribute, local)
        elif (local := _local_file(module)) is not None:
            bound[name] = alias.name == "*" or _local_attribute(local, alias.name)
    return bound


def _runs_python(node: ast.AST) -> bool:
    """A command list that starts with Python: ``["python", "train.py"]``, ``("torchrun", ...)``. (A command line in
    one string, for a shell, is not recognised: it reads like the text of a message; the suite's children start
    with ``sys.executable``.)"""
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
        first = node.elts[0]
        return isinstance(first, ast.Constant) and first.value in CHILD_COMMANDS
    return False


def _uses(node: ast.AST, bindings: dict[str, Binding]) -> bool:
    """Whether ``node`` (its own imports included) uses a binding that reaches Lightning, a fixture of
    ``tests/conftest.py`` that does, or does what this cannot follow."""
    bindings = dict(bindings)
    for child in ast.walk(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            bound = _bindings(child)
            if any(b is True for b in bound.values()):
                return True  # imported here: counted whether or not the name is used
            bindings.update(bound)
    if bindings.get("*", False) is not False:
        return True  # a star import of something that reaches Lightning: any name may be one of its
    parents = {child: parent for parent in ast.walk(node) for child in ast.iter_child_nodes(parent)}
    conftest = _CONFTEST if _CONFTEST in _REACHING else None
    for child in ast.walk(node):
        if isinstance(child, ast.Attribute) and child.attr in OPAQUE_NAMES:
            return True
        if isinstance(child, ast.alias) and child.name.split(".")[-1] in OPAQUE_NAMES | {"runpy"}:
            return True
        if _runs_python(child):
            return True
        if isinstance(child, ast.arg) and conftest is not None and child.arg in _REACHING[conftest]:
            return True  # a fixture of conftest.py, requested by name
        if not isinstance(child, ast.Name):
            continue
        if child.id in OPAQUE_NAMES:
            return True
        binding = bindings.get(child.id, False)
        if binding is True:
            return True
        if binding is not False:
            parent = parents.get(child)
            if not (isinstance(parent, ast.Attribute) and parent.value is child):
                return True  # a module passed around bare
            if binding(parent.attr):
                return True
    return False


def _is_main_block(statement: ast.stmt) -> bool:
    """``if __name__ == "__main__":``: a script's body, which importing the module does not run."""
    test = getattr(statement, "test", None)
    return (
        isinstance(statement, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _top_level(statements: list[ast.stmt]) -> tuple[list[ast.stmt], list[ast.AST]]:
    """A module's top-level statements, those in ``if`` / ``try`` / ``with`` / ``for`` blocks included (not a
    ``__main__`` block): the simple statements, and the blocks' own expressions."""
    found: list[ast.stmt] = []
    headers: list[ast.AST] = []
    for statement in statements:
        if _is_main_block(statement):
            continue
        if isinstance(statement, (ast.If, ast.Try, ast.With, ast.For, ast.While)) or type(statement).__name__ in (
            "TryStar",
            "Match",
        ):
            for field in ("test", "iter", "target", "items", "subject"):
                if (value := getattr(statement, field, None)) is not None:
                    headers.extend(value if isinstance(value, list) else [value])
            blocks = [getattr(statement, field, []) for field in ("body", "orelse", "finalbody")]
            blocks += [handler.body for handler in getattr(statement, "handlers", [])]
            blocks += [case.body for case in getattr(statement, "cases", [])]
            for block in blocks:
                more, more_headers = _top_level(block)
                found += more
                headers += more_headers
        else:
            found.append(statement)
    return found, headers


def _assigned(statement: ast.stmt) -> list[str]:
    """The names an assignment statement binds (its targets', not a comprehension's inside it)."""
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        targets = [statement.target]
    else:
        return []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]


def _changed(node: ast.AST) -> str | None:
    """The name a statement changes in place: ``X.update(...)``, ``X[k] = ...``, ``X.attribute = ...``."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        target = node.value.func
        if not isinstance(target, ast.Attribute):
            return None
        target = target.value
    elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if len(targets) != 1:
            return None
        target = targets[0]
    else:
        return None
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        target = target.value
    return target.id if isinstance(target, ast.Name) else None


def _definitions_reaching(path: Path) -> frozenset[str]:
    """One pass over a local module, the others' reaching names as :data:`_REACHING` has them now.

    A top-level statement that changes a definition in place (``RENDERERS.update(...)``, ``TABLE[k] = ...``) counts
    as part of it; any other that reaches Lightning makes the whole module count (it runs on import)."""
    statements, rest = _top_level(_tree(path).body)
    definitions: dict[str, list[ast.AST]] = {}
    bindings: dict[str, Binding] = {}
    for statement in statements:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            definitions.setdefault(statement.name, []).append(statement)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            bindings.update(_bindings(statement))
        elif names := _assigned(statement):
            for name in names:
                definitions.setdefault(name, []).append(statement)
        else:
            rest.append(statement)
    for node in rest:
        if (changed := _changed(node)) in definitions:
            definitions[changed].append(node)
        elif _uses(node, bindings):
            return frozenset([*definitions, "*"])
    if bindings.get("*", False) is not False:
        return frozenset([*definitions, "*"])  # a star import of something that reaches Lightning
    reaching: set[str] = set()
    while True:  # a definition that uses one that reaches Lightning reaches it too
        bindings.update(dict.fromkeys(reaching, True))
        more = {
            name
            for name, nodes in definitions.items()
            if name not in reaching and any(_uses(node, bindings) for node in nodes)
        }
        if not more:
            return frozenset(reaching)
        reaching |= more


#: the local modules' reaching names (``tests/`` and ``benchmarks/``): the least fixpoint, solved over all of them at
#: once, so that modules importing each other in a cycle get the same answer whichever is asked first
_REACHING: dict[Path, frozenset[str]] = {}
_CONFTEST = REPO / "tests" / "conftest.py"


def _local_modules() -> list[Path]:
    return sorted({path for folder in LOCAL_DIRS for path in folder.glob("*.py")})


def _solve() -> None:
    if _REACHING:
        return
    paths = _local_modules()
    _REACHING.update(dict.fromkeys(paths, frozenset()))
    while True:  # every pass reads the previous one's answers: they only grow, so this ends
        answers = {path: _definitions_reaching(path) for path in paths}
        if all(answers[path] == _REACHING[path] for path in paths):
            return
        _REACHING.update(answers)


def _local_reaching(path: Path) -> frozenset[str]:
    """The top-level names of a ``tests/`` or ``benchmarks/`` module that reach Lightning: every name and ``"*"`` if
    its top-level code does."""
    _solve()
    if path in _REACHING:
        return _REACHING[path]
    return _definitions_reaching(path)  # a module outside the local folders, which none of them imports


def reset() -> None:
    """Forget the solved answers (after the files or :data:`LOCAL_DIRS` changed)."""
    _REACHING.clear()
    _tree.cache_clear()
    _package_names.cache_clear()
    _package_reaching.cache_clear()


def reaches_lightning(path: str | Path) -> bool:
    """Whether the test module at ``path`` reaches Lightning (see the module's docstring)."""
    return bool(_local_reaching(Path(path).resolve()))
