"""One token-tree round of the decode loop (see :mod:`kangaroo_core.tree` for the glossary).

    1. root          M[:l] on x_n (slot n); the drafter consumes its unseen states and proposes the root's children.
    2. grow          per depth, the nodes the shaper expands go through M[:l] and the drafter in one batched pass
                     with the tree mask (each sees the prefix and its ancestors) and propose their children.
    3. select        the shaper picks at most ``budget`` nodes (ancestor-closed); selected leaves that never went
                     through M[:l] get their layer-l states in one more batched pass.
    4. verify        the shallow cache is compacted to prefix + root + selected nodes (verify order); one pass of
                     M[l:] over their saved layer-l states with the tree mask gives the target's logits of every row.
    5. accept/keep   the verifier names a root path; every cache (shallow, deep, the drafter's) keeps exactly it.

M[:l] runs once per node, as in the chain; M[l:] once per round. The chain is the tree whose every node has one
child (the ``chain`` shaper reproduces the chain's drafts exactly).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import torch

from kangaroo_core.results import cut_at_eos
from kangaroo_core.tree import DraftTree, TreeAttention, VerifyTree


@attrs.frozen
class TreeRound:
    """What one tree round produced (the engine turns it into a :class:`~kangaroo_core.results.RoundResult`)."""

    emitted: list[int]
    accepted: int
    drafted: int  # nodes verified (the root not counted)
    unseen: torch.Tensor  # layer-l states of accepted positions the drafter has not consumed
    draft_seconds: float
    verify_seconds: float


def _attention(tree: DraftTree, nodes: Sequence[int], slot: dict[int, int], first_slot: int,
               committed: int, base: int) -> TreeAttention:
    """Rows for ``nodes`` placed at slots first_slot..; each sees slots < committed, its ancestors' and its own."""
    own = {node: first_slot + i for i, node in enumerate(nodes)}
    visible = []
    for node in nodes:
        path = tree.ancestors(node)  # depth 1 .. node
        visible.append(sorted(own[a] if a in own else slot[a] for a in path))
    return TreeAttention(committed=committed, visible=visible, positions=[base + tree.depths[v] for v in nodes])


def tree_round(engine, tokens: list[int], unseen: torch.Tensor, max_depth: int, token_budget: int) -> TreeRound:
    """Draft, verify and accept one token tree after ``tokens`` (prompt + output; x_n = tokens[-1]); ``max_depth``
    drafts at most on any path, ``token_budget`` tokens may still be emitted."""
    backend, drafter, shaper = engine.backend, engine.drafter, engine.tree
    eos = backend.eos_token_ids
    n = len(tokens) - 1
    t0 = time.perf_counter()

    # 1. root: x_n through M[:l] (slot n); the drafter's distribution after it gives the first children
    h_root = backend.shallow(tokens[-1:], n)  # [1, d]
    unseen = torch.cat([unseen, h_root])
    tree = DraftTree(tokens=[tokens[-1]])
    states: dict[int, torch.Tensor] = {0: h_root[0]}
    slot: dict[int, int] = {0: n}  # node -> slot in the shallow cache and the drafter's cache while drafting
    expanded: set[int] = {0}
    shaper.start_round(tokens, engine.policy)
    root_logits = drafter.advance(tokens, unseen)  # [V]; the drafter has now seen slots 0..n
    frontier = _grow(tree, shaper, 0, root_logits) if root_logits is not None else []
    next_slot = n + 1

    # 2. grow: one batched pass of M[:l] + the drafter per depth over the nodes the shaper expands
    for _ in range(1, max_depth):
        frontier = [v for v in frontier if tree.tokens[v] not in eos]  # nothing after an EOS could be emitted
        chosen = shaper.expand(tree, frontier) if frontier else []
        if not chosen:
            break
        attention = _attention(tree, chosen, slot, next_slot, committed=n + 1, base=n)
        h = backend.shallow([tree.tokens[v] for v in chosen], next_slot, tree=attention)  # [m, d]
        paths = [[tree.tokens[a] for a in tree.ancestors(v)] for v in chosen]
        logits = drafter.advance_tree(tokens, paths, h, next_slot, attention)  # [m, V]
        frontier = []
        for i, v in enumerate(chosen):
            slot[v], states[v] = next_slot + i, h[i]
            expanded.add(v)
            frontier.extend(_grow(tree, shaper, v, logits[i]))
        next_slot += len(chosen)

    # 3. select (ancestor-closed, at most the budget, no deeper than the token budget allows); leaves' states
    selected = sorted((v for v in shaper.select(tree) if tree.depths[v] <= max_depth),
                      key=lambda v: (tree.depths[v], v))[: shaper.budget]
    _check_closed(tree, selected)
    missing = [v for v in selected if v not in states]
    if missing:
        attention = _attention(tree, missing, slot, next_slot, committed=n + 1, base=n)
        h = backend.shallow([tree.tokens[v] for v in missing], next_slot, tree=attention)
        for i, v in enumerate(missing):
            slot[v], states[v] = next_slot + i, h[i]
    # verify rows in slot order: ascending compaction, and a parent (expanded earlier) always before its children
    order = sorted(selected, key=lambda v: slot[v])
    t1 = time.perf_counter()

    # 4. verify: compact the shallow cache to prefix + root + selected (verify order), one pass of M[l:]
    row = {0: 0, **{v: i + 1 for i, v in enumerate(order)}}
    backend.keep([*range(n + 1), *(slot[v] for v in order)])  # the deep cache holds n slots: untouched
    visible = [(n,)] + [tuple([n] + [n + row[a] for a in tree.ancestors(v)]) for v in order]
    verify_attention = TreeAttention(committed=n, visible=visible, positions=[n] + [n + tree.depths[v] for v in order])
    verified = backend.deep(torch.stack([states[0]] + [states[v] for v in order]), n, tree=verify_attention)
    view = VerifyTree(tokens=(tokens[-1], *(tree.tokens[v] for v in order)),
                      parents=(-1, *(row[tree.parents[v]] for v in order)))
    verdict = engine.verifier.verify_tree(view, verified.logits)
    path = [r + 1 for r in verdict.path]  # verify rows
    _check_path(view, path)

    # 5. accept the path + the target's token (cut at EOS and at the token budget); keep exactly the path
    emitted = cut_at_eos([view.tokens[r] for r in path] + [verdict.next_token], eos, token_budget)
    backend.keep([*range(n + 1), *(n + r for r in path)])
    nodes = [order[r - 1] for r in path]
    drafter.keep([*range(n + 1), *(slot[v] for v in nodes if v in expanded)])
    last = nodes[-1] if nodes else 0
    unseen = states[last][None] if last not in expanded else h_root[:0]
    if drafter.wants_deep_states:  # x_n and the accepted nodes, as the chain round hands them over
        drafter.observe_deep(n, verified.hidden[[0, *path]])
    return TreeRound(emitted, len(path), len(order), unseen, t1 - t0, time.perf_counter() - t1)


def _grow(tree: DraftTree, shaper, node: int, logits: torch.Tensor) -> list[int]:
    """Add the shaper's children of ``node`` from the drafter's logits there; return the new nodes."""
    probs = torch.softmax(logits.float(), dim=-1)
    added = []
    for token in shaper.children(tree, node, probs):
        p = float(probs[token])
        added.append(tree.add(node, token, p, float(torch.log(probs[token].clamp_min(1e-30)))))
    return added


def _check_closed(tree: DraftTree, order: Sequence[int]) -> None:
    chosen = set(order)
    for v in order:
        if tree.parents[v] != 0 and tree.parents[v] not in chosen:
            raise RuntimeError(f"tree shaper selected node {v} without its parent {tree.parents[v]}: a selection "
                               "must be ancestor-closed")


def _check_path(view: VerifyTree, path: Sequence[int]) -> None:
    """A verdict must name a root path; anything else is a verifier bug (and would not be lossless)."""
    parent = 0
    for r in path:
        if not 0 < r < len(view.tokens) or view.parents[r] != parent:
            raise RuntimeError(f"tree verifier returned rows {list(path)}, not a root path of the tree")
        parent = r
