"""trainprobes.drift (the package): its modules import one another by full name, in one
direction, and through public names only."""
import ast
from pathlib import Path

import trainprobes.drift as drift

PACKAGE = "trainprobes.drift"
DIR = Path(drift.__file__).parent


def _imports(path: Path) -> list:
    """(module, names) for every import of trainprobes.drift or one of its modules."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith(PACKAGE)]
    return out


def test_no_module_imports_the_package_that_imports_it():
    for path in DIR.glob("*.py"):
        if path.name != "__init__.py":
            assert all(mod != PACKAGE for mod, _ in _imports(path)), path.name


def test_no_private_name_crosses_modules():
    modules = {p.stem for p in DIR.glob("*.py")}
    for path in DIR.glob("*.py"):
        for mod, names in _imports(path):
            assert not [n for n in names if n.startswith("_")], (path.name, mod, names)
        private = [f"{n.value.id}.{n.attr}" for n in ast.walk(ast.parse(path.read_text()))
                   if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in modules
                   and n.attr.startswith("_") and not n.attr.startswith("__")]
        assert not private, (path.name, private)


def test_the_module_graph_has_no_cycle():
    graph = {p.stem: {mod.rsplit(".", 1)[1] for mod, _ in _imports(p) if mod != PACKAGE}
             for p in DIR.glob("*.py") if p.name != "__init__.py"}
    done, stack = set(), []

    def visit(m):
        assert m not in stack, " -> ".join(stack + [m])
        if m in done:
            return
        stack.append(m)
        for dep in graph.get(m, ()):
            visit(dep)
        stack.pop()
        done.add(m)

    for m in graph:
        visit(m)
    assert graph["compare"] >= {"stats", "tokens", "verdict"}  # the walk saw the real edges
