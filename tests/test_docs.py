"""Meta-tests: every hook is documented, every CLI command is in the README."""

import re
from pathlib import Path

from kangaroo_core import hookspecs
from kangaroo_core.cli import cli

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
