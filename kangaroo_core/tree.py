"""Token trees: several candidates per round, verified in one pass (EAGLE-2 drafting, SpecInfer-style verification).

Glossary (one round; ``n`` is the position of x_n, the last committed token, whose layer-l state starts the round):
    node 0       the root: x_n itself (committed; the target's logits after it are verify row 0).
    node i >= 1  a drafted token; ``parents[i] < i``; ``depths[i] = depths[parents[i]] + 1`` (the root has depth 0).
    path         the accepted nodes, root excluded, from depth 1 down: what the round emits before the target's token.
    slot         where a node's keys/values sit in a cache. The committed prefix holds slots 0..n-1 and the root slot
                 n; drafted nodes get slots n+1.. in the order they go through M[:l].
    position     a node's RoPE position: n + depth (siblings share one).
    score        a node's cumulative draft log-probability along its root path (EAGLE-2's ranking value).
    budget       drafted nodes verified per round (the root not counted); ``topk`` children per expanded node;
                 ``depth`` the longest root path.

A :class:`TreeAttention` says which cached slots every new row may attend to: every committed slot (< ``committed``)
and its own ancestors' slots and its own. The chain is the tree whose every node has one child.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


@attrs.frozen
class TreeAttention:
    """Visibility and positions of ``m`` new rows appended at slots ``start..start+m-1``.

    Attributes:
        committed: slots ``0..committed-1`` are seen by every row (the prefix and, usually, the root).
        visible: per row, the slots >= ``committed`` it sees (its ancestors' and its own), ascending.
        positions: per row, its RoPE position.
    """

    committed: int
    visible: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda rows: tuple(tuple(r) for r in rows))
    positions: tuple[int, ...] = attrs.field(converter=tuple)

    def allowed(self, total: int, device=None, window: int | None = None) -> torch.Tensor:
        """[m, total] bool: row i may read slot j. ``window`` (sliding-window layers): row i, at position p_i, does
        not read committed slots at positions <= p_i - window (its ancestors are always nearer than that)."""
        if window is not None and self.positions and max(self.positions) - self.committed >= window:
            raise ValueError(f"a token tree {max(self.positions) - self.committed + 1} deep does not fit a "
                             f"{window}-position sliding window")
        allowed = torch.zeros(len(self.visible), total, dtype=torch.bool, device=device)
        allowed[:, : self.committed] = True
        for i, slots in enumerate(self.visible):
            if slots:
                allowed[i, list(slots)] = True
            if window is not None and self.positions[i] - window >= 0:
                allowed[i, : min(self.committed, self.positions[i] - window + 1)] = False
        return allowed

    def additive_mask(self, total: int, dtype: torch.dtype, device=None, window: int | None = None) -> torch.Tensor:
        """[1, 1, m, total]: 0 where allowed, the dtype's minimum elsewhere (transformers' mask convention)."""
        allowed = self.allowed(total, device, window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    def position_ids(self, device=None) -> torch.Tensor:
        return torch.as_tensor(self.positions, dtype=torch.long, device=device)


@attrs.define
class DraftTree:
    """The round's candidates. Node 0 is the root; :attr:`scores` rank nodes for expansion and selection."""

    tokens: list[int] = attrs.field(factory=lambda: [-1])
    parents: list[int] = attrs.field(factory=lambda: [-1])
    depths: list[int] = attrs.field(factory=lambda: [0])
    scores: list[float] = attrs.field(factory=lambda: [0.0])
    #: the drafter's probability of the node's token at its parent (for statistics)
    probs: list[float] = attrs.field(factory=lambda: [1.0])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, prob: float, logp: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(self.scores[parent] + logp)
        self.probs.append(prob)
        return len(self.tokens) - 1

    def ancestors(self, node: int) -> list[int]:
        """Nodes from depth 1 down to ``node`` (root excluded; empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node and i > 0]


@attrs.frozen
class VerifyTree:
    """What a verifier sees of a tree: verify row 0 is the root, row r >= 1 the r-th selected node.

    ``parents[r]`` is the row of row r's parent (-1 for the root; a parent's row is always smaller); ``tokens[r]``
    its token; ``children`` per row, in row order. (The order candidates are tried in changes which one is accepted,
    never the distribution of what is emitted.)
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    @property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for r, p in enumerate(self.parents):
            if p >= 0:
                kids[p].append(r)
        return tuple(tuple(k) for k in kids)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "VerifyTree":
        """The chain x_n, d_1..d_k as a tree (root token -1)."""
        return cls((-1, *tokens), tuple(range(-1, len(tokens))))


def greedy_tree_walk(tree: VerifyTree, target_tokens: Sequence[int]) -> tuple[list[int], int]:
    """The longest root path whose every token is the target's argmax after its parent; then the target's token.

    ``target_tokens[r]``: the target's argmax after row r. Returns (rows of the accepted path, next token).
    """
    children = tree.children
    row, path = 0, []
    while True:
        wanted = target_tokens[row]
        match = next((c for c in children[row] if tree.tokens[c] == wanted), None)
        if match is None:
            return path, int(wanted)
        path.append(match)
        row = match


def sample_tree_walk(tree: VerifyTree, p: torch.Tensor, uniform, draw) -> tuple[list[int], int]:
    """Lossless multi-candidate acceptance for point-mass candidates (distinct tokens per parent).

    At row r with candidate children c_1..c_k (the drafter's top-k: each a point-mass proposal), starting from the
    target's distribution p = p[r]: accept c_i with probability p(c_i); on rejection set p(c_i) = 0 and renormalise
    (the residual norm(max(0, p − δ_{c_i}))); after the last rejection draw the emitted token from the residual.
    An accepted child continues the walk with its own row. Each step is a speculative-sampling step with a
    point-mass proposal, so the emitted token is distributed exactly as p[r] (SpecInfer §4, multi-round
    rejection; EAGLE's tree sampling uses the same rule).

    Args:
        tree: the verified token tree (its rows, tokens and children).
        p: the target's processed distributions [rows, V] (float64).
        uniform (Callable[[], float]): a float in [0, 1), from the generation's generator.
        draw (Callable[[torch.Tensor], int]): a token id drawn from probabilities [V], from the generation's generator.
    """
    children = tree.children
    row, path = 0, []
    while True:
        residual = p[row].clone()
        accepted = None
        for c in children[row]:
            token = tree.tokens[c]
            mass = float(residual.sum())
            if mass <= 0:
                break
            if uniform() < float(residual[token]) / mass:
                accepted = c
                break
            residual[token] = 0.0
        if accepted is None:
            if float(residual.sum()) <= 0:  # every token with mass was a rejected candidate: only rounding gets here
                residual = p[row]
            return path, draw(residual / residual.sum())
        path.append(accepted)
        row = accepted


def first_token_distribution(p: torch.Tensor, candidates: Sequence[int]) -> torch.Tensor:
    """Exact distribution of the token :func:`sample_tree_walk` emits first at one row, computed analytically
    (no randomness): the probability each candidate is accepted, plus the residual draw after all rejections.
    Used to check the rule; equals ``p`` for every p and distinct candidates."""
    out = torch.zeros_like(p)
    residual = p.clone()
    reach = 1.0  # probability that every earlier candidate was rejected
    for token in candidates:
        mass = float(residual.sum())
        if mass <= 0:
            break
        accept = float(residual[token]) / mass
        out[token] += reach * accept
        reach *= 1.0 - accept
        residual[token] = 0.0
    if reach > 0 and float(residual.sum()) > 0:
        out += reach * residual / residual.sum()
    return out
