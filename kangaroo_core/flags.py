"""Command-line flags that plugins bring for their own options.

A plugin class lists them in its ``flags`` attribute; the command line adds each to every command that builds an
engine and passes the value on as the named option when that plugin is the one chosen. The plugin stays free of
any command-line library: a flag is plain data.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Flag:
    """``--NAME VALUE`` on the command line sets the plugin's ``option`` (e.g. ``--onnx-dir DIR`` → ``bundle``)."""

    name: str
    option: str
    help: str
    #: the values allowed (None: any value of ``type``)
    choices: tuple[str, ...] | None = None
    type: type = str
    metavar: str | None = None
    #: the value is a path that must exist (checked when the command line is parsed, before anything loads)
    exists: bool = False
