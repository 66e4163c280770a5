"""The module map holds: no import cycles, the core imports no plugin or tool, plugin packages never import tools,
backends never import drafters or policies. Read from the source (every import, at module level or inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: import name -> folder
PACKAGES = {"kangaroo_core": "kangaroo_core", "kangaroo_backends": "backends", "kangaroo_policies": "policies",
            "kangaroo_plugins": "plugins", "kangaroo_tools": "tools"}
#: package -> packages it must never import (the application shell, kangaroo_core.cli*, may import anything)
FORBIDDEN = {
    "kangaroo_core": {"kangaroo_backends", "kangaroo_policies", "kangaroo_plugins", "kangaroo_tools"},
    "kangaroo_backends": {"kangaroo_policies", "kangaroo_plugins", "kangaroo_tools"},
    "kangaroo_policies": {"kangaroo_backends", "kangaroo_plugins", "kangaroo_tools"},
    "kangaroo_plugins": {"kangaroo_policies", "kangaroo_tools"},
}


def modules() -> dict[str, Path]:
    found = {}
    for name, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "adapters" in path.parts:
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([name, *parts])] = path
    return found


def imports(path: Path, *, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_import_cycles_at_module_level():
    mods = modules()
    graph = {m: {i for i in imports(p, module_level_only=True) if i in mods and i != m} for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_each_package_imports_only_what_its_layer_may():
    bad = []
    for module, path in modules().items():
        package = module.split(".")[0]
        if module.startswith("kangaroo_core.cli"):
            continue  # the command line is the application: it composes everything
        for imported in imports(path, module_level_only=False):
            if imported.split(".")[0] in FORBIDDEN.get(package, ()):
                bad.append(f"{module} imports {imported}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_rule_checker_sees_a_violation(tmp_path, monkeypatch):
    """The checks above can fail: a core module importing a plugin is reported."""
    fake = tmp_path / "kangaroo_core"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from kangaroo_plugins.kangaroo import drafter\n")
    assert "kangaroo_plugins.kangaroo" in imports(fake / "bad.py", module_level_only=False)
    assert imports(fake / "bad.py", module_level_only=True) == set()
