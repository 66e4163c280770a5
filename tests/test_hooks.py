"""One test per hook in kangaroo_core.hookspecs (tests/test_docs.py checks each hook has its ``test_hook_<name>``).

Each registers a class through a plugin object and resolves it by name from a registry loaded from entry points.
"""

import pytest

from kangaroo_core.bench_context import BenchMethod
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Backend, SelfDrafter, StoppingPolicy, Verifier
from kangaroo_core.plugins import Registry


def registered(hook_name: str, name: str, cls: type, kind: str):
    plugin = type("Plugin", (), {hook_name: hookimpl(lambda self, register: register(name, cls))})()
    registry = Registry().load_entry_points()
    info = registry.add(plugin, f"{name}-plugin")
    assert info.errors == [] and info.registers == {kind: [name]}
    return registry.resolve(kind, name)


def test_hook_register_backends():
    cls = type("MyBackend", (Backend,), {})
    assert registered("register_backends", "my-backend", cls, "backend") is cls


def test_hook_register_drafters():
    from kangaroo_plugins.kangaroo.drafter import KangarooDrafter

    cls = type("MyDrafter", (KangarooDrafter,), {})
    assert registered("register_drafters", "my-drafter", cls, "drafter") is cls
    assert issubclass(cls, SelfDrafter)


def test_hook_register_policies():
    cls = type("MyPolicy", (StoppingPolicy,), {"keep_drafting": lambda self, step: True})
    assert registered("register_policies", "my-policy", cls, "policy") is cls
    assert cls.create(None).keep_drafting(None) is True


def test_hook_register_verifiers():
    from kangaroo_plugins.greedy_verifier import GreedyVerifier

    cls = type("MyVerifier", (GreedyVerifier,), {})
    assert registered("register_verifiers", "my-verifier", cls, "verifier") is cls
    assert issubclass(cls, Verifier)


def test_hook_register_tree_shapers():
    from kangaroo_core.interfaces import TreeShaper
    from kangaroo_policies.tree_shapes import DynamicTree

    cls = type("MyTree", (DynamicTree,), {})
    assert registered("register_tree_shapers", "my-tree", cls, "tree") is cls
    assert issubclass(cls, TreeShaper)


def test_hook_register_bench_methods():
    cls = type("MyMethod", (BenchMethod,), {})
    assert registered("register_bench_methods", "my-method", cls, "bench_method") is cls


@pytest.mark.parametrize("hook_name", ["register_policies", "register_drafters"])
def test_hook_rejects_a_class_of_the_wrong_kind(hook_name):
    plugin = type("Plugin", (), {hook_name: hookimpl(lambda self, register: register("wrong", int))})()
    info = Registry().load_entry_points().add(plugin, "wrong-plugin")
    assert "is not a subclass of" in info.errors[0]
