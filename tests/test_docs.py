"""Meta-tests: every hook is documented, every CLI command is in the README."""

import re
from pathlib import Path

from kangaroo_core import hookspecs
from kangaroo_apps.cli import cli

ROOT = Path(__file__).resolve().parent.parent
HOOKS = sorted(name for name in dir(hookspecs) if name.startswith("register_"))


def test_every_hook_has_a_section_in_the_hook_reference():
    text = (ROOT / "docs" / "hooks.md").read_text()
    documented = re.findall(r"^## `(register_\w+)\(register\)`", text, flags=re.M)
    assert documented == HOOKS


def test_every_hook_is_exercised_by_the_plugin_tests():
    tests = (ROOT / "tests" / "test_plugins.py").read_text()
    assert "test_every_registration_hook_registers_its_kind" in tests
    from kangaroo_core.plugins import KINDS

    assert sorted(hook for hook, _ in KINDS.values()) == HOOKS


def test_every_cli_command_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name in cli.commands:
        assert f"kangaroo {name}" in readme, name


def test_the_hook_reference_renders_the_hookspec_docstrings():
    text = (ROOT / "docs" / "hooks.md").read_text()
    assert "::: kangaroo_core.hookspecs" in text


def test_every_hook_has_a_test():
    """Datasette style: each hook in the hookspec module has a ``test_hook_<hook>`` test (tests/test_hooks.py)."""
    tests_text = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for hook in HOOKS:
        assert re.search(rf"^def test_hook_{hook}\(", tests_text, flags=re.M), f"no test_hook_{hook}"


def test_every_cli_command_is_in_the_cli_reference():
    text = (ROOT / "docs" / "cli.md").read_text()
    for name in cli.commands:
        assert f"## `kangaroo {name}`" in text, name


def test_the_cli_reference_is_up_to_date():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "cli.md").read_text() == gen.render(), "run: python docs/gen_cli.py"


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md") if "examples" not in p.parts)
    for page in pages:
        assert page in nav, page
