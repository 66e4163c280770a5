"""Every adapter network by its type (``architecture.type`` in ``adapter.json``): the paper's attention adapter
(:class:`~kangaroo_plugins.kangaroo.adapter.KangarooAdapter`) and the deep-context one
(:class:`~kangaroo_plugins.kangaroo.deep_context.DeepContextAdapter`); :func:`load_adapter` loads an adapter
directory into the network its file names.

Its own module so that each network's module imports only the networks it builds on (the deep-context adapter is a
Kangaroo adapter), never one built on it.
"""

from __future__ import annotations

from pathlib import Path

from kangaroo_core.errors import AdapterMismatchError
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter, network_type, read_metadata
from kangaroo_plugins.kangaroo.deep_context import DeepContextAdapter

#: type -> network class (``attention``: the paper's; ``deep-context``: reads the target's deep states)
NETWORKS: dict[str, type[KangarooAdapter]] = {network.kind: network for network in (KangarooAdapter, DeepContextAdapter)}


def adapter_class(kind: str) -> type[KangarooAdapter]:
    """The network class of an adapter ``type``."""
    network = NETWORKS.get(kind)
    if network is None:
        raise AdapterMismatchError(f"unknown adapter type {kind!r} (known: {', '.join(NETWORKS)})")
    return network


def load_adapter(directory: str | Path, model, *, base_fingerprint: str, exit_layer: int) -> KangarooAdapter:
    """The adapter saved in ``directory``, as the network its ``adapter.json`` names, checked against ``model``
    (its fingerprint) and ``exit_layer``; an :class:`AdapterMismatchError` in one line otherwise."""
    meta = read_metadata(directory, base_fingerprint=base_fingerprint, exit_layer=exit_layer)
    return adapter_class(network_type(meta)).load(directory, model, base_fingerprint=base_fingerprint,
                                                  exit_layer=exit_layer)
