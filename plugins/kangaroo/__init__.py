"""The Kangaroo drafter plugin: the drafter (:mod:`.drafter`), its adapter network and file format (:mod:`.adapter`;
the deep-context variant, :mod:`.deep_context`; every network by type and loading any adapter, :mod:`.networks`),
where the adapter runs (:mod:`.runners`: eager torch or onnxruntime), its ONNX graph (:mod:`.onnx_graph`), and the
hybrid drafter (:mod:`.hybrid`: prompt lookup where it has been accepted, the adapter otherwise).
The shipped trained adapters live in ``adapters/``. Training is a tool, not part of the plugin:
:mod:`kangaroo_tools.adapter_training`.
"""

from kangaroo_core.hookspecs import hookimpl


@hookimpl
def register_drafters(register):
    from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
    from kangaroo_plugins.kangaroo.hybrid import HybridDrafter

    register("kangaroo", KangarooDrafter)
    register("kangaroo-hybrid", HybridDrafter)
