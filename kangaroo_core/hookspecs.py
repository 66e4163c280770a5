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
    and the shared LM head, and owns the target's KV caches (see :class:`kangaroo_core.interfaces.Backend`). Positions
    are explicit: ``shallow(token_ids, start)`` → layer-l states [n, d]; ``deep(hidden, start, rows=None)`` → a
    ``DeepOutput`` with the logits of the rows asked for and the final hidden states of every position;
    ``keep(positions)`` / ``crop(length)`` roll the caches back. Drafters may use its identity attributes,
    ``runtime``, ``base_model()`` and ``shared_head()`` (and ``artifact_dir()`` / ``open_graph()`` on onnxruntime).
    Selected with ``--backend NAME`` (built-in: ``torch``, ``onnx``).
    """


@hookspec
def register_drafters(register):
    """Register self-drafters: ``register(name, SelfDrafterSubclass)``.

    A drafter turns the target's layer-l hidden states (and the tokens so far) into next-token logits
    (see :class:`kangaroo_core.interfaces.SelfDrafter`). It owns its positions (``seen``; ``advance`` gets the states
    of positions ``seen..len(token_ids)-1``; ``crop`` after rejected drafts) and, with ``wants_deep_states = True``,
    receives the target's final hidden states of every accepted position through ``observe_deep(start, hidden)``
    (computed by verification anyway: no extra pass). Selected with ``--drafter NAME`` and options with
    ``--drafter-option KEY=VALUE`` (built-in: ``kangaroo``, ``kangaroo-hybrid``).
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

    A verifier compares the drafts with the target's logits and returns a ``Verdict``: the accepted path (indices of
    the accepted drafts; a prefix ``Verdict.chain(m, token)`` for chains) and the target's next token (see
    :class:`kangaroo_core.interfaces.Verifier`). Selected with ``--verifier NAME`` (built-in: ``greedy``,
    ``speculative``).
    """


@hookspec
def register_tree_shapers(register):
    """Register tree shapers: ``register(name, TreeShaperSubclass)``.

    A tree shaper decides how each round's token tree grows when the engine drafts a tree instead of a chain (see
    :class:`kangaroo_core.interfaces.TreeShaper`): which tokens become children of a node (``children``), which of
    the newest nodes go through M[:l] and the drafter to grow further (``expand``), and which nodes the one verify
    pass checks (``select``: ancestor-closed, at most ``budget``). The engine does the batched passes, the tree
    masks, verification and the cache bookkeeping. Selected with ``--tree NAME`` and ``--tree-budget`` /
    ``--tree-topk`` / ``--tree-depth`` (built-in: ``dynamic``, EAGLE-2's dynamic tree; ``chain``, the paper's chain
    as a tree of width 1 driven by the stopping policy; ``fan``, that chain plus the root's runners-up).
    """


@hookspec
def register_bench_methods(register):
    """Register bench methods for ``kangaroo bench``: ``register(name, BenchMethodSubclass)``.

    A bench method is one way of generating a reply that the benchmark measures next to the others on the same
    questions (see :class:`kangaroo_core.interfaces.BenchMethod`; ``rank`` orders the columns): ``prepare(context)`` once on the shared, loaded
    model (:class:`kangaroo_core.bench_context.BenchContext`: backend, transformers model, tokenizer, config, engines on
    the same backend), then ``run(messages, max_new_tokens)`` per question turn, returning a
    :class:`kangaroo_core.interfaces.MethodResult` (token ids, seconds, round statistics when it has them).
    Selected with ``kangaroo bench --methods NAME,...`` (every registered method by default; built-in:
    ``hf_vanilla``, ``hf_prompt_lookup``, ``hf_early_exit``, ``vanilla``, ``kangaroo``, ``kangaroo_hybrid``; with the
    ``[onnx]`` extra ``ort_vanilla``, ``vanilla_onnx``, ``kangaroo_onnx``).
    """
