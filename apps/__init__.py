"""The applications built on kangaroo: the command line, the OpenAI-compatible server, the benchmark harness, the
transformers integration and the plugin authors' conformance kit.

They stand above every plugin package and import downwards only; each builds its engines through the one
composition root, :func:`kangaroo_core.engine.assemble` (from a :class:`kangaroo_core.assembly.EngineSpec`).
"""
