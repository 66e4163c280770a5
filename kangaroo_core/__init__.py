"""kangaroo: lossless self-speculative decoding with double early exiting.

The core is small: value objects (:mod:`kangaroo_core.config`, :mod:`kangaroo_core.results`), the abstract
extension points (:mod:`kangaroo_core.interfaces`), the pluggy hook specifications (:mod:`kangaroo_core.hookspecs`),
the plugin loader (:mod:`kangaroo_core.plugins`) and the decode loop (:mod:`kangaroo_core.engine`).
Every implementation, built-in or third-party, is a plugin found through the ``kangaroo`` entry-point group.
"""

__version__ = "0.1.0"

#: Public names and the module each comes from. Imported on first use (PEP 562), so ``import kangaroo_core`` (and the
#: CLI's start) does not import torch: a Ctrl-C in the first second is then handled by the CLI, not a traceback.
_EXPORTS = {"DecodeConfig": "config", "SamplingConfig": "config", "KangarooError": "errors", "DraftStep": "results",
            "GenerationResult": "results", "RoundResult": "results", "Verdict": "results"}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"kangaroo_core.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kangaroo_core' has no attribute {name!r}")


__all__ = [
    "DecodeConfig", "DraftStep", "GenerationResult", "KangarooError", "RoundResult", "SamplingConfig", "Verdict",
    "__version__",
]
