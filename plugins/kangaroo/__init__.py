"""The Kangaroo drafter plugin: the drafter (:mod:`.drafter`), its adapter network and file format (:mod:`.adapter`),
where the adapter runs (:mod:`.runners`: eager torch or onnxruntime) and its ONNX graph (:mod:`.onnx_graph`).
The shipped trained adapters live in ``adapters/``. Training is a tool, not part of the plugin:
:mod:`kangaroo_tools.adapter_training`.
"""

from kangaroo_core.hookspecs import hookimpl


@hookimpl
def register_drafters(register):
    from kangaroo_plugins.kangaroo.drafter import KangarooDrafter

    register("kangaroo", KangarooDrafter)
