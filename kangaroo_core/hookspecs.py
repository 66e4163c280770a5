"""Hook specifications: one registration hook per extension point.

A plugin is a module (or object) exposing functions marked with :data:`hookimpl`, advertised in the ``kangaroo``
entry-point group of its distribution::

    # pyproject.toml
    [project.entry-points.kangaroo]
    entropy = "kangaroo_entropy_policy"

    # kangaroo_entropy_policy.py
    from kangaroo_core.hookspecs import hookimpl

    @hookimpl
    def register_policies(register):
        register("entropy", EntropyPolicy)

Names are global per kind: registering a name that another plugin already registered is an error naming both.
"""

import pluggy

PROJECT = "kangaroo"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_backends(register):
    """Register model backends: ``register(name, BackendSubclass)``.

    A backend loads the target model, splits it at the exit layer into the shallow part M[:l], the deep part M[l:]
    and the shared LM head, and owns the target's KV cache (see :class:`kangaroo_core.interfaces.Backend`).
    Selected with ``--backend NAME`` (built-in: ``torch``).
    """


@hookspec
def register_drafters(register):
    """Register self-drafters: ``register(name, SelfDrafterSubclass)``.

    A drafter turns the target's layer-l hidden states (and the tokens so far) into next-token logits
    (see :class:`kangaroo_core.interfaces.SelfDrafter`). Selected with ``--drafter NAME`` (built-in: ``kangaroo``).
    """


@hookspec
def register_policies(register):
    """Register stopping policies: ``register(name, StoppingPolicySubclass)``.

    A policy is the second early exit: after each draft it decides whether to draft another
    (see :class:`kangaroo_core.interfaces.StoppingPolicy`). Selected with ``--policy NAME``
    (built-in: ``threshold``).
    """


@hookspec
def register_verifiers(register):
    """Register verifiers: ``register(name, VerifierSubclass)``.

    A verifier compares the drafts with the target's logits and returns how many are accepted and the target's
    next token (see :class:`kangaroo_core.interfaces.Verifier`). Selected with ``--verifier NAME``
    (built-in: ``greedy``).
    """


@hookspec
def register_bench_methods(register):
    """Register bench methods for ``kangaroo bench``: ``register(name, BenchMethodSubclass)``.

    A bench method is one way of generating a reply that the benchmark measures next to the others on the same
    questions (see :class:`kangaroo_core.bench.api.BenchMethod`): ``prepare(context)`` once on the shared, loaded
    model (:class:`kangaroo_core.bench.api.BenchContext`: backend, transformers model, tokenizer, config, engines on
    the same backend), then ``run(messages, max_new_tokens)`` per question turn, returning a
    :class:`kangaroo_core.bench.api.MethodResult` (token ids, seconds, round statistics when it has them).
    Selected with ``kangaroo bench --methods NAME,...`` (every registered method by default; built-in:
    ``hf_vanilla``, ``hf_prompt_lookup``, ``hf_early_exit``, ``vanilla``, ``kangaroo``).
    """
