"""Built-in tree shapers (``--tree NAME``): how each round's token tree grows.

* ``dynamic`` — EAGLE-2: every node proposes its ``topk`` most likely tokens; at each depth the ``topk`` newest
  nodes with the highest cumulative draft probability are expanded; the ``budget`` best nodes overall are verified.
  ``budget="auto"`` sizes it from the backend's measured verify-cost curve (:mod:`kangaroo_policies.cost_model`).
* ``chain`` — the paper's chain as a tree of width 1: one child per node, grown while the stopping policy keeps
  drafting (at most ``depth`` = gamma). Same drafts as the chain loop; the reference for the tree machinery.
* ``fan`` — the chain plus the root's runners-up: the first position gets the drafter's ``topk`` candidates (they
  come from the root's own drafter call: extra verify rows, no extra draft pass), and the chain grows below the most
  likely one while the stopping policy keeps drafting.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import TreeShaper
from kangaroo_core.results import DraftStep

#: ``budget="auto"``: the most verified rows whose pass costs at most this many one-position passes (measured).
AUTO_RELATIVE_COST = 1.3
AUTO_MAX_BUDGET = 15
#: on a GPU a verify pass of 64 rows costs little more than one (its captured passes are at most 64 rows wide)
AUTO_MAX_BUDGET_CUDA = 63


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def auto_budget(backend, relative_cost: float = AUTO_RELATIVE_COST, repeats: int = 5) -> tuple[int, Any]:
    """The largest node budget b <= AUTO_MAX_BUDGET (AUTO_MAX_BUDGET_CUDA on a GPU) whose verify pass (b + 1 rows
    after a 300-token context) costs at most ``relative_cost`` one-position passes on ``backend``, and the measured
    curve (median of ``repeats``)."""
    from kangaroo_policies.cost_model import measure_costs

    cuda = getattr(getattr(backend, "device", None), "type", "cpu") == "cuda"
    sizes = list(range(1, (AUTO_MAX_BUDGET_CUDA if cuda else AUTO_MAX_BUDGET) + 2))
    context = max(1, min(300, backend.max_context - sizes[-1] - 1))  # 300 tokens, or what a small model has
    curve = measure_costs(backend, None, context=context, positions=sizes, repeats=repeats)
    return budget_from_curve(curve.relative, relative_cost), curve


def budget_from_curve(relative: dict[int, float], relative_cost: float = AUTO_RELATIVE_COST) -> int:
    """The largest budget b (b + 1 verified rows: the root and b nodes) with t(b + 1) / t(1) <= ``relative_cost``;
    at least 1. ``relative``: rows -> cost relative to one row."""
    fitting = [rows - 1 for rows, cost in relative.items() if rows > 1 and cost <= relative_cost]
    return max(fitting) if fitting else 1


class DynamicTree(TreeShaper):
    """EAGLE-2's dynamic tree, with a confidence floor. Args: ``budget`` (nodes verified per round, or "auto"),
    ``topk`` (children per expanded node and nodes expanded per depth), ``depth`` (longest path), ``min_prob``: a
    node is expanded or verified only while its cumulative draft probability (the product along its path) is at
    least this — the tree's second early exit: each expansion is a pass of M[:l] and the drafter, worth it only
    when the drafter expects its children to be accepted (0 grows the full EAGLE-2 tree). The defaults (3, 5,
    0.45, budget sized from the measured cost curve): the root's 3 best children are verified (when the budget
    allows; a second and
    third candidate at the first position cost one verify row each and no draft pass), deeper nodes only while their
    path is likely — on SmolLM2 an expansion costs ~14 % of a verify pass (6.6 ms vs 47 ms on onnx, one thread), so it
    pays when its children's expected accepted tokens × the time per token exceed that, i.e. from a path
    probability of about 0.4 (docs/trees.md has the measurements)."""

    name = "dynamic"

    def __init__(self, budget: int | str = "auto", topk: int = 3, depth: int = 5, min_prob: float = 0.45):
        if budget != "auto":
            _positive("budget", budget)
        if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob < 1.0:
            raise ConfigError(f"min_prob must be in [0, 1), got {min_prob!r}")
        self.budget, self.topk, self.depth = budget, _positive("topk", topk), _positive("depth", depth)
        self.min_score = math.log(min_prob) if min_prob > 0 else -math.inf
        self.cost_curve = None

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "DynamicTree":
        return cls(**options)

    def bind(self, backend, policy) -> None:
        if self.budget == "auto":
            self.budget, self.cost_curve = auto_budget(backend)

    def children(self, tree, node, probs: torch.Tensor) -> list[int]:
        return torch.topk(probs, min(self.topk, probs.shape[-1])).indices.tolist()

    def expand(self, tree, frontier) -> list[int]:
        likely = [v for v in frontier if tree.scores[v] >= self.min_score]
        return sorted(likely, key=lambda v: (-tree.scores[v], v))[: self.topk]

    def select(self, tree) -> list[int]:
        # scores only fall along a path (log-probabilities <= 0) and ties go to the older node, so the best
        # ``budget`` nodes (and those above the floor) are ancestor-closed; depth-1 nodes are always eligible
        eligible = [v for v in range(1, len(tree)) if tree.depths[v] == 1 or tree.scores[v] >= self.min_score]
        return sorted(eligible, key=lambda v: (-tree.scores[v], v))[: self.budget]


class ChainTree(TreeShaper):
    """The chain as a tree: the drafter's top-1 at each node, grown while the stopping policy keeps drafting
    (``depth``: at most this many drafts; default the config's gamma)."""

    name = "chain"

    def __init__(self, depth: int = 6):
        self.depth = _positive("depth", depth)
        self.budget = self.depth
        self.policy = None
        self._probs: dict[int, torch.Tensor] = {}

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "ChainTree":
        return cls(**{"depth": config.gamma, **options})

    def bind(self, backend, policy) -> None:
        self.policy = policy

    def start_round(self, tokens, policy) -> None:
        policy.start_round(tokens)
        self._probs = {}

    def children(self, tree, node, probs: torch.Tensor) -> list[int]:
        token = int(probs.argmax())
        self._probs[len(tree)] = probs  # the child about to be added drew from these
        return [token]

    def expand(self, tree, frontier) -> list[int]:
        if not frontier:
            return []
        (node,) = frontier
        probs = self._probs[node]
        step = DraftStep(index=tree.depths[node], token=tree.tokens[node], probs=probs,
                         confidence=float(probs.max()))
        return [node] if self.policy.keep_drafting(step) else []

    def select(self, tree) -> list[int]:
        return list(range(1, len(tree)))


class FanTree(ChainTree):
    """The chain with the root's ``topk`` candidates (all verified) and the chain's own stopping rule below the most
    likely of them (``depth``: longest path; default the config's gamma). Where a chain loses a round to a wrong
    first draft, the target's token is often the drafter's second or third choice; those candidates need no pass
    of M[:l] and the drafter, only a verify row each — while a deeper tree's every expansion costs a draft pass."""

    name = "fan"

    def __init__(self, topk: int = 3, depth: int = 6):
        super().__init__(depth)
        self.topk = _positive("topk", topk)
        self.budget = self.depth + self.topk - 1

    @classmethod
    def create(cls, config: DecodeConfig, **options: Any) -> "FanTree":
        return cls(**{"depth": config.gamma, **options})

    def children(self, tree, node, probs: torch.Tensor) -> list[int]:
        if node != 0:
            return super().children(tree, node, probs)
        tokens = torch.topk(probs, min(self.topk, probs.shape[-1])).indices.tolist()
        for i in range(len(tokens)):
            self._probs[len(tree) + i] = probs  # the children about to be added drew from these
        return tokens

    def expand(self, tree, frontier) -> list[int]:
        if not frontier:
            return []
        node = frontier[0]  # children are added most likely first
        probs = self._probs[node]
        if tree.tokens[node] != int(probs.argmax()):  # the top candidate was an EOS: nothing to grow below
            return []
        step = DraftStep(index=tree.depths[node], token=tree.tokens[node], probs=probs,
                         confidence=float(probs.max()))
        return [node] if self.policy.keep_drafting(step) else []


@hookimpl
def register_tree_shapers(register):
    register("dynamic", DynamicTree)
    register("chain", ChainTree)
    register("fan", FanTree)
