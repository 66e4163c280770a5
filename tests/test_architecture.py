"""The module map holds: packages stand in layers and import only downwards, and no module imports another that
imports it back (every import counts, at module level or inside a function). Read from the source.

Layers, bottom up: the core (contracts, the loop, the registry, sampling, trees); the plugin packages (backends and
policies on the core alone; the drafters and verifiers on the core and the backends' graph toolkit); the tools
(training, corpus, policy analysis); the applications (command line, server, bench, transformers integration).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: import name -> folder
PACKAGES = {"kangaroo_core": "kangaroo_core", "kangaroo_backends": "backends", "kangaroo_policies": "policies",
            "kangaroo_plugins": "plugins", "kangaroo_tools": "tools", "kangaroo_apps": "apps"}
#: package -> the packages of ours it may import (besides itself)
ALLOWED = {
    "kangaroo_core": set(),
    "kangaroo_backends": {"kangaroo_core"},
    "kangaroo_policies": {"kangaroo_core"},
    "kangaroo_plugins": {"kangaroo_core", "kangaroo_backends"},
    "kangaroo_tools": {"kangaroo_core", "kangaroo_backends", "kangaroo_policies", "kangaroo_plugins"},
    "kangaroo_apps": {"kangaroo_core", "kangaroo_backends", "kangaroo_policies", "kangaroo_plugins", "kangaroo_tools"},
}
#: the largest the core may grow (lines of Python): the small-core issue's 2,500, plus the batch loop
#: (kangaroo_core/batching.py) that many-streams decoding added to the loop's own contract, and the bench's hook
#: naming a peer's build (BenchMethod.build) with the kernel caps its results name (machine.ISA_CAPS), and the
#: policy's look at each draft before its verify row is paid for (StoppingPolicy.worth_verifying, RoundResult.dropped),
#: and torch held to a backend's host threads while the loop runs beside that backend's own thread pools
#: (Backend.host_threads, machine.host_threads around each token and batch step)
CORE_LINE_BUDGET = 2895


def modules(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> dict[str, Path]:
    found = {}
    for name, folder in packages.items():
        for path in (root / folder).rglob("*.py"):
            if "adapters" in path.parts:
                continue
            rel = path.relative_to(root / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([name, *parts])] = path
    return found


def imports(path: Path) -> set[str]:
    """Every name imported anywhere in the file (``from a.b import c`` counts as ``a.b`` and ``a.b.c``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def import_cycles(mods: dict[str, Path]) -> list[str]:
    """Each import circle found among ``mods`` (a package's ``__init__`` importing its own modules is not one)."""
    graph = {m: {i for i in imports(p) if i in mods and i != m and not m.startswith(i + ".") and not i.startswith(m + ".")}
             for m, p in mods.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def upward_imports(mods: dict[str, Path]) -> list[str]:
    bad = []
    for module, path in mods.items():
        package = module.split(".")[0]
        for imported in imports(path):
            top = imported.split(".")[0]
            if top in ALLOWED and top != package and top not in ALLOWED[package]:
                bad.append(f"{module} imports {imported}")
    return sorted(set(bad))


def test_no_import_cycles():
    cycles = import_cycles(modules())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_each_package_imports_only_downwards():
    bad = upward_imports(modules())
    assert not bad, "\n".join(bad)


def test_the_core_stays_small():
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "kangaroo_core").rglob("*.py"))
    assert lines <= CORE_LINE_BUDGET, f"kangaroo_core has {lines} lines (budget {CORE_LINE_BUDGET})"


def test_the_checks_fail_on_planted_violations(tmp_path):
    """An upward import inside a function, and a circle closed by a function-level import, are both reported."""
    core, plugins = tmp_path / "core", tmp_path / "plugins"
    core.mkdir()
    plugins.mkdir()
    (core / "loop.py").write_text("import kangaroo_core.registry\n\ndef f():\n    from kangaroo_plugins.drafter import D\n")
    (core / "registry.py").write_text("def g():\n    import kangaroo_core.loop\n")
    (plugins / "drafter.py").write_text("from kangaroo_core.loop import f\n")
    mods = modules(tmp_path, {"kangaroo_core": "core", "kangaroo_plugins": "plugins"})
    assert upward_imports(mods) == ["kangaroo_core.loop imports kangaroo_plugins.drafter",
                                    "kangaroo_core.loop imports kangaroo_plugins.drafter.D"]
    assert import_cycles(mods) == ["kangaroo_core.loop -> kangaroo_core.registry -> kangaroo_core.loop",
                                   "kangaroo_core.loop -> kangaroo_plugins.drafter -> kangaroo_core.loop"]
    (core / "registry.py").write_text("def g():\n    pass\n")
    (core / "loop.py").write_text("import kangaroo_core.registry\n")
    assert upward_imports(mods) == [] and import_cycles(mods) == []


@pytest.mark.parametrize("missing", [("click", "fastapi", "uvicorn", "matplotlib")])
def test_the_core_imports_without_the_applications_dependencies(missing):
    """Every core module imports in a Python where click, fastapi, uvicorn and matplotlib cannot be imported."""
    names = sorted(m for m in modules() if m.startswith("kangaroo_core"))
    script = (
        "import sys, importlib\n"
        f"blocked = {missing!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in blocked:\n"
        "            raise ImportError(f'{name} is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print('imported', len(" + repr(names) + "))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"imported {len(names)}" in done.stdout
