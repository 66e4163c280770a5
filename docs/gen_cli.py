"""Write docs/cli.md from the click commands' own help (tests/test_docs.py checks it is up to date).

    python docs/gen_cli.py

Commands that build an engine take the flags of every installed backend plugin; the reference shows those of the
backends kangaroo ships, whatever else is installed (e.g. the tutorials' example packages).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from pathlib import Path

import click

from kangaroo_apps.cli import cli
from kangaroo_core import plugins

OUT = Path(__file__).resolve().parent / "cli.md"
DISTRIBUTION = "kangaroo-decoding"

HEADER = """# CLI reference

Generated from the commands' `--help` by `python docs/gen_cli.py`; a test fails when this page is out of date.
Every command takes `-h` / `--help`. Commands that build an engine also take the flags of every installed backend
plugin (shown here: the built-in `torch` and `onnx` backends'); a flag is refused unless `--backend` names its
backend. Any backend option can also be given as `--backend-option KEY=VALUE`.
"""


def builtin_registry() -> plugins.Registry:
    """A registry of this distribution's own plugins only."""
    registry = plugins.Registry()
    for ep in sorted(importlib.metadata.entry_points(group=plugins.ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.dist is not None and ep.dist.name == DISTRIBUTION:
            registry.add(ep.load(), plugins.PluginInfo(ep.name, ep.dist.name, ep.dist.version))
    return registry


@contextlib.contextmanager
def builtin_plugins_only():
    """The engine commands' backend flags are made per registry: swapping it shows the built-in backends' alone."""
    saved = plugins._registry
    plugins._registry = builtin_registry()
    try:
        yield
    finally:
        plugins._registry = saved


def help_text(command: click.Command, name: str) -> str:
    ctx = click.Context(command, info_name=name, terminal_width=100, max_content_width=100,
                        help_option_names=["-h", "--help"])
    return command.get_help(ctx)


def render() -> str:
    with builtin_plugins_only():
        parts = [HEADER, "## `kangaroo`\n", "```text\n" + help_text(cli, "kangaroo") + "\n```\n"]
        for name in sorted(cli.commands):
            parts.append(f"## `kangaroo {name}`\n")
            parts.append("```text\n" + help_text(cli.commands[name], f"kangaroo {name}") + "\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
