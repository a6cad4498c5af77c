"""The package's shape stays as docs/architecture.md draws it: no import cycles, the CLI on top.

Walks ``captioner/`` with ``ast`` (function-level imports included, since a cycle hidden inside
a function is still a cycle) and checks the import graph between the package's own modules.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "captioner"
MAX_LINES = 800


@functools.lru_cache(maxsize=None)
def _parse(text: str, filename: str) -> ast.Module:
    """``ast.parse`` once per file content: every test below walks the same modules."""
    return ast.parse(text, filename)


def _modules(package: Path | None = None) -> dict[str, Path]:
    """``{dotted name: file}`` of every module under ``package`` (default :data:`PACKAGE`)."""
    package = package or PACKAGE
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted import name lands in (``a.b.c`` -> ``a.b`` when ``c`` is an attribute)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """``{module: {captioner modules it imports anywhere in its body}}``."""
    return {name: set(targets) for name, targets in _import_graph(PACKAGE).items()}


@functools.lru_cache(maxsize=None)
def _import_graph(package: Path) -> dict[str, set[str]]:
    modules = _modules(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(_parse(path.read_text(encoding="utf-8"), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                owner = _owner(target, modules)
                if owner and owner != name:
                    graph[name].add(owner)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_cycle_finder_sees_a_cycle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_function_level_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "captioner"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "one.py").write_text("def f():\n    from captioner.sub import two\n")
    (pkg / "sub" / "two.py").write_text("from .one import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    graph = import_graph()
    assert graph["captioner.sub.one"] == {"captioner.sub.two"}
    assert graph["captioner.sub.two"] == {"captioner.sub.one"}
    assert find_cycles(graph) == [["captioner.sub.one", "captioner.sub.two"]]


def test_the_package_has_no_import_cycle():
    assert find_cycles(import_graph()) == []


def test_only_the_cli_imports_the_commands():
    graph = import_graph()
    offenders = {name: sorted(t for t in targets if t.startswith("captioner.commands"))
                 for name, targets in graph.items()
                 if not name.startswith("captioner.commands") and name != "captioner.cli"}
    assert {k: v for k, v in offenders.items() if v} == {}


# the concept detectors and the label reading are model parts (captioner.models.concepts, .labels); the
# ``captioner concepts`` job, the run's hook and the loss terms are training (captioner.training.concepts)
LOWER = ("captioner.data", "captioner.models", "captioner.decoding", "captioner.checkpoint", "captioner.features")
UPPER = ("captioner.training", "captioner.evaluation", "captioner.demo", "captioner.viz", "captioner.commands",
         "captioner.inference")


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Modules of the lower layers that import an upper one: ``{module: [upper modules]}``."""
    bad = {name: sorted(t for t in targets if t.startswith(UPPER))
           for name, targets in graph.items() if name.startswith(LOWER)}
    return {k: v for k, v in bad.items() if v}


def test_lower_layers_do_not_import_training_inference_or_the_front_ends():
    assert upward_imports(import_graph()) == {}


def test_upward_import_check_sees_each_upper_layer():
    for upper in UPPER:
        for lower in LOWER:
            assert upward_imports({f"{lower}.x": {f"{upper}.y"}}) == {f"{lower}.x": [f"{upper}.y"]}
    assert upward_imports({"captioner.training.x": {"captioner.data.y"}, "captioner.data.y": set()}) == {}


PAPERS = ("captioner.models.base", "captioner.models.lstm", "captioner.models.transformer")


EXTENSIONS = ("captioner.models.concepts", "captioner.models.labels")


def test_the_papers_decoders_never_import_their_extensions():
    graph = import_graph()
    assert {name: sorted(t for t in graph[name] if t in EXTENSIONS) for name in PAPERS} == {name: [] for name in PAPERS}
    assert "captioner.models.concepts" in graph["captioner.models.model"]  # the registry builds the extension


def test_no_package_is_tied_both_ways_to_another():
    """Imports between the package's folders go one way: no folder imports one that imports it back."""
    graph = import_graph()
    folder = lambda name: ".".join(name.split(".")[:2])  # noqa: E731 - captioner.x
    edges = {(folder(a), folder(b)) for a, targets in graph.items() for b in targets
             if b.startswith("captioner.") and folder(a) != folder(b)}
    assert sorted((a, b) for a, b in edges if (b, a) in edges and a < b) == []


def test_the_papers_decoders_hardly_mention_concepts():
    text = "".join((PACKAGE / "models" / f"{name}.py").read_text(encoding="utf-8").lower()
                   for name in ("lstm", "transformer", "base"))
    assert text.count("concept") <= 3
    assert "__getattr__" not in (PACKAGE / "models" / "base.py").read_text(encoding="utf-8")


# Function-level imports of the package's own modules are allowed only in the command front ends
# (``captioner --help`` stays at about 0.2 s instead of the 2.3 s that importing every layer takes)
# and for the package's lazy top-level ``captioner.load``.
DEFERRED_OK = ("captioner.commands", "captioner.cli", "captioner")


def function_level_imports(package: Path) -> list[str]:
    """``module:line`` of each import of a ``captioner`` module inside a function body."""
    found = []
    for name, path in _modules(package).items():
        if name in DEFERRED_OK or name.startswith(DEFERRED_OK[0]):
            continue
        tree = _parse(path.read_text(encoding="utf-8"), str(path))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                         else ["captioner"] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "captioner" or n.startswith("captioner.") for n in names):
                    found.append(f"{name}:{node.lineno}")
    return sorted(set(found))


def test_imports_of_the_package_are_at_module_top():
    assert function_level_imports(PACKAGE) == []


def test_function_level_import_check_sees_one(tmp_path):
    pkg = tmp_path / "captioner"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "data" / "one.py").write_text("import json\n\ndef f():\n    import numpy\n    from captioner.data import two\n")
    (pkg / "data" / "two.py").write_text("def g():\n    from . import one\n")
    (pkg / "commands").mkdir()
    (pkg / "commands" / "run.py").write_text("def run():\n    from captioner.data import one\n")
    assert function_level_imports(pkg) == ["captioner.data.one:5", "captioner.data.two:2"]


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def _package_of(name: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package itself)."""
    return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(package: Path | None = None) -> list[str]:
    """``module:line name`` of each use of another package's ``_private`` name.

    Counts ``from captioner.x.y import _name`` and ``y._name`` on a module bound by an import. The
    modules of one package may share private helpers; a module of another package reaches only what
    a package makes public.
    """
    modules = _modules(package)
    found = []
    for name, path in modules.items():
        home = _package_of(name, modules)
        bound: dict[str, str] = {}  # local name -> captioner module it is bound to
        tree = _parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = home.split(".")[: len(home.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        bound[alias.asname or alias.name] = full
                    elif base in modules and _private(alias.name) and _package_of(base, modules) != home:
                        found.append(f"{name}:{node.lineno} {base}.{alias.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and _private(node.attr) and _package_of(bound[node.value.id], modules) != home):
                found.append(f"{name}:{node.lineno} {bound[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_no_module_uses_another_packages_private_names():
    assert private_imports() == []


def test_private_name_check_sees_imports_and_attributes(tmp_path):
    pkg = tmp_path / "captioner"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "one.py").write_text("_x = 1\n_y = 2\nz = 3\n")
    (pkg / "a" / "three.py").write_text("from captioner.a.one import _x\nfrom .one import _y\n")  # same package
    (pkg / "b" / "two.py").write_text("from captioner.a.one import _x, z\nfrom captioner.a import one\n"
                                      "import captioner.a.one as first\n\nprint(one._y, first._x, one.__name__)\n")
    assert private_imports(pkg) == ["captioner.b.two:1 captioner.a.one._x", "captioner.b.two:5 captioner.a.one._x",
                                    "captioner.b.two:5 captioner.a.one._y"]
