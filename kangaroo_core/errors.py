"""User-facing errors. The CLI prints any :class:`KangarooError` as one line and exits non-zero."""


class KangarooError(Exception):
    """Base class for errors caused by user input (bad flag, missing file, unknown plugin...)."""


class PluginError(KangarooError):
    """A plugin name is unknown, registered twice, or a plugin failed to load."""


class ModelLoadError(KangarooError):
    """The model path does not exist, is not a supported architecture, or cannot be read."""


class AdapterMismatchError(KangarooError):
    """An adapter file was made for another base model, exit layer or architecture."""


class PromptError(KangarooError):
    """The prompt is empty or does not fit into the model's context."""


class BenchError(KangarooError):
    """A benchmark input is unusable: bad questions file, unknown bench method, bad sweep value."""
