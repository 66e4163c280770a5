"""The extension points of the decode loop, and the contract between them.

One round of Kangaroo decoding (paper §3, "double early exiting")::

    x_n ──M[:l]──► h_n ──drafter──► d_1 ──M[:l]──► h_1 ──drafter──► d_2 … d_k     (1. draft, 2. stop)
                                       policy: keep drafting?           │
    [h_n, h_1 … h_k] ──M[l:]──► target logits [k+1, V] ──verifier──► accepted path + one target token
                                                                      (3. verify, 4. accept, 5. roll back)

* :class:`Backend` runs the target model split at the exit layer l: the shallow part M[:l], the deep part M[l:]
  (fed with saved layer-l hidden states, never recomputing M[:l]) and the shared LM head, and owns the target's
  KV caches.
* :class:`SelfDrafter` turns layer-l hidden states into a next-token distribution (the Kangaroo adapter + shared head);
  it owns its positions (:attr:`SelfDrafter.seen`) and may receive the target's deep states of accepted positions.
* :class:`StoppingPolicy` decides after each draft whether to draft another (the second early exit).
* :class:`Verifier` compares the drafts with the target's logits and names the accepted path.
* :class:`TreeShaper` decides the shape of a token tree when a round drafts several candidates per position.
* :class:`BenchMethod` is one way of generating a reply that ``kangaroo bench`` measures.

Positions are explicit: every call that adds to a cache says at which absolute position its first new entry goes
(``start``), and the callee checks it. A chain round is the simple case of each call: ``deep`` asked for every row,
:meth:`Backend.keep` of a prefix (:meth:`Backend.crop`), a :class:`~kangaroo_core.results.Verdict` whose path is
``0..m-1``.

Implementations are plugins (see :mod:`kangaroo_core.hookspecs`); the engine resolves them once, when it is built.
This module imports nothing else of kangaroo at run time, so every other module may import it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from kangaroo_core.config import DecodeConfig
    from kangaroo_core.results import DraftStep, RoundResult, Verdict
    from kangaroo_core.tree import DraftTree, TreeAttention, VerifyTree


@attrs.frozen
class DeepOutput:
    """What one pass of M[l:] returns.

    Attributes:
        logits: [r, V] — the target's next-token logits of the rows that were asked for (all n rows by default).
        hidden: [n, d] — the target's final hidden states (after the final norm, the LM head's input) of every one
            of the n positions; the deep context a drafter may read (:meth:`SelfDrafter.observe_deep`).
    """

    logits: torch.Tensor = attrs.field(repr=False)
    hidden: torch.Tensor = attrs.field(repr=False)


class Backend(abc.ABC):
    """The target model, split at the exit layer, with its KV caches.

    Shapes: ``n`` new positions, ``d`` hidden size, ``V`` vocabulary size. After :meth:`reset` both caches are empty;
    :meth:`shallow` and :meth:`deep` append at position ``start`` (which must equal that cache's length, see
    :meth:`cache_lengths`); :meth:`keep` / :meth:`crop` roll both back.

    What a drafter may use of a backend: the identity attributes below, :attr:`runtime` (to pick how it runs its own
    network), :meth:`base_model` (the transformers model the split was made from: to build its weights from the
    target's, once, when it binds) and :meth:`shared_head` (the target's LM head). A drafter never runs the target
    itself: the engine feeds it every layer-l state (and, if it asks, every accepted deep state) the target computes.
    """

    #: Registered name, e.g. ``"torch"``.
    name: str = ""
    #: What runs the graphs: ``"torch"`` (eager PyTorch) or ``"onnxruntime"``; drafters pick their runner by it.
    runtime: str = "torch"
    #: Command-line flags for this backend's own options (:class:`kangaroo_core.flags.Flag`), added to every command
    #: that builds an engine; any option can also be set with ``--backend-option KEY=VALUE``.
    flags: tuple = ()
    #: None, or why this backend's multi-position passes do not compute what one-position passes would (e.g. per-pass
    #: activation quantization): the engine then refuses a drafter, since verification would not be lossless.
    inexact_multi_position: str | None = None
    #: None, or torch's intra-op threads for the loop's own tensor work (logits, sampling) while this backend decodes:
    #: a backend whose passes run on their own thread pool sets 1, since torch's idle team waking beside it slows them.
    host_threads: int | None = None

    @classmethod
    @abc.abstractmethod
    def create(cls, config: "DecodeConfig", **options: Any) -> "Backend":
        """Load the model named by ``options['model']`` (None: the default model) split at ``config.exit_layer``."""

    tokenizer: Any
    #: Token ids that end generation (the model's generation config).
    eos_token_ids: frozenset[int]
    exit_layer: int
    num_layers: int
    vocab_size: int
    hidden_size: int
    max_context: int
    #: Where the backend's tensors live (outputs of :meth:`shallow` / :meth:`deep` are on it).
    device: torch.device
    #: A short hash identifying the base model's weights; adapters, predictors and corpora record it.
    fingerprint: str
    #: Human-readable model identity (path or file name).
    model_name: str

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget all cached positions (start of a new generation)."""

    #: True when :meth:`shallow` and :meth:`deep` take ``tree=`` (token-tree rounds; see :mod:`kangaroo_core.tree`).
    supports_trees: bool = False

    @abc.abstractmethod
    def shallow(self, token_ids: Sequence[int], start: int, tree: "TreeAttention | None" = None) -> torch.Tensor:
        """Run M[:l] on ``token_ids`` at positions ``start..start+n-1``; return their layer-l hidden states [n, d].

        With ``tree`` (a :class:`~kangaroo_core.tree.TreeAttention`; only when :attr:`supports_trees`), the n new
        rows still go to cache slots ``start..start+n-1`` but take the tree's RoPE positions and see only the
        slots the tree lets them see (the committed prefix and their ancestors)."""

    @abc.abstractmethod
    def deep(self, hidden: torch.Tensor, start: int, rows: Sequence[int] | None = None,
             tree: "TreeAttention | None" = None) -> DeepOutput:
        """Run M[l:] + final norm on saved layer-l states [n, d] of positions ``start..``; the LM head only on
        ``rows`` (indices into the n positions; None: every row). The prefill asks for its last row only: a
        [prompt, V] logits matrix is most of a prefill's cost on a small model. ``tree``: as for :meth:`shallow`."""

    @abc.abstractmethod
    def keep(self, positions: Sequence[int]) -> None:
        """Keep exactly these cached positions (ascending), in both caches, and drop every other one.

        After a tree round the accepted path is ``committed prefix + some nodes``; after a chain round it is a prefix
        (:meth:`crop`). Positions past a cache's length are ignored for that cache.
        """

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions of both caches (the chain form of :meth:`keep`)."""
        self.keep(range(length))

    @abc.abstractmethod
    def cache_lengths(self) -> tuple[int, int]:
        """(shallow, deep) cached positions."""

    def base_model(self) -> Any:
        """The transformers ``*ForCausalLM`` the split was made from (weights shared, never run per token), for
        drafters that build their weights from the target's; None for a backend without one."""
        return None

    def shared_head(self) -> torch.nn.Module | None:
        """The target's LM head as a torch module (d → V), for drafters that share it; None when there is none."""
        model = self.base_model()
        return None if model is None else model.get_output_embeddings()

    def resplit(self, exit_layer: int) -> "Backend":
        """The same loaded model split at another exit layer (weights shared, caches separate)."""
        raise NotImplementedError(f"the '{self.name}' backend cannot be re-split at exit layer {exit_layer}")

    # -- many streams (kangaroo_core.batching) --------------------------------------------------------------------
    def stream_view(self) -> "Backend":
        """This backend with a KV cache of its own (a slot; weights shared): one per stream decoded in a batch."""
        raise NotImplementedError(f"the '{self.name}' backend cannot decode several streams at once")

    def shallow_many(self, parts: Sequence[tuple["Backend", Sequence[int], int, Any]]) -> list[torch.Tensor]:
        """:meth:`shallow` for several stream views at once, ``parts`` of (view, token_ids, start, tree): one pass
        over all their rows where the backend can (each row computed as its stream alone would compute it)."""
        return [view.shallow(ids, start, tree) for view, ids, start, tree in parts]

    def deep_many(self, parts: Sequence[tuple["Backend", torch.Tensor, int, Any, Any]]) -> list[DeepOutput]:
        """:meth:`deep` for several stream views at once, ``parts`` of (view, hidden, start, rows, tree)."""
        return [view.deep(hidden, start, rows, tree) for view, hidden, start, rows, tree in parts]

    # -- for drafters with a network of their own, on backends whose runtime is not torch (e.g. onnxruntime) -------
    def artifact_dir(self) -> Any:
        """A directory (``pathlib.Path``) where drafters keep graphs they export for this backend's runtime, inside
        the backend's own export so one directory ships everything."""
        raise NotImplementedError(f"the '{self.name}' backend keeps no exported graphs")

    def open_graph(self, path: Any, inputs: list[str], outputs: list[str], kv_layers: int) -> Any:
        """Run a drafter's exported graph the way the backend runs its own (provider, threads, KV buffers): returns
        a runner with ``run(first, out_shapes, extra=None, tree=None)``, ``length``, ``reset()``, ``crop(n)``,
        ``keep(positions)``. The runner feeds ``position_ids`` and any ``attention_bias`` / ``sliding_bias`` input
        itself (causal, or ``tree``'s visibility); ``extra`` holds the graph's other inputs by name. KV inputs and
        outputs are named ``past_*`` / ``new_*`` (``kv_layers`` pairs of each), as the backend's own graphs."""
        raise NotImplementedError(f"the '{self.name}' backend runs no exported graphs")


class DraftRunner(abc.ABC):
    """A drafter network running on one backend's runtime, with its own KV cache — what a drafter plugs in to run
    the same weights on torch or on onnxruntime (see :class:`kangaroo_plugins.kangaroo.runners`)."""

    #: Positions in the runner's cache.
    length: int = 0

    @abc.abstractmethod
    def reset(self) -> None:
        """Empty the cache."""

    @abc.abstractmethod
    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""

    @abc.abstractmethod
    def advance(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Layer-l states [n, d] of positions ``start..`` (``start`` must equal :attr:`length`) → next-token logits
        [V] after the last one."""

    def observe_deep(self, start: int, hidden: torch.Tensor) -> None:
        """Optional: the target's deep states [m, d] of accepted positions ``start..`` (see
        :meth:`SelfDrafter.observe_deep`), for networks that read them. Default: ignored."""

    def advance_tree(self, hidden: torch.Tensor, start: int, tree: "TreeAttention") -> torch.Tensor:
        """Optional (token trees): states [m, d] of tree nodes at slots ``start..`` → logits [m, V], one per node."""
        raise NotImplementedError(f"{type(self).__name__} cannot draft token trees")

    def fork(self) -> "DraftRunner":
        """The same network with an empty cache of its own (weights shared), for another stream."""
        raise NotImplementedError(f"{type(self).__name__} cannot run several streams")

    def keep(self, positions: Sequence[int]) -> None:
        """Keep exactly these cached slots (ascending), compacted to the front; a prefix is :meth:`crop`."""
        positions = list(positions)
        if positions != list(range(len(positions))):
            raise NotImplementedError(f"{type(self).__name__} can only crop its cache")
        self.crop(len(positions))


class SelfDrafter(abc.ABC):
    """Proposes draft tokens from the target's own layer-l hidden states.

    The drafter owns its positions: :attr:`seen` is how many positions (0..seen-1) it has consumed. The engine feeds
    every position exactly once, in order: :meth:`advance` receives the layer-l states of positions
    ``seen..len(token_ids)-1`` (the prompt on the first call; then usually one; two when the previous round accepted
    every draft, because the last draft's state, saved during drafting, is reused — paper phase 5). After a round the
    engine calls :meth:`crop` with the accepted length when the drafter has seen rejected positions.
    """

    name: str = ""

    @classmethod
    def create(cls, config: "DecodeConfig", **options: Any) -> "SelfDrafter":
        """Build the drafter from the decode config and plugin options (e.g. ``adapter=PATH``)."""
        return cls(**options)

    @abc.abstractmethod
    def bind(self, backend: Backend) -> None:
        """Attach to a loaded backend (load or initialise weights that depend on the base model)."""

    def fork(self, backend: Backend) -> "SelfDrafter":
        """A drafter for another stream on ``backend`` (a :meth:`Backend.stream_view`): weights shared, positions
        and every other per-generation state its own. Needed to decode several streams at once."""
        raise NotImplementedError(f"the '{self.name}' drafter cannot decode several streams at once")

    def preferred_exit_layer(self, fingerprint: str) -> int | None:
        """The exit layer this drafter's weights were made for on the base model with this fingerprint (e.g. the
        Kangaroo drafter's trained adapter), or None for no preference (the default). Asked once, before
        :meth:`bind`, and only when the user chose no exit layer: the backend is then split there."""
        return None

    @property
    @abc.abstractmethod
    def seen(self) -> int:
        """How many positions the drafter has consumed (0 after :meth:`reset`)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget all positions (start of a new generation)."""

    @abc.abstractmethod
    def advance(self, token_ids: Sequence[int], hidden: torch.Tensor) -> torch.Tensor | None:
        """Consume the unseen positions and return next-token logits [V] after the last one.

        Args:
            token_ids: the whole sequence so far (prompt, output and this round's drafts).
            hidden: layer-l hidden states [n, d] of positions ``seen..len(token_ids)-1``.

        Returns:
            logits over the vocabulary for the next position, or None when the drafter has nothing to propose.
        """

    def advance_many(self, calls: Sequence[tuple["SelfDrafter", Sequence[int], torch.Tensor]]) -> list[torch.Tensor | None]:
        """Each ``(drafter, token_ids, hidden)``'s :meth:`advance` (forks of this drafter: a batch's draft steps). An
        override that runs them as one pass must return for each exactly its own :meth:`advance` (so a stream's
        drafts, and a sampled stream's draws, never depend on what shares its passes). Default: one by one."""
        return [drafter.advance(token_ids, hidden) for drafter, token_ids, hidden in calls]

    @abc.abstractmethod
    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (after rejected drafts)."""

    #: Set True to receive :meth:`observe_deep` calls (the engine skips the slicing for drafters that ignore them).
    wants_deep_states: bool = False
    #: True when the drafter implements :meth:`advance_tree` and :meth:`keep` (token-tree rounds).
    drafts_trees: bool = False

    def advance_tree(self, token_ids: Sequence[int], paths: Sequence[Sequence[int]], hidden: torch.Tensor,
                     start: int, tree: "TreeAttention") -> torch.Tensor:
        """Optional (token trees): consume the layer-l states [m, d] of m tree nodes placed at slots
        ``start..start+m-1`` (``start == seen``) and return next-token logits [m, V], one row per node.

        ``token_ids`` is the committed sequence (prompt, output, x_n); ``paths[i]`` the drafted tokens from the root
        down to node i (its last token is node i's); ``tree`` says which slots each node sees (the committed prefix
        and its ancestors) and its position. After the round the engine calls :meth:`keep` with the slots of the
        accepted path."""
        raise NotImplementedError(f"the '{self.name}' drafter cannot draft token trees")

    def keep(self, positions: Sequence[int]) -> None:
        """Keep exactly these slots (ascending), compacted to the front (after a tree round); the default accepts a
        prefix only, which it crops."""
        positions = list(positions)
        if positions != list(range(len(positions))):
            raise NotImplementedError(f"the '{self.name}' drafter cannot keep a tree path")
        self.crop(len(positions))

    def observe_deep(self, start: int, hidden: torch.Tensor) -> None:
        """Optional: the target's final hidden states [m, d] of newly *accepted* positions ``start..start+m-1``.

        Called after the prefill (every prompt position) and after every round (x_n and the accepted drafts), with
        states verification computed anyway — no extra pass. Positions arrive in order, each exactly once; a
        position is only ever passed after it is accepted, so nothing here is rolled back. Default: ignored.
        """


class StoppingPolicy(abc.ABC):
    """The second early exit: after each draft, decide whether to draft another.

    The engine never drafts more than ``gamma`` tokens nor past the token budget, whatever the policy says; a policy
    only decides to stop earlier. The draft that made the policy stop is still verified.

    Per-round state: reset it in :meth:`begin_round` (or :meth:`start_round` when the position matters); both are
    called before the first draft of every round. Each stream of a batch (and each :meth:`Engine.with_sampling
    <kangaroo_core.engine.Engine.with_sampling>` copy) gets a shallow copy of the policy, bound again (:meth:`bind`,
    :meth:`bind_engine`): keep mutable state in attributes those methods, :meth:`prepare` or the round hooks
    reassign, never in a container shared with the original.
    """

    name: str = ""

    @classmethod
    def create(cls, config: "DecodeConfig", **options: Any) -> "StoppingPolicy":
        """Build from the decode config and ``--policy-option KEY=VALUE`` options (values arrive as int, float or
        bool when they parse as JSON numbers / booleans, else as str). Unknown keys raise TypeError, which the
        engine reports in one line naming the valid options."""
        return cls(**options)

    def bind(self, backend: Backend) -> None:
        """Called once when the engine is built, with the loaded backend (e.g. to check a file made for a base model)."""

    def bind_engine(self, engine: Any) -> None:
        """Called once when the engine is built, after its drafter is bound (e.g. to measure a draft step's cost)."""

    def prepare(self, engine: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Called once at the start of each generation, before any cache is reset (e.g. to compute a reference)."""

    def round_budget(self, most: int) -> int:
        """Called before every round: how many drafts it may propose, up to ``most`` (gamma, or fewer near the token
        budget). 0 makes the round the target's plain step with no drafter work; the drafter reads the skipped
        positions in one pass when drafting resumes."""
        return most

    def end_round(self, drafts: Sequence["DraftStep"], accepted: int) -> None:
        """Called after every verified chain round that drafted: its drafts and how many the target accepted."""

    def start_round(self, tokens: Sequence[int]) -> None:
        """Called before the first draft of each round with the committed sequence (prompt + output so far).

        The first draft will be proposed for position ``len(tokens)``. The default calls :meth:`begin_round`, so
        policies that do not need the position only implement that.
        """
        self.begin_round()

    def begin_round(self) -> None:
        """Called before the first draft of each round (by the default :meth:`start_round`): reset per-round state."""

    def worth_verifying(self, step: "DraftStep") -> bool:
        """Called with each draft before its layer-l state is computed: False drops it unverified and ends the
        round's drafting (the drafter's step was spent, the verify row is saved). The default keeps every draft."""
        return True

    @abc.abstractmethod
    def keep_drafting(self, step: "DraftStep") -> bool:
        """Return True to draft another token after ``step`` (``step.confidence`` is the draft's top-1 probability,
        ``step.probs`` its whole distribution, ``step.index`` its 1-based place in the round)."""


class Verifier(abc.ABC):
    """Decides which drafts the target accepts (the accepted path) and which target token follows them."""

    name: str = ""
    #: True when the verifier is lossless under sampling (temperature > 0); the engine refuses the others then.
    samples: bool = False

    @classmethod
    def create(cls, config: "DecodeConfig", **options: Any) -> "Verifier":
        return cls(**options)

    def begin(self, generator: torch.Generator) -> None:
        """Called at the start of each generation with its random generator (seeded from ``SamplingConfig.seed``)."""

    @abc.abstractmethod
    def verify(self, drafts: Sequence["DraftStep"], target_logits: torch.Tensor) -> "Verdict":
        """Compare k drafts with the target's logits [k+1, V] (row 0 follows x_n, row i follows draft i)."""

    def verify_tree(self, tree: "VerifyTree", target_logits: torch.Tensor) -> "Verdict":
        """Optional (token trees): ``target_logits`` [rows, V], row r the target's logits after tree row r (row 0:
        the root x_n). Returns the accepted root path (rows >= 1, depth order; ``Verdict.path`` holds row - 1, the
        node's index among the drafted rows) and the target's next token."""
        raise NotImplementedError(f"the '{self.name}' verifier cannot verify token trees")


class TreeShaper(abc.ABC):
    """How each round's token tree grows: the plugin point of tree drafting (``--tree NAME``).

    The engine grows the tree depth by depth. Each round starts from the root's draft distribution; for a node it
    asks :meth:`children` which tokens to add under it; at each depth it asks :meth:`expand` which of the new
    nodes to run through M[:l] and the drafter (one batched pass) to propose *their* children; at the end
    :meth:`select` picks the nodes verified in the one pass of M[l:] (at most :attr:`budget`, ancestor-closed).
    The built-in ``dynamic`` shaper is EAGLE-2's (cumulative draft probability ranks expansion and selection);
    ``chain`` grows one child per node while the stopping policy says so — the chain of the paper as a tree.
    """

    name: str = ""
    #: most drafted nodes verified per round, longest root path
    budget: int = 8
    depth: int = 6

    @classmethod
    def create(cls, config: "DecodeConfig", **options: Any) -> "TreeShaper":
        """Build from the decode config and ``--tree-option KEY=VALUE`` / ``--tree-budget`` etc."""
        return cls(**options)

    def bind(self, backend: Backend, policy: StoppingPolicy) -> None:
        """Called when an engine is built with this shaper, ``policy`` that engine's (each stream of a batch binds
        its own shallow copy to its own policy), e.g. to size the tree from the backend's measured cost curve."""

    def start_round(self, tokens: Sequence[int], policy: StoppingPolicy) -> None:
        """Called before each round with the committed sequence."""

    @abc.abstractmethod
    def children(self, tree: "DraftTree", node: int, probs: torch.Tensor) -> list[int]:
        """Candidate tokens under ``node`` from the drafter's distribution ``probs`` [V] there, most likely first
        (distinct tokens; point-mass proposals for the verifier)."""

    @abc.abstractmethod
    def expand(self, tree: "DraftTree", frontier: Sequence[int]) -> list[int]:
        """Which of the newest nodes ``frontier`` get children (they go through M[:l] and the drafter)."""

    @abc.abstractmethod
    def select(self, tree: "DraftTree") -> list[int]:
        """The nodes to verify (root excluded), ancestor-closed, at most :attr:`budget`."""


# -- bench methods ------------------------------------------------------------------------------------------------------
Messages = Sequence[dict[str, str]]


@attrs.frozen
class MethodResult:
    """One generation by one bench method.

    Attributes:
        token_ids: the new tokens (EOS included when generation stopped on it), at most ``max_new_tokens``.
        seconds: wall time of the generation call (prefill included).
        rounds: per-verification-round statistics when the method has them (our engine), else None.
        target_passes: full-depth forward passes of the target after the prefill, when known without ``rounds``
            (transformers methods); gives the compression rate CR = tokens after the first / passes.
        generated_tokens: tokens the method really produced before truncation to ``max_new_tokens`` / EOS
            (transformers' assisted generation can overshoot); None: ``len(token_ids)``.
    """

    token_ids: list[int]
    seconds: float
    rounds: "list[RoundResult] | None" = None
    target_passes: int | None = None
    generated_tokens: int | None = None


class BenchMethod(abc.ABC):
    """A way of generating a reply, measured by ``kangaroo bench``.

    Lifecycle: ``create(config, **options)`` → ``prepare(context)`` once (a
    :class:`kangaroo_core.bench_context.BenchContext`: build engines, check the model; raise to report the method as
    failed) → ``run(messages, max_new_tokens)`` per question turn.
    """

    #: Registered name, e.g. ``"hf_vanilla"``.
    name: str = ""
    #: Where the method's column goes in tables (lower first; ties by name).
    rank: int = 100
    #: Registered name of the method that runs this method's backend with no drafter ("" for none). When both run,
    #: the bench reports whether every turn equals that target alone: the losslessness check that still applies
    #: where the backend itself differs from transformers by design (int8 activations, other dtypes).
    target_alone: str = ""

    @classmethod
    def create(cls, config: "DecodeConfig", **options: Any) -> "BenchMethod":
        return cls(**options)

    @abc.abstractmethod
    def prepare(self, context: Any) -> None:
        """Set up on the shared model (called once, before the warm-up)."""

    @abc.abstractmethod
    def run(self, messages: Messages, max_new_tokens: int) -> MethodResult:
        """Reply to a conversation (a list of ``{"role", "content"}`` ending with a user turn)."""

    def build(self) -> str | None:
        """After :meth:`prepare`: one line naming a peer library the method runs (version, instruction sets); None."""
        return None
