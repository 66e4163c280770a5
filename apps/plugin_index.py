"""The command line's copy of the installed plugins' facts, so ``--help`` and refusals need no torch.

Loading the plugins imports torch and transformers (seconds); what ``--help``, flag parsing and the checks before a
model loads need is small and plain (:class:`~kangaroo_apps.plugin_facts.PluginFacts`). It is kept as JSON in the
cache directory under a key made from the ``kangaroo`` entry points (names, targets, distributions and versions)
and the size and modification time of every file of the packages they live in, so installing, removing or
editing a plugin makes a new copy on the next run. Where the registry is already loaded in this process (the
Python API, tests that register plugins at run time) it is the source instead: it is the truth and costs nothing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

from kangaroo_core.paths import cache_dir
from kangaroo_apps.plugin_facts import PluginFacts, facts_of

ENTRY_POINT_GROUP = "kangaroo"  # kangaroo_core.plugins.ENTRY_POINT_GROUP, without importing the registry
#: bump when the facts' layout changes
FORMAT = 1


def plugin_facts() -> PluginFacts:
    """The installed plugins' facts: from the loaded registry if there is one, else the cached copy, else made now
    (loading the registry once) and cached."""
    loaded = _loaded_registry()
    if loaded is not None:
        return facts_of(loaded)
    path = cache_dir() / "plugin-index" / f"{environment_key()}.json"
    try:
        return PluginFacts.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return refresh(path)


def refresh(path: Path | None = None) -> PluginFacts:
    """Load the registry and write its facts to the cache (``kangaroo plugins`` does this too)."""
    from kangaroo_core.plugins import get_registry

    facts = facts_of(get_registry())
    path = path or cache_dir() / "plugin-index" / f"{environment_key()}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(facts.to_dict()), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the facts still hold for this run
        pass
    return facts


def _loaded_registry():
    plugins = sys.modules.get("kangaroo_core.plugins")
    return None if plugins is None or plugins._registry is None else plugins._registry


def environment_key() -> str:
    """A digest of what decides the facts: the entry points and the files of the packages that hold them (and of
    kangaroo_core, whose base classes give plugins their default options)."""
    digest = hashlib.sha256(f"{FORMAT} {sys.version}".encode())
    packages = {"kangaroo_core"}
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
        dist = getattr(ep, "dist", None)
        digest.update(f"{ep.name}={ep.value} {dist.name if dist else ''} {dist.version if dist else ''}\n".encode())
        packages.add(ep.value.split(":")[0].split(".")[0])
    for package in sorted(packages):
        for file in _package_files(package):
            try:
                stat = file.stat()
            except OSError:
                continue
            digest.update(f"{file} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def _package_files(package: str) -> list[Path]:
    """The Python files of a top-level package or module, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return sorted(file for root in spec.submodule_search_locations for file in Path(root).rglob("*.py"))
    return [Path(spec.origin)] if spec.origin else []
