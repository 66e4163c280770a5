"""kangaroo: lossless self-speculative decoding with double early exiting.

The core is small: value objects (:mod:`kangaroo_core.config`, :mod:`kangaroo_core.results`), the four abstract
extension points (:mod:`kangaroo_core.interfaces`), the pluggy hook specifications (:mod:`kangaroo_core.hookspecs`),
the plugin loader (:mod:`kangaroo_core.plugins`) and the decode loop (:mod:`kangaroo_core.engine`).
Every implementation, built-in or third-party, is a plugin found through the ``kangaroo`` entry-point group.
"""

__version__ = "0.1.0"

from kangaroo_core.config import DecodeConfig, SamplingConfig  # noqa: E402
from kangaroo_core.errors import KangarooError  # noqa: E402
from kangaroo_core.results import DraftStep, GenerationResult, RoundResult, Verdict  # noqa: E402

__all__ = [
    "DecodeConfig", "DraftStep", "GenerationResult", "KangarooError", "RoundResult", "SamplingConfig", "Verdict",
    "__version__",
]
