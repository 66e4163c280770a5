"""Write docs/cli.md from the click commands' own help (tests/test_docs.py checks it is up to date).

    python docs/gen_cli.py
"""

from __future__ import annotations

from pathlib import Path

import click

from kangaroo_apps.cli import cli

OUT = Path(__file__).resolve().parent / "cli.md"

HEADER = """# CLI reference

Generated from the commands' `--help` by `python docs/gen_cli.py`; a test fails when this page is out of date.
Every command takes `-h` / `--help`.
"""


def help_text(command: click.Command, name: str) -> str:
    ctx = click.Context(command, info_name=name, terminal_width=100, max_content_width=100,
                        help_option_names=["-h", "--help"])
    return command.get_help(ctx)


def render() -> str:
    parts = [HEADER, "## `kangaroo`\n", "```text\n" + help_text(cli, "kangaroo") + "\n```\n"]
    for name in sorted(cli.commands):
        parts.append(f"## `kangaroo {name}`\n")
        parts.append("```text\n" + help_text(cli.commands[name], f"kangaroo {name}") + "\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
