"""The decode loop: draft → stop → verify, as a ladder of small steps with the paper's names.

Glossary (shapes for one sequence, batch size 1):
    l            exit layer; M[:l] is the shallow sub-network shared by drafter and target, M[l:] the rest.
    x_n          the last committed token; it has not been through M[:l] yet when a round starts.
    h            layer-l hidden states, [n, d]; saved while drafting and fed to M[l:] for verification,
                 so M[:l] runs exactly once per position.
    k            drafts proposed this round (0..gamma), d_1..d_k.
    target_logits  [k+1, V]: row i is the target's prediction after x_n, d_1..d_i.
    m            accepted drafts (0..k); the round emits d_1..d_m and one target token.
    unseen       layer-l states the drafter has not consumed yet; when all k drafts are accepted it holds h(d_k),
                 computed while drafting and reused by the next round (paper phase 5).
    q            the proposal: the distribution each draft was drawn from (a point mass on the drafter's top-1
                 under greedy drafting; the drafter's processed distribution under sampled drafting).
    generator    one CPU torch.Generator per generation, seeded from SamplingConfig.seed; every random draw uses it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from kangaroo_core.assembly import EngineSpec, build_pieces, build_verifier, check_sampling
from kangaroo_core.config import DEFAULT_DRAFTER, DEFAULT_EXIT_LAYER, DEFAULT_POLICY, ConfigError, DecodeConfig, SamplingConfig
from kangaroo_core.errors import PromptError
from kangaroo_core.interfaces import Backend, SelfDrafter, StoppingPolicy, TreeShaper, Verifier
from kangaroo_core.machine import host_threads
from kangaroo_core.results import DraftStep, Emitted, GenerationResult, RoundResult, Verdict, cut_at_eos
from kangaroo_core.sampling import draw, make_generator, target_probs
from kangaroo_core.text_pieces import TextPieces
from kangaroo_core.tree_round import tree_round

if TYPE_CHECKING:
    from kangaroo_core.batching import Batch

Prompt = str | Sequence[dict[str, str]]


#: how a conversation is written for a model without a chat template (a base model such as Gemma 3 270M)
PLAIN_QUESTION = "Question: {}\nAnswer:"


def plain_prompt(messages: Sequence[dict]) -> str:
    """A conversation as plain text for a base model: system text, then ``Question: ...\nAnswer: ...`` per turn,
    ending with the open ``Answer:`` the model continues."""
    lines: list[str] = []
    for message in messages:
        role, content = message.get("role"), str(message.get("content", ""))
        if role == "user":
            lines.append(PLAIN_QUESTION.format(content))
        elif role == "assistant" and lines:
            lines[-1] += f" {content.strip()}"
        else:
            lines.append(content)
    return "\n".join(lines)


def encode_prompt(tokenizer, prompt: Prompt, *, chat: bool = True) -> list[int]:
    """Token ids of a prompt with ``tokenizer``: a user message (its chat template applied, when it has one; the
    plain :func:`plain_prompt` form when it has none), a list of chat messages, or raw text (``chat=False``).
    Empty prompts raise :class:`PromptError`."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError("the prompt is empty")
        if not chat:
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    if not prompt:
        raise PromptError("the conversation is empty")
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(plain_prompt(list(prompt)))
    ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def assemble(spec: EngineSpec, *, backend: Backend | None = None) -> "Engine":
    """The composition root: the engine ``spec`` describes, each piece built once (``backend``: a loaded backend to
    reuse, e.g. the target alone next to Kangaroo on the same weights). See :mod:`kangaroo_core.assembly`."""
    pieces = build_pieces(spec, backend)
    return Engine(pieces.backend, pieces.drafter, pieces.policy, pieces.verifier, pieces.config, tree=pieces.tree,
                  spec=spec)


def _asked_layer(exit_layer: int | None, config: DecodeConfig) -> int | None:
    """``Engine.build``'s exit layer: given, else ``config.exit_layer`` when set to other than the default (a config
    cannot tell an explicit default apart), else None, the drafter's trained layer."""
    if exit_layer is None and config.exit_layer != DEFAULT_EXIT_LAYER:
        return config.exit_layer
    return exit_layer


class Engine:
    """A Kangaroo decoder composed of a backend, a drafter, a stopping policy and a verifier.

    Build it from a description with :func:`assemble` (or :meth:`build`), or from objects::

        engine = Engine(backend, KangarooDrafter(), ThresholdPolicy(eta=0.6), GreedyVerifier(), DecodeConfig())

    ``drafter=None`` gives the target alone (one token per pass, the reference for losslessness and speed).
    ``drafter_bound=True``: the drafter is bound to ``backend`` already (:meth:`for_stream`'s forks).
    """

    def __init__(
        self,
        backend: Backend,
        drafter: SelfDrafter | None,
        policy: StoppingPolicy,
        verifier: Verifier,
        config: DecodeConfig = DecodeConfig(),
        tree: TreeShaper | None = None,
        spec: EngineSpec | None = None,
        *,
        drafter_bound: bool = False,
    ):
        if backend.exit_layer != config.exit_layer:
            raise ConfigError(f"exit_layer: backend is split at layer {backend.exit_layer} but config.exit_layer={config.exit_layer}")
        check_sampling(verifier, config.sampling)
        if drafter is not None and getattr(backend, "inexact_multi_position", None):
            raise ConfigError(f"drafting on this backend would not be lossless: {backend.inexact_multi_position}")
        self.backend, self.drafter, self.policy, self.verifier, self.config = backend, drafter, policy, verifier, config
        #: the description this engine was assembled from (None for an engine made of objects by hand)
        self.spec = spec
        self.tree = tree if drafter is not None else None
        if drafter is not None and not drafter_bound:  # a fork (for_stream) is bound to its stream's cache already
            drafter.bind(backend)
        policy.bind(backend)
        if drafter is not None:
            policy.bind_engine(self)
        if self.tree is not None:
            self._check_tree()
            self.tree.bind(backend, policy)

    def _check_tree(self) -> None:
        """Token trees need every piece's tree support; refused in one line otherwise."""
        name = self.tree.name or type(self.tree).__name__
        if not getattr(self.backend, "supports_trees", False):
            raise ConfigError(f"tree '{name}': the '{self.backend.name}' backend cannot verify token trees (torch and onnx can)")
        if not getattr(self.drafter, "drafts_trees", False):
            raise ConfigError(f"tree '{name}': the '{self.drafter.name or type(self.drafter).__name__}' drafter "
                              "cannot draft token trees (the kangaroo drafter can)")
        if type(self.verifier).verify_tree is Verifier.verify_tree:
            raise ConfigError(f"tree '{name}': the '{self.verifier.name or type(self.verifier).__name__}' verifier "
                              "cannot verify token trees (greedy and speculative can)")
        if self.config.sampling.sample_drafts and not self.config.sampling.greedy:
            raise ConfigError(f"tree '{name}': tree candidates are the drafter's top-k (point masses); "
                              "--draft-sampling does not apply to trees")

    @classmethod
    def build(
        cls,
        model: str | None = None,
        *,
        device: str | None = None,
        dtype: str | None = None,
        config: DecodeConfig = DecodeConfig(),
        backend: str | Backend = "torch",
        drafter: str | SelfDrafter | None = DEFAULT_DRAFTER,
        policy: str | StoppingPolicy = DEFAULT_POLICY,
        verifier: str | Verifier = "auto",
        adapter: str | None = None,
        exit_layer: int | None = None,
        backend_options: dict | None = None,
        drafter_options: dict | None = None,
        policy_options: dict | None = None,
        verifier_options: dict | None = None,
        tree: str | TreeShaper | None = None,
        tree_options: dict | None = None,
    ) -> "Engine":
        """:func:`assemble` an :class:`~kangaroo_core.assembly.EngineSpec` of these pieces (plugin names or objects).

        ``device`` (``cpu``, ``cuda``, ``cuda:N``) and ``dtype`` go to the backend. ``exit_layer=None`` splits at ``config.exit_layer`` when it is set to other than the default, else at the
        layer the drafter's adapter was trained at for this model (the default when it has none).
        ``verifier="auto"`` is greedy at temperature 0 and speculative sampling otherwise. ``tree`` (e.g.
        ``"dynamic"``, options ``budget``, ``topk``, ``depth``) drafts a token tree per round instead of a chain.
        """
        return assemble(EngineSpec(model=model, device=device, dtype=dtype, config=config, backend=backend, drafter=drafter, policy=policy,
                                   verifier=verifier, adapter=adapter,
                                   exit_layer=_asked_layer(exit_layer, config),
                                   backend_options=backend_options, drafter_options=drafter_options,
                                   policy_options=policy_options, verifier_options=verifier_options, tree=tree,
                                   tree_options=tree_options))

    def for_stream(self, view: Backend, sampling: SamplingConfig | None = None, *,
                   drafter: SelfDrafter | None = None) -> "Engine":
        """An engine for one more stream of this engine's pieces, bound as building an engine binds them (nothing is
        reloaded): how :class:`~kangaroo_core.batching.Batch` makes each stream's engine.

        ``view`` is where the stream decodes: a :meth:`Backend.stream_view` of this engine's backend (a KV cache of
        its own; a batch passes a wrapper that merges its passes with other streams'), or this engine's backend
        itself. ``drafter`` is the stream's drafter, bound to ``view``'s cache already (default: this engine's
        drafter forked onto ``view``). The policy and the tree shaper are fresh shallow copies bound to the new
        engine, so a stateful policy decides for its own stream only; the verifier is built again for ``sampling``
        (default: this engine's) when the spec names it, else copied (its random generator is per generation).
        """
        config = self.config if sampling is None else self.config.replace(sampling=sampling)
        if drafter is None and self.drafter is not None:
            drafter = self.drafter.fork(view)
        return Engine(view, drafter, copy.copy(self.policy), self._verifier_for(config.sampling), config,
                      tree=copy.copy(self.tree), spec=self.spec, drafter_bound=True)

    def with_sampling(self, sampling: SamplingConfig) -> "Engine":
        """This engine's loaded pieces (backend, drafter: nothing is reloaded) decoding with ``sampling``.

        For per-request sampling settings (``model.generate``). A verifier named in the spec is built again for
        ``sampling`` (it holds the target's processing), "auto" choosing greedy or speculative by the new
        temperature. The copy shares the backend's and the drafter's caches with this engine: decode with one of
        them at a time.
        """
        return self.for_stream(self.backend, sampling, drafter=self.drafter)

    def _verifier_for(self, sampling: SamplingConfig) -> Verifier:
        if self.spec is not None and isinstance(self.spec.verifier, str):
            return build_verifier(self.spec, self.config.replace(sampling=sampling))
        if getattr(self.verifier, "sampling", sampling) != sampling:  # an object holding other processing
            raise ConfigError("this engine's verifier object was built for other sampling settings; build the engine "
                              "with the verifier by name to change sampling per generation")
        return copy.copy(self.verifier)  # its random generator is per generation: one verifier per stream

    # -- prompts ---------------------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, *, chat: bool = True) -> list[int]:
        """Token ids of a prompt: a user message (chat template applied), a list of chat messages, or raw text."""
        return encode_prompt(self.backend.tokenizer, prompt, chat=chat)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse (:class:`PromptError`, one line) an empty prompt or one whose new tokens would not fit the context."""
        if prompt_len == 0:
            raise PromptError("the prompt is empty")
        limit = self.backend.max_context
        if prompt_len + max_new_tokens > limit:
            raise PromptError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of {limit} tokens"
            )

    # -- public API ------------------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, *, chat: bool = True, max_new_tokens: int | None = None) -> GenerationResult:
        """Decode one prompt; returns text, token ids and stats."""
        return self.generate_ids(self.encode(prompt, chat=chat), max_new_tokens)

    def generate_ids(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> GenerationResult:
        """Decode from prompt token ids (no template)."""
        stream = TextStream(self, list(prompt_ids), self.token_budget(max_new_tokens))
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: Prompt, *, chat: bool = True, max_new_tokens: int | None = None) -> "TextStream":
        """Iterate over text pieces as they are accepted; ``.result`` holds the :class:`GenerationResult` after."""
        return TextStream(self, self.encode(prompt, chat=chat), self.token_budget(max_new_tokens))

    def batch(self, max_batch: int = 4) -> "Batch":
        """Decode many prompts together (continuous batching, each stream lossless as if alone): see
        :class:`~kangaroo_core.batching.Batch`."""
        from kangaroo_core.batching import Batch

        return Batch(self, max_batch)

    def generate_many(self, prompts: Sequence, *, max_batch: int = 4, **options: Any) -> list[GenerationResult]:
        """Decode every prompt, up to ``max_batch`` at once; results in input order (options: ``chat``,
        ``max_new_tokens``, ``sampling``)."""
        return self.batch(max_batch).generate(prompts, **options)

    def token_budget(self, max_new_tokens: int | None) -> int:
        """New tokens a generation may make: ``max_new_tokens`` (checked like the config's), default the config's."""
        if max_new_tokens is None:
            return self.config.max_new_tokens
        return self.config.replace(max_new_tokens=max_new_tokens).max_new_tokens  # validated like the config

    # -- the loop --------------------------------------------------------------------------------------------------
    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> Generator[Emitted, None, GenerationResult]:
        """Yield the tokens each round emits (an :class:`~kangaroo_core.results.Emitted` list: which of them are
        accepted drafts); return the :class:`GenerationResult`.

        ``seconds`` counts the engine's own work only: the clock stops at every ``yield`` and restarts when the
        consumer asks for more, so a slow consumer (printing, a network client) never shows up as decoding time.
        """
        self.token_budget(max_new_tokens)
        self.check_fits(len(prompt_ids), max_new_tokens)
        backend, drafter = self.backend, self.drafter
        eos = backend.eos_token_ids
        if drafter is not None:  # not timed: e.g. the oracle's reference run of the target alone
            self.policy.prepare(self, list(prompt_ids), max_new_tokens)
        busy, resumed = 0.0, time.perf_counter()
        backend.reset()
        if drafter is not None:
            drafter.reset()
        generator = make_generator(self.config.sampling.seed)
        self.verifier.begin(generator)

        # 0. prefill: M[:l] then M[l:] over the prompt (LM head on the last row only); the first token is the target's.
        tokens = list(prompt_ids)
        h_prompt = backend.shallow(tokens, 0)
        prefill = backend.deep(h_prompt, 0, rows=[len(tokens) - 1])
        first = self.verifier.verify([], prefill.logits)
        if drafter is not None and drafter.wants_deep_states:
            drafter.observe_deep(0, prefill.hidden)
        unseen = h_prompt  # layer-l states of positions drafter.seen.. that the drafter has not consumed yet
        output = [first.next_token]
        busy += time.perf_counter() - resumed
        yield Emitted(output)
        resumed = time.perf_counter()
        rounds: list[RoundResult] = []

        while output[-1] not in eos and len(output) < max_new_tokens:
            tokens = list(prompt_ids) + output  # tokens[-1] is x_n, the last committed token (not through M[:l] yet)
            budget = max_new_tokens - len(output)
            max_drafts = min(self.config.gamma, budget - 1) if drafter is not None else 0
            if max_drafts > 0:  # 0: the target's plain step, no drafter work this round
                max_drafts = self.policy.round_budget(max_drafts)
            if self.tree is not None and max_drafts > 0:  # a token tree instead of a chain (kangaroo_core.tree_round)
                done = tree_round(self, tokens, unseen, min(self.tree.depth, budget - 1), budget)
                emitted, m, drafted, unseen = done.emitted, done.accepted, done.drafted, done.unseen
                timings, dropped = (done.draft_seconds, done.verify_seconds), 0
            else:
                emitted, m, drafted, dropped, unseen, timings = self._chain_round(tokens, unseen, max_drafts, budget,
                                                                                  generator)

            output.extend(emitted)
            rounds.append(RoundResult(drafted, m, len(emitted), *timings, dropped=dropped))
            busy += time.perf_counter() - resumed
            yield Emitted(emitted, from_drafts=min(m, len(emitted)), drafted=drafted)
            resumed = time.perf_counter()

        # a backend built around a bare model object (model.generate) may have no tokenizer: ids only, no text
        text = backend.tokenizer.decode(output, skip_special_tokens=True) if backend.tokenizer is not None else ""
        return GenerationResult(
            text=text,
            token_ids=output,
            prompt_tokens=len(prompt_ids),
            rounds=rounds,
            seconds=busy + time.perf_counter() - resumed,
            gamma=self.config.gamma,
            stopped_on_eos=output[-1] in eos,
        )

    def _chain_round(self, tokens: list[int], unseen: torch.Tensor, max_drafts: int, budget: int,
                     generator: torch.Generator):
        """One chain round (steps 1-5 of the paper's loop); returns (emitted, m, drafted, dropped, unseen, timings)."""
        backend, drafter = self.backend, self.drafter
        eos = backend.eos_token_ids
        n = len(tokens) - 1
        t0 = time.perf_counter()

        # 1. first early exit for x_n: its layer-l state starts this round's saved states.
        h_last = backend.shallow(tokens[-1:], n)  # [1, d]
        if drafter is not None:
            unseen = torch.cat([unseen, h_last])

        # 2. draft_tokens: adapter + shared head, until the policy (second early exit) or gamma stops us.
        drafts, h_drafts, unseen, dropped = self.draft_tokens(tokens, unseen, max_drafts, generator)
        t1 = time.perf_counter()

        # 3. target_logits: one pass of M[l:] over the saved layer-l states of x_n, d_1..d_k.
        verified = backend.deep(torch.cat([h_last, *h_drafts]), n)  # logits [k+1, V], hidden [k+1, d]
        verdict: Verdict = self.verifier.verify(drafts, verified.logits)
        m = self._chain_length(verdict, len(drafts))
        if drafts:
            self.policy.end_round(drafts, m)

        # 4. accept: d_1..d_m + the target's token, cut at EOS and at the token budget.
        emitted = cut_at_eos([d.token for d in drafts[:m]] + [verdict.next_token], eos, budget)

        # 5. roll back every cache to x_n, d_1..d_m (the next round starts with the target's token).
        accepted_len = n + 1 + m
        backend.crop(accepted_len)
        unseen = self._rollback_drafter(unseen, accepted_len)
        if drafter is not None and drafter.wants_deep_states:
            drafter.observe_deep(n, verified.hidden[: m + 1])
        t2 = time.perf_counter()

        return emitted, m, len(drafts), dropped, unseen, (t1 - t0, t2 - t1)

    def draft_tokens(
        self,
        tokens: list[int],
        unseen: torch.Tensor,
        max_drafts: int,
        generator: torch.Generator,
    ) -> tuple[list[DraftStep], list[torch.Tensor], torch.Tensor, int]:
        """Propose up to ``max_drafts`` tokens after ``tokens``.

        ``unseen``: the layer-l states of positions ``drafter.seen..len(tokens)-1``. Each draft is the drafter's
        top-1 (greedy drafting: q is a point mass), or, with ``SamplingConfig.sample_drafts`` at temperature > 0, a
        draw from its processed distribution q. Returns the drafts, their layer-l states (one [1, d] each, to be
        verified), the states the drafter has still not seen (h(d_k) after the last draft) and how many drafts
        were proposed but dropped unverified (0 or 1: the policy found a verify row for it not worth its cost).
        """
        drafts: list[DraftStep] = []
        states: list[torch.Tensor] = []
        if max_drafts == 0:
            return drafts, states, unseen, 0
        self.policy.start_round(tokens)
        sampling = self.config.sampling
        sample_drafts = sampling.sample_drafts and not sampling.greedy
        sequence = list(tokens)
        while len(drafts) < max_drafts:
            logits = self.drafter.advance(sequence, unseen)
            unseen = unseen[:0]
            if logits is None:
                break
            step = DraftStep.from_logits(logits, index=len(drafts) + 1)  # top-1; q is a point mass on it
            if sample_drafts:  # q = the drafter's processed distribution, and the draft is a draw from it
                proposal = target_probs(logits, sampling)
                step = attrs.evolve(step, token=draw(proposal, generator), proposal=proposal)
            if not self.policy.worth_verifying(step):  # the drafter has read x_n..: nothing to roll back
                return drafts, states, unseen, 1
            drafts.append(step)
            # the draft's layer-l state: needed to verify it, and by the drafter if we continue
            h = self.backend.shallow([step.token], len(sequence))
            sequence.append(step.token)
            states.append(h)
            unseen = h
            if step.token in self.backend.eos_token_ids:  # nothing after an EOS draft could ever be emitted
                break
            if not self.policy.keep_drafting(step):
                break
        return drafts, states, unseen, 0

    @staticmethod
    def _chain_length(verdict: Verdict, drafted: int) -> int:
        """The chain loop accepts a prefix of its drafts; any other path is a verifier bug (and would not be lossless)."""
        m = verdict.accepted
        if verdict.path != tuple(range(m)) or m > drafted:
            raise RuntimeError(f"verifier returned path {verdict.path} for a chain of {drafted} drafts; a chain "
                               f"verifier must accept a prefix 0..m-1")
        return m

    def _rollback_drafter(self, unseen: torch.Tensor, accepted_len: int) -> torch.Tensor:
        """Forget the drafter's positions past ``accepted_len``; keep the unseen states of accepted positions."""
        if self.drafter is None:
            return unseen
        seen = self.drafter.seen
        if seen > accepted_len:
            self.drafter.crop(accepted_len)
            return unseen[:0]
        return unseen[: accepted_len - seen]


class TextStream(Iterator[str]):
    """Text pieces of one generation, decoded incrementally (never splitting a multi-byte character)."""

    def __init__(self, engine: Engine, prompt_ids: list[int], max_new_tokens: int):
        self._pieces = TextPieces(engine.backend.tokenizer)
        self._loop = engine.decode(prompt_ids, max_new_tokens)
        self._backend = engine.backend
        self.result: GenerationResult | None = None

    def __next__(self) -> str:
        if self.result is not None:  # finished: the loop is exhausted and its result already taken
            raise StopIteration
        while True:
            try:
                with host_threads(self._backend):  # set per token: the consumer's own work keeps its threads
                    new = next(self._loop)
            except StopIteration as stop:
                self.result = stop.value
                tail = self._pieces.finish(self.result.text)
                if tail:
                    return tail
                raise
            piece = self._pieces.add(new)
            if piece:
                return piece
