"""One round replay, shared by policy analysis and adapter-training evaluation: the rounds greedy Kangaroo decoding
runs on a known greedy answer, computed from teacher-forced drafts without decoding again.

Why a replay is exact: under greedy decoding a draft continues only while it equals the target's own greedy token,
so every draft the engine ever *accepts* was made from the true prefix. The drafter's prediction at answer position j
with the true prefix (teacher forcing) is therefore exactly the draft the engine would make there, with the same
confidence — for any policy, eta and gamma:

* a round starting after answer token j drafts positions j+1, j+2, ... and stops at the first wrong draft (the verify
  rejects it), when the policy says stop (that draft is still proposed), at gamma drafts, or at the token budget;
* the policy sees the same :class:`DraftStep` objects (index, token, probs, confidence) the engine would show it.

Drafts *after* a wrong draft (made from a wrong prefix) change only how many drafts a round proposes, never what it
accepts: :func:`replay_answer` records them (``off_path``) so policies that keep drafting past a rejection replay
exactly; an :class:`Answer` built without them (training evaluation) replays accepted / emitted counts exactly and
drafted counts as a lower bound.

Glossary: ``correct[j]`` — the draft for answer token j+1 equals it (accepted if reached); ``confidence[j]`` — that
draft's top-1 probability.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from kangaroo_core.errors import KangarooError
from kangaroo_core.interfaces import Backend, SelfDrafter, StoppingPolicy
from kangaroo_core.results import DraftStep, RoundResult


@attrs.frozen
class Answer:
    """One question turn: the target's greedy answer and every draft the engine could make along it.

    ``steps[k]``: the draft for ``answer[k + 1]`` made from the true prefix (None: the drafter proposed nothing).
    ``off_path[k]``: when ``steps[k]`` is wrong, the drafts that would follow it in the same round (made from the
    wrong prefix, up to gamma − 1 of them), for policies that keep drafting past a draft the target will reject.
    ``depth_steps[j][k]`` (drafters that read deep states): the draft for ``answer[k + 1]`` at draft depth j of a
    round, i.e. with deep states verified up to j + 1 positions before it; ``steps`` is then ``depth_steps[0]``.
    Rounds deeper than the list use its last depth.
    """

    subtask: str
    prompt_ids: list[int]
    answer: list[int]
    steps: list[DraftStep | None] = attrs.field(eq=False, repr=False)
    off_path: dict[int, list[DraftStep]] = attrs.field(eq=False, repr=False)
    max_new_tokens: int
    eos: frozenset[int] = frozenset()
    depth_steps: list[list[DraftStep | None]] | None = attrs.field(default=None, eq=False, repr=False)

    def step_at(self, k: int, depth: int) -> DraftStep | None:
        """The draft for ``answer[k + 1]`` made at draft ``depth`` of its round."""
        if self.depth_steps is None:
            return self.steps[k]
        return self.depth_steps[min(depth, len(self.depth_steps) - 1)][k]

    @property
    def correct(self) -> list[bool]:
        return [s is not None and s.token == self.answer[k + 1] for k, s in enumerate(self.steps)]

    @property
    def confidence(self) -> list[float]:
        return [0.0 if s is None else s.confidence for s in self.steps]


def _step(logits: torch.Tensor | None) -> DraftStep | None:
    """A draft exactly as the engine builds it (index fixed later, per replayed round)."""
    return None if logits is None else DraftStep.from_logits(logits, index=1)


@torch.inference_mode()
def replay_answer(backend: Backend, drafter: SelfDrafter, subtask: str, prompt_ids: Sequence[int],
                  answer: Sequence[int], *, gamma: int, max_new_tokens: int) -> Answer:
    """Walk the answer once with the true prefix (teacher forcing) and branch off at every wrong draft."""
    if drafter.wants_deep_states:
        adapter = getattr(drafter, "adapter", None)
        if not getattr(adapter, "reads_deep_states", False):
            raise KangarooError(f"the exact replay does not model drafters that read the target's deep states "
                                f"('{drafter.name}'): its drafts depend on which earlier drafts were accepted")
        return _deep_context_answer(backend, drafter, subtask, prompt_ids, answer, gamma=gamma,
                                    max_new_tokens=max_new_tokens)
    prompt, answer = list(prompt_ids), list(answer)
    eos = frozenset(backend.eos_token_ids)
    tokens = prompt + answer
    p, m = len(prompt), len(answer)
    backend.reset()
    drafter.reset()
    steps: list[DraftStep | None] = []
    off_path: dict[int, list[DraftStep]] = {}
    if m < 2:
        return Answer(subtask, prompt, answer, steps, off_path, max_new_tokens, eos)
    logits = drafter.advance(tokens[: p + 1], backend.shallow(tokens[: p + 1], 0))
    for k in range(m - 1):  # the drafter has seen positions 0..p+k; steps[k] predicts answer[k + 1]
        step = _step(logits)
        steps.append(step)
        seen = p + k + 1
        if step is not None and step.token != answer[k + 1] and step.token not in eos and gamma > 1:
            branch, sequence, token = [], tokens[:seen], step.token
            for _ in range(gamma - 1):  # exactly what the engine drafts next from the wrong prefix
                sequence = sequence + [token]
                nxt = _step(drafter.advance(sequence, backend.shallow([token], len(sequence) - 1)))
                if nxt is None:
                    break
                branch.append(nxt)
                if nxt.token in eos:
                    break
                token = nxt.token
            off_path[k] = branch
            backend.crop(seen)
            drafter.crop(seen)
        if k + 1 < m - 1:
            logits = drafter.advance(tokens[: seen + 1], backend.shallow([answer[k + 1]], seen))
    return Answer(subtask, prompt, answer, steps, off_path, max_new_tokens, eos)


@torch.inference_mode()
def _deep_context_answer(backend: Backend, drafter: SelfDrafter, subtask: str, prompt_ids: Sequence[int],
                         answer: Sequence[int], *, gamma: int, max_new_tokens: int) -> Answer:
    """The replay of a deep-context adapter: its draft at answer position k depends on the round's depth (how many
    positions before it are verified), so it is computed at every depth 0..gamma-1 from one teacher-forced pass of
    the target (layer-l and deep states of the whole answer) and the adapter's training pass, which builds exactly
    the keys each depth sees (:meth:`DeepContextAdapter.forward_depths`). Drafts made after a rejected one are not
    modelled (``off_path`` is empty): accepted / emitted counts are exact, drafted counts a lower bound."""
    prompt, answer = list(prompt_ids), list(answer)
    eos = frozenset(backend.eos_token_ids)
    p, m = len(prompt), len(answer)
    if m < 2:
        return Answer(subtask, prompt, answer, [], {}, max_new_tokens, eos)
    tokens = prompt + answer[:-1]
    backend.reset()
    shallow = backend.shallow(tokens, 0)  # [N, d]
    deep = backend.deep(shallow, 0, rows=[len(tokens) - 1]).hidden  # [N, d]
    backend.reset()
    adapter = drafter.adapter
    dtype = next(adapter.parameters()).dtype
    head = adapter.drafting_head(backend.shared_head())
    outs = adapter.forward_depths(shallow[None].to(dtype), deep[None].to(dtype), list(range(gamma)), first_query=p)
    # row p + k - 1 (k >= 1) drafts answer[k]; steps[k - 1] is that draft
    by_depth = [[_step(head(out[0, p + k - 1])) if k - 1 >= depth else None for k in range(1, m)] for depth, out in
                enumerate(outs)]
    return Answer(subtask, prompt, answer, by_depth[0], {}, max_new_tokens, eos, depth_steps=by_depth)


def _round_drafts(answer: Answer, j: int):
    """(draft, on the target's path) for the drafts of a round that starts after ``answer[j]``, in order."""
    for k in range(j, len(answer.steps)):
        step = answer.step_at(k, k - j)
        if step is None:
            return
        ok = step.token == answer.answer[k + 1]
        yield step, ok
        if not ok:
            for off in answer.off_path.get(k, []):
                yield off, False
            return


def simulate_policy(answer: Answer, policy: StoppingPolicy, gamma: int) -> list[RoundResult]:
    """The rounds (drafted, accepted, emitted; no timings) the engine would run with ``policy`` on this greedy answer.

    Mirrors :meth:`Engine.decode`: at most min(gamma, budget − 1) drafts, the policy asked about each draft before it
    is counted (``worth_verifying``: a dropped one ends the round's drafting) and after it, drafting
    stops after a draft that is EOS or when the drafter has nothing to propose; the verify accepts the drafts up to
    the first one off the target's path.
    """
    m = len(answer.answer)
    rounds: list[RoundResult] = []
    j = 0  # the output so far is answer[: j + 1]
    tokens = list(answer.prompt_ids) + answer.answer[:1]
    while j + 1 < m:
        max_drafts = min(gamma, answer.max_new_tokens - (j + 1) - 1)
        accepted = drafted = dropped = 0
        on_path = True
        if max_drafts > 0:
            policy.start_round(tokens)  # as the engine does (the default calls begin_round)
            for step, ok in _round_drafts(answer, j):
                step = attrs.evolve(step, index=drafted + 1)
                if not policy.worth_verifying(step):  # dropped unverified, as the engine does
                    dropped = 1
                    break
                drafted += 1
                on_path = on_path and ok
                accepted += on_path
                if step.token in answer.eos or drafted == max_drafts:
                    break
                if not policy.keep_drafting(step):
                    break
        emitted = answer.answer[j + 1: j + accepted + 2]
        if answer.answer[j + accepted] in answer.eos and accepted:  # an accepted EOS draft ends the answer there
            emitted = emitted[:accepted]
        rounds.append(RoundResult(drafted, accepted, len(emitted), 0.0, 0.0, dropped=dropped))
        tokens = tokens + emitted
        j += len(emitted)
    return rounds


