"""Build throwaway installed distributions (a dist-info folder + module on sys.path) with kangaroo entry points."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path


def install_fake_distribution(root: Path, dist: str, version: str, modules: dict[str, str], entry_points: dict[str, str]) -> None:
    """Write modules and ``<dist>-<version>.dist-info`` (METADATA, entry_points.txt) into ``root``."""
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[kangaroo]\n{lines}\n")


def activate(monkeypatch, root: Path) -> None:
    monkeypatch.syspath_prepend(str(root))
    for name in list(sys.modules):
        if name.startswith("kangaroo_test_"):
            del sys.modules[name]


ENTROPY_POLICY = """
    from kangaroo_core.hookspecs import hookimpl
    from kangaroo_core.interfaces import StoppingPolicy

    class NeverStop(StoppingPolicy):
        def keep_drafting(self, step):
            return True

    @hookimpl
    def register_policies(register):
        register("never-stop", NeverStop)
"""

DUPLICATE_THRESHOLD = """
    from kangaroo_core.hookspecs import hookimpl
    from kangaroo_core.interfaces import StoppingPolicy

    class OtherThreshold(StoppingPolicy):
        def keep_drafting(self, step):
            return False

    @hookimpl
    def register_policies(register):
        register("threshold", OtherThreshold)
"""

BROKEN_ON_IMPORT = """
    raise RuntimeError("this plugin is broken on purpose")
"""

RAISES_IN_HOOK = """
    from kangaroo_core.hookspecs import hookimpl

    @hookimpl
    def register_verifiers(register):
        raise ValueError("hook exploded")
"""
