"""The project's import structure, read from the source (no module is imported):

- no import cycle among the `grpod.*` modules, counting every import a reader follows
  (module level, `TYPE_CHECKING` and function-level ones; a lazily exported package name
  counts as its defining module);
- only `forensics/` (and its tests) imports SQLAlchemy: everyone else asks `Store`;
- no private name (one leading underscore) crosses a package outside the tests;
- no file of `daemon/` (its subpackages included) is over 400 lines.

The layers themselves (what each package may import) are import-linter's contracts in
pyproject.toml, which `make lint` checks (scripts/lint_imports.py; docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", "var", "build", "dist", "node_modules", "__pycache__"}
SQL_PACKAGES = {"sqlalchemy", "alembic"}  # alembic is SQLAlchemy's migrations: forensics' too
SQL_ALLOWED = ("forensics", "tests/forensics")  # directories, relative to the root
DAEMON_MAX_LINES = 400  # STYLE.md: a file is a room a reader can hold


def package_dirs() -> dict[str, Path]:
    """`grpod.x` -> its directory, from pyproject.toml's setuptools package-dir mapping."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / where for name, where in config["package-dir"].items()}


def project_modules() -> dict[str, Path]:
    """Every `grpod.*` module name and its source file."""
    modules: dict[str, Path] = {}
    for package, directory in package_dirs().items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def python_files() -> Iterator[Path]:
    """Every Python file of the checkout (packages, tests, bench, scripts). Skipped folders are
    pruned before they are entered: `make test` builds `.venv-vllm` beside this test on a clean
    checkout, and a walk into it met files pip was removing (CI, stop 56)."""
    found = []
    for base, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        found += [Path(base, name) for name in names if name.endswith(".py")]
    yield from sorted(found)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, str]]:
    """`(module, name)` for each `from module import name`; `(module, "")` for `import module`
    and for literal `importlib.import_module("module")` calls."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ""
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield base, alias.name
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, ""


def lazy_exports(tree: ast.AST) -> dict[str, str]:
    """A package `__init__`'s `lazy_exports(__name__, {name: module})` table."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "lazy_exports"
            and len(node.args) == 2
            and isinstance(node.args[1], ast.Dict)
        ):
            return {k.value: v.value for k, v in zip(node.args[1].keys, node.args[1].values)}
    return {}


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = project_modules()
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules.items()}
    exports = {name: lazy_exports(tree) for name, tree in trees.items()}
    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        is_package = modules[name].name == "__init__.py"
        targets = set()
        for base, attr in imported_names(tree, name, is_package):
            full = f"{base}.{attr}" if attr else base
            if full in modules:
                targets.add(full)  # a module, or a submodule taken from its package
            elif attr in exports.get(base, {}):
                targets.add(exports[base][attr])  # a package's lazily exported name
            elif base in modules:
                targets.add(base)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_walk_sees_the_layering() -> None:
    """The graph is read right: real edges (module-level, lazy-export and function-level) are
    there, and nothing imports the daemon."""
    graph = import_graph()
    assert "grpod.engine.grpo.step" in graph["grpod.guards.drills"]  # TYPE_CHECKING
    assert (
        "grpod.engine.grpo.trainer" in graph["grpod.daemon.loop"]
    )  # `from grpod.engine import Engine`
    assert "grpod.forensics.store" in graph["grpod.daemon.commands.status"]  # in a function
    assert "grpod.base.fileio" in graph["grpod.engine.batch"]
    # two front ends run a training process: the daemon, and grpod.integrations (another
    # trainer's loop under grpod's guards, which uses the daemon's metrics, run dir and health
    # server); nothing else imports either, and only the CLI's replay reaches integrations
    front = ("grpod.daemon", "grpod.integrations")
    importers = [m for m, targets in graph.items() if not m.startswith(front)
                 and any(t.startswith("grpod.daemon") for t in targets)]  # fmt: skip
    assert importers == []
    users = {m for m, targets in graph.items() if not m.startswith("grpod.integrations")
             and any(t.startswith("grpod.integrations") for t in targets)}  # fmt: skip
    assert users <= {"grpod.daemon.commands.forensics"}, users


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    assert [sorted(c) for c in cycles(import_graph())] == []


def test_only_forensics_imports_sqlalchemy() -> None:
    offenders = []
    for path in python_files():
        where = path.relative_to(ROOT).as_posix()
        if any(where.startswith(f"{allowed}/") for allowed in SQL_ALLOWED):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for base, _ in imported_names(tree, "", False):
            if base.split(".")[0] in SQL_PACKAGES:
                offenders.append(f"{where}: {base}")
    assert offenders == []


def test_the_sqlalchemy_walk_sees_a_function_level_import(tmp_path: Path) -> None:
    tree = ast.parse("def f():\n    from sqlalchemy.orm import Session\n    import alembic\n")
    assert [b for b, _ in imported_names(tree, "", False)] == ["sqlalchemy.orm", "alembic"]


def module_package(name: str, modules: dict[str, Path]) -> str:
    """The package a project module belongs to (a package `__init__` is its own)."""
    return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]


def crossings_in(tree: ast.AST, where: str, mine: str, modules: dict[str, Path]) -> list[str]:
    """`where: module._name` for each private name (one leading underscore) the code of
    package `mine` takes from a module of another package: `from grpod.x import _name`, or
    `_name` read off a module imported from another package."""
    found = []
    bound: dict[str, str] = {}  # a local name -> the project module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module in modules:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    bound[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and module_package(node.module, modules) != mine:
                    found.append(f"{where}: {full}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and module_package(bound[node.value.id], modules) != mine
        ):
            found.append(f"{where}: {bound[node.value.id]}.{node.attr}")
    return found


def private_crossings() -> list[str]:
    """Every private name that crosses a package. Tests may reach into what they test; the
    packages, bench/ and scripts/ may not."""
    modules = project_modules()
    module_of = {path.resolve(): name for name, path in modules.items()}
    found = []
    for path in python_files():
        where = path.relative_to(ROOT).as_posix()
        if where.startswith("tests/"):
            continue
        me = module_of.get(path.resolve())
        mine = module_package(me, modules) if me else where.split("/")[0]
        found += crossings_in(ast.parse(path.read_text(), str(path)), where, mine, modules)
    return sorted(set(found))


def test_no_private_name_crosses_a_package() -> None:
    assert private_crossings() == []


def test_the_private_walk_sees_both_forms() -> None:
    """A `from` import of a private name and a private attribute of an imported module count
    across packages, and not inside one."""
    modules = project_modules()
    tree = ast.parse(
        "import grpod.engine.batch as b\n"
        "from grpod.forensics.step_replay import _x\n"
        "from grpod.engine import report\n"
        "b._y, report._z, b.__name__\n"
    )
    assert crossings_in(tree, "f", "grpod.guards", modules) == [
        "f: grpod.forensics.step_replay._x",
        "f: grpod.engine.batch._y",
        "f: grpod.engine.report._z",
    ]
    assert crossings_in(tree, "f", "grpod.engine", modules) == ["f: grpod.forensics.step_replay._x"]


def test_no_daemon_file_is_over_400_lines() -> None:
    """`daemon/` grew a 667-line loop once: its jobs are modules now, and stay so."""
    daemon = package_dirs()["grpod.daemon"]
    sizes = {
        p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
        for p in daemon.rglob("*.py")
    }
    assert {path: n for path, n in sizes.items() if n > DAEMON_MAX_LINES} == {}
    assert "daemon/loop.py" in sizes  # the walk sees the package
