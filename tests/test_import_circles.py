"""No import circle in the package: every module's imports, read statically with ``ast``.

A circle (a imports b, b imports a, directly or through other modules) works only in one import
order, and hides two jobs that belong in one leaf module. Every ``import`` counts, also those
inside functions (a deferred import is still a dependency; it only moves the failure to the
first call), except under ``if TYPE_CHECKING:``. The torch and TensorFlow modules are read
like the core: nothing is imported, so no framework is needed.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "horovod_aq"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``__init__`` = package)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node of ``tree``, skipping ``if TYPE_CHECKING:`` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that module ``name`` imports: ``from X import n`` is module ``X.n``
    when that is a module, else ``X`` (its package ``__init__``)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = name.split(".")
            anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


#: Circles that main's entropy coder brought in (the dispatch of ``reference.decode`` /
#: ``fused.decode`` to the entropy modules, which use the fixed-width modules' helpers), left
#: to the codec's owner. Exactly these are tolerated: a new circle fails the test, and so does
#: breaking one of these without deleting its line here.
KNOWN_CIRCLES = [
    ["horovod_aq.codec.entropy", "horovod_aq.codec.reference"],
    ["horovod_aq.codec.fused", "horovod_aq.codec.fused_entropy"],
]


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    # the scan reads the framework modules too
    assert {"horovod_aq.torch.kernels", "horovod_aq.tensorflow.kernels",
            "horovod_aq.keras"} <= set(graph)
    assert circles(graph) == KNOWN_CIRCLES


def test_the_scan_finds_a_circle(tmp_path: Path) -> None:
    """The scanner itself: a deferred import that closes a circle is found, a TYPE_CHECKING
    import is not, relative imports resolve."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("from .b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from horovod_aq.sub import c\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from horovod_aq.sub import a\n"
        "def g():\n    from ..sub import a\n")
    (pkg / "leaf.py").write_text("from typing import TYPE_CHECKING\n"
                                 "if TYPE_CHECKING:\n    import horovod_aq.sub.a\n")
    graph = import_graph(pkg)
    assert graph["horovod_aq.sub"] == {"horovod_aq.sub.a"}
    assert graph["horovod_aq.sub.a"] == {"horovod_aq.sub.b"}
    assert graph["horovod_aq.leaf"] == set()
    assert circles(graph) == [["horovod_aq.sub.a", "horovod_aq.sub.b", "horovod_aq.sub.c"]]
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from horovod_aq.sub import a\n")
    assert circles(import_graph(pkg)) == []
