"""Which test modules reach Lightning, read from their source: the second stage of ``.ci/run`` (the suite on
Lightning's oldest supported release) runs only those, with ``pytest --lightning-facing``.

Why: that stage exists because lightning-fp8 reaches into Lightning's strategies, loops, loggers and CLI, whose
signatures change between releases. More than half of the suite's time goes to tests of the FP8 core alone (casts,
GEMMs, compiled graphs: ``lightning_fp8.quantize``, ``linear``, ``gemm``, ...), which run no Lightning code and
ran identically in both stages; the real CI took 4090 s of its 90 minutes on a slow machine with both stages whole.

A test module reaches Lightning when it uses something that imports Lightning. Read with ``ast``, without running
anything, and counting what it cannot follow:

* a name bound by an ``import`` of ``lightning``, ``pytorch_lightning`` or ``lightning_fabric`` (anywhere in the
  file: a function's local import too);
* a ``lightning_fp8`` module that imports Lightning, itself or through the package modules it imports (a fixpoint
  over the package's import graph: ``calibration``, ``precision``, ``callbacks``, ... do; ``quantize``, ``linear``,
  ``gemm``, ``state`` do not), imported directly, as a name of the package (resolved through
  ``lightning_fp8/__init__.py`` to the submodule it comes from), or read as an attribute of the imported package
  (``lf.fabric.FP8Precision``, ``lf.calibrate``); the package itself passed around bare counts;
* a top-level definition of a module of ``tests/`` or ``benchmarks/`` that uses any of these (``utils.make_trainer``
  does, ``utils.reference_amax_bins`` does not), or another such definition, followed through those modules the
  same way; a module whose own top-level code uses one counts whole;
* what this cannot follow: a child Python process (``sys.executable``: the child may run Lightning), an import by
  name (``importlib.import_module``, ``__import__``), the 2-process ``gloo_runs`` checks.
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
OPAQUE_NAMES = frozenset({"executable", "import_module", "__import__", "gloo_runs", "gloo"})
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
    for folder in LOCAL_DIRS:
        if (folder / f"{module}.py").is_file():
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
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == PACKAGE:
                    names = [_package_member(a.name) for a in node.names]
            else:
                continue
            if any(name.split(".")[0] in LIGHTNING_ROOTS for name in names):
                reaching.add(module)
            imports[module] |= {name for name in names if _package_file(name) is not None}
    while more := {m for m, edges in imports.items() if m not in reaching and edges & reaching}:
        reaching |= more
    return frozenset(reaching)


def _package_attribute(module: str, attribute: str) -> bool:
    """Whether ``<module>.<attribute>`` reaches Lightning, ``module`` a ``lightning_fp8`` module."""
    if module == PACKAGE:
        if attribute.startswith("__") and attribute.endswith("__"):  # the module's own: __file__, __version__
            return False
        return _package_member(attribute) in _package_reaching()
    return module in _package_reaching()


def _local_attribute(path: Path, attribute: str) -> bool:
    reaching = _local_reaching(path)
    return "*" in reaching or attribute in reaching


def _bindings(node: ast.Import | ast.ImportFrom) -> dict[str, Binding]:
    """The names one import statement binds, and whether each reaches Lightning (see :data:`Binding`)."""
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
        elif (local := _local_file(module)) is not None:
            bound[name] = alias.name == "*" or _local_attribute(local, alias.name)
    return bound


def _uses(node: ast.AST, bindings: dict[str, Binding]) -> bool:
    """Whether ``node`` (its own imports included) uses a binding that reaches Lightning, or does what this cannot
    follow."""
    bindings = dict(bindings)
    for child in ast.walk(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            bindings.update(_bindings(child))
    parents = {child: parent for parent in ast.walk(node) for child in ast.iter_child_nodes(parent)}
    for child in ast.walk(node):
        if isinstance(child, ast.Attribute) and child.attr in OPAQUE_NAMES:
            return True
        if isinstance(child, (ast.Import, ast.ImportFrom)) and any(b is True for b in _bindings(child).values()):
            return True
        if isinstance(child, ast.alias) and child.name.split(".")[-1] in OPAQUE_NAMES:
            return True
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


_LOCAL_IN_PROGRESS: set[Path] = set()


@functools.cache
def _local_reaching(path: Path) -> frozenset[str]:
    """The top-level names of a ``tests/`` or ``benchmarks/`` module that reach Lightning: every name and ``"*"`` if
    its top-level code does (or if local modules import each other in a cycle)."""
    if path in _LOCAL_IN_PROGRESS:
        return frozenset(["*"])
    _LOCAL_IN_PROGRESS.add(path)
    try:
        tree = _tree(path)
        definitions: dict[str, ast.AST] = {}
        bindings: dict[str, Binding] = {}
        for statement in tree.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                definitions[statement.name] = statement
            elif isinstance(statement, ast.Assign) and all(isinstance(t, ast.Name) for t in statement.targets):
                definitions.update((target.id, statement.value) for target in statement.targets)
            elif isinstance(statement, (ast.Import, ast.ImportFrom)):
                bindings.update(_bindings(statement))
            elif _uses(statement, {}):
                return frozenset([*definitions, "*"])
        reaching = {name for name, node in definitions.items() if _uses(node, bindings)}
        while True:  # a definition that uses one that reaches Lightning reaches it too
            bindings.update(dict.fromkeys(reaching, True))
            more = {name for name, node in definitions.items() if name not in reaching and _uses(node, bindings)}
            if not more:
                return frozenset(reaching)
            reaching |= more
    finally:
        _LOCAL_IN_PROGRESS.discard(path)


def reaches_lightning(path: str | Path) -> bool:
    """Whether the test module at ``path`` reaches Lightning (see the module's docstring)."""
    return bool(_local_reaching(Path(path).resolve()))
