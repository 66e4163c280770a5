"""What the installed plugins declare, as plain data: their names, the backends' command-line flags, the options
each plugin takes and whether each verifier samples.

They are read from the loaded registry (:func:`facts_of`); the command line keeps a copy per environment
(:mod:`kangaroo_apps.plugin_index`) so that ``--help`` and every refusal that needs only these facts run before, and
without, importing torch. This module imports nothing heavy for that reason.
"""

from __future__ import annotations

from typing import Any

import attrs

from kangaroo_core.config import not_lossless_under_sampling, unknown_options, unknown_plugin


@attrs.frozen
class PluginFacts:
    """The facts of one set of plugins; JSON-ready (:meth:`to_dict` / :meth:`from_dict`)."""

    #: kind -> registered names
    names: dict[str, list[str]]
    #: kind -> name -> the option names its ``create`` takes (None: open-ended, not checked)
    options: dict[str, dict[str, list[str] | None]]
    #: every backend's flags: ``{"backend", "name", "option", "help", "choices", "type", "metavar", "exists"}``
    flags: list[dict[str, Any]]
    #: verifier name -> lossless under sampling
    samples: dict[str, bool]

    def check(self, kind: str, name: str, options: dict[str, Any]) -> None:
        """Refuse an unknown plugin name or an option its ``create`` does not take (the registry's own messages)."""
        known = self.names.get(kind, [])
        if name not in known:
            raise unknown_plugin(kind, name, known)
        valid = self.options.get(kind, {}).get(name)
        unknown = sorted(set(options) - set(valid)) if valid is not None else []
        if unknown:
            raise unknown_options(kind, name, unknown, valid)

    def check_sampling(self, verifier: str, temperature: float) -> None:
        if temperature > 0 and not self.samples.get(verifier, True):
            raise not_lossless_under_sampling(verifier, temperature)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PluginFacts":
        return cls(**{field.name: data[field.name] for field in attrs.fields(cls)})


def facts_of(registry) -> PluginFacts:
    """The facts of a loaded :class:`~kangaroo_core.plugins.Registry`."""
    from kangaroo_core.plugins import KINDS, option_names

    factories = {kind: {name: registry.resolve(kind, name) for name in registry.names(kind)} for kind in KINDS}
    flags = [{"backend": name, "name": flag.name, "option": flag.option, "help": flag.help,
              "choices": list(flag.choices) if flag.choices else None, "type": flag.type.__name__,
              "metavar": flag.metavar, "exists": flag.exists}
             for name, factory in sorted(factories["backend"].items()) for flag in getattr(factory, "flags", ())]
    return PluginFacts(names={kind: registry.names(kind) for kind in KINDS},
                       options={kind: {name: option_names(f) for name, f in sorted(made.items())}
                                for kind, made in factories.items()},
                       flags=flags, samples={name: bool(f.samples) for name, f in factories["verifier"].items()})
