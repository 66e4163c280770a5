"""User-facing errors. The CLI prints any :class:`KangarooError` as one line and exits non-zero."""


class KangarooError(Exception):
    """Base class for errors caused by user input (bad flag, missing file, unknown plugin...)."""


class UsageError(KangarooError):
    """A flag or argument is malformed or names nothing that exists (the CLI exits 2, as for click's usage errors)."""


class PluginError(KangarooError):
    """A plugin name is unknown, registered twice, or a plugin failed to load."""


class ModelLoadError(KangarooError):
    """The model path does not exist, is not a supported architecture, or cannot be read."""


class AdapterMismatchError(KangarooError):
    """An adapter file was made for another base model, exit layer or architecture."""


class PromptError(KangarooError):
    """The prompt is empty or does not fit into the model's context."""


class MissingDependencyError(KangarooError):
    """An optional dependency (e.g. onnxruntime for the ONNX backend) is not installed; the message says how to install it."""


class OnnxExportError(KangarooError):
    """Exporting to ONNX failed, or an exported graph did not match eager PyTorch within tolerance."""


class OnnxModelError(KangarooError):
    """An ONNX export is missing, corrupt, made for another model / exit layer / adapter, or needs a newer runtime."""


class ProviderError(KangarooError):
    """The requested onnxruntime execution provider is not available."""


class BenchError(KangarooError):
    """A benchmark input is unusable: bad questions file, unknown bench method, bad sweep value."""


class PredictorMismatchError(KangarooError):
    """A stopping-policy predictor file made for another base model or exit layer, or malformed."""
