import json

import pytest

from kangaroo_core import hookspecs, plugins
from kangaroo_apps.cli import main
from kangaroo_core.errors import PluginError
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Backend, SelfDrafter, StoppingPolicy, Verifier
from kangaroo_core.plugins import KINDS, Registry
from plugin_fixtures import (BROKEN_ON_IMPORT, DUPLICATE_THRESHOLD, ENTROPY_POLICY, RAISES_IN_HOOK, activate,
                             install_fake_distribution)

BUILTINS = {"backend": ["onnx", "torch"], "drafter": ["kangaroo", "kangaroo-hybrid"], "policy": ["adaptive", "cost", "fixed", "learned", "oracle", "threshold"], "verifier": ["greedy", "speculative"],
            "bench_method": sorted(["hf_early_exit", "hf_prompt_lookup", "hf_static", "hf_vanilla", "kangaroo", "kangaroo_hybrid", "kangaroo_onnx",
                             "kangaroo_onnx_gguf", "kangaroo_onnx_gguf_int8", "kangaroo_onnx_hybrid", "kangaroo_onnx_tree", "kangaroo_tree", "llama_cpp", "ort_vanilla", "vanilla", "vanilla_onnx",
                             "vanilla_onnx_gguf", "vanilla_onnx_gguf_int8", "vanilla_onnx_gguf_int8_spin",
                             "vanilla_onnx_gguf_int8_nbits", "kangaroo_onnx_gguf_int8_nbits"]),
            "tree": ["chain", "dynamic", "fan"]}


def builtin_names(registry, kind):
    """Names registered by this distribution (the docs' example packages are installed next to it in CI)."""
    return sorted(n for n in registry.names(kind) if registry._entries[kind][n].source.distribution == "kangaroo-decoding")


def test_builtins_come_from_entry_points():
    registry = Registry().load_entry_points()
    for kind, names in BUILTINS.items():
        assert builtin_names(registry, kind) == names
    report = {p["name"]: p for p in registry.report()}
    assert report["torch"]["distribution"] == "kangaroo-decoding"
    assert report["threshold"]["registers"] == {"policy": ["threshold"]}
    assert report["learned"]["registers"] == {"policy": ["learned"]} and report["oracle"]["registers"] == {"policy": ["oracle"]}
    assert all(not p["errors"] for p in report.values())


def test_resolve_returns_the_registered_classes():
    registry = Registry().load_entry_points()
    assert issubclass(registry.resolve("backend", "torch"), Backend)
    assert issubclass(registry.resolve("drafter", "kangaroo"), SelfDrafter)
    assert issubclass(registry.resolve("policy", "threshold"), StoppingPolicy)
    assert issubclass(registry.resolve("verifier", "greedy"), Verifier)


def test_unknown_name_lists_the_known_ones():
    registry = Registry().load_entry_points()
    with pytest.raises(PluginError, match=r"unknown policy 'nope'; known policy plugins: (.*, )?threshold(, .*)?$"):
        registry.resolve("policy", "nope")


def test_third_party_plugin_is_found_through_entry_points(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, "kangaroo-never-stop", "1.2.3", {"kangaroo_test_never": ENTROPY_POLICY},
                              {"never": "kangaroo_test_never"})
    activate(monkeypatch, tmp_path)
    registry = Registry().load_entry_points()
    assert registry.resolve("policy", "never-stop").__name__ == "NeverStop"
    info = {p["name"]: p for p in registry.report()}["never"]
    assert (info["distribution"], info["version"], info["registers"]) == ("kangaroo-never-stop", "1.2.3", {"policy": ["never-stop"]})


def test_duplicate_name_is_an_error_naming_both_sources(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, "kangaroo-dup", "0.1", {"kangaroo_test_dup": DUPLICATE_THRESHOLD},
                              {"dup": "kangaroo_test_dup"})
    activate(monkeypatch, tmp_path)
    registry = Registry().load_entry_points()
    with pytest.raises(PluginError) as excinfo:
        registry.resolve("policy", "threshold")
    message = str(excinfo.value)
    assert "registered twice" in message
    assert "plugin 'threshold' (kangaroo-decoding 0.1.0)" in message and "plugin 'dup' (kangaroo-dup 0.1)" in message
    report = {p["name"]: p for p in registry.report()}
    assert report["dup"]["errors"] and report["threshold"]["errors"]
    assert registry.resolve("verifier", "greedy")  # the rest keeps working


def test_broken_plugins_are_reported_and_the_rest_keeps_working(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, "kangaroo-broken", "0.0.1",
                              {"kangaroo_test_broken": BROKEN_ON_IMPORT, "kangaroo_test_hook": RAISES_IN_HOOK},
                              {"broken": "kangaroo_test_broken", "hook-raises": "kangaroo_test_hook"})
    activate(monkeypatch, tmp_path)
    registry = Registry().load_entry_points()
    report = {p["name"]: p for p in registry.report()}
    assert "RuntimeError: this plugin is broken on purpose" in report["broken"]["errors"][0]
    assert "register_verifiers raised ValueError: hook exploded" in report["hook-raises"]["errors"][0]
    for kind, names in BUILTINS.items():
        assert builtin_names(registry, kind) == names


def test_registering_a_non_subclass_is_reported():
    class NotAPolicy:
        pass

    class Plugin:
        @hookimpl
        def register_policies(self, register):
            register("bad", NotAPolicy)

    registry = Registry().load_entry_points()
    info = registry.add(Plugin(), "bad-plugin")
    assert "not a subclass of StoppingPolicy" in info.errors[0]
    with pytest.raises(PluginError, match="unknown policy 'bad'"):
        registry.resolve("policy", "bad")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_registration_hook_registers_its_kind(kind):
    """Each hook in the hookspec module works end to end (meta-test companion of test_docs)."""
    hook_name, base = KINDS[kind]
    impl_class = type(f"Custom{kind.title()}", (base,), {})

    class Plugin:
        pass

    def hook(self, register):
        register(f"custom-{kind}", impl_class)

    setattr(Plugin, hook_name, hookimpl(hook))
    registry = Registry().load_entry_points()
    registry.add(Plugin(), f"custom-{kind}-plugin")
    assert registry.resolve(kind, f"custom-{kind}") is impl_class


def test_hookspecs_cover_every_kind_and_have_docstrings():
    specs = {name for name in dir(hookspecs) if name.startswith("register_")}
    assert specs == {hook for hook, _ in KINDS.values()}
    for name in specs:
        doc = getattr(hookspecs, name).__doc__ or ""
        assert "register(name," in doc, name


def test_runtime_registration_for_api_users(fresh_global_registry):
    class Always(StoppingPolicy):
        def keep_drafting(self, step):
            return True

    class Plugin:
        @hookimpl
        def register_policies(self, register):
            register("always", Always)

    plugins.register_plugin(Plugin(), "api-plugin")
    assert plugins.get_registry().resolve("policy", "always") is Always
    plugins.unregister_plugin("api-plugin")
    with pytest.raises(PluginError):
        plugins.get_registry().resolve("policy", "always")


def test_plugins_command_lists_builtins_and_errors(tmp_path, monkeypatch, capsys, fresh_global_registry):
    install_fake_distribution(tmp_path, "kangaroo-broken", "0.0.1", {"kangaroo_test_broken2": BROKEN_ON_IMPORT},
                              {"broken2": "kangaroo_test_broken2"})
    activate(monkeypatch, tmp_path)
    assert main(["plugins", "--json"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert {"torch", "kangaroo", "threshold", "greedy", "broken2"} <= set(listed)
    assert listed["broken2"]["errors"] and listed["broken2"]["distribution"] == "kangaroo-broken"
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "policy: threshold" in text and "error: failed to import" in text
