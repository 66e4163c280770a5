"""The four extension points of the decode loop.

One round of Kangaroo decoding (paper §3, "double early exiting")::

    x_n ──M[:l]──► h_n ──drafter──► d_1 ──M[:l]──► h_1 ──drafter──► d_2 … d_k     (1. draft, 2. stop)
                                       policy: keep drafting?           │
    [h_n, h_1 … h_k] ──M[l:]──► target logits [k+1, V] ──verifier──► accepted prefix + one target token
                                                                      (3. verify, 4. accept, 5. roll back)

* :class:`Backend` runs the target model split at the exit layer l: the shallow part M[:l], the deep part M[l:]
  (fed with saved layer-l hidden states, never recomputing M[:l]) and the shared LM head, and owns the target's
  KV cache.
* :class:`SelfDrafter` turns layer-l hidden states into a next-token distribution (the Kangaroo adapter + shared head).
* :class:`StoppingPolicy` decides after each draft whether to draft another (the second early exit).
* :class:`Verifier` compares the drafts with the target's logits and decides what is accepted.

Implementations are plugins (see :mod:`kangaroo_core.hookspecs`); the engine resolves them once, when it is built.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kangaroo_core.config import DecodeConfig
    from kangaroo_core.results import DraftStep, Verdict


class Backend(abc.ABC):
    """The target model, split at the exit layer, with its KV cache.

    Shapes: ``n`` new positions, ``d`` hidden size, ``V`` vocabulary size. Both cache pointers start at 0 after
    :meth:`reset`; :meth:`shallow` and :meth:`deep` append, :meth:`crop` rolls both back.
    """

    #: Registered name, e.g. ``"torch"``.
    name: str = ""

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
    max_context: int
    #: A short hash identifying the base model's weights; adapters record it.
    fingerprint: str
    #: Human-readable model identity (path or file name).
    model_name: str

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget all cached positions (start of a new generation)."""

    @abc.abstractmethod
    def shallow(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Run M[:l] on ``token_ids`` (the next positions) and return their layer-l hidden states, [n, d]."""

    @abc.abstractmethod
    def deep(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run M[l:] + final norm + LM head on saved layer-l states [n, d] of the next positions; return [n, V]."""

    @abc.abstractmethod
    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions of the shallow and deep KV caches."""

    def cache_lengths(self) -> tuple[int, int]:
        """(shallow, deep) cached positions; for checks and tests."""
        raise NotImplementedError


class SelfDrafter(abc.ABC):
    """Proposes draft tokens from the target's own layer-l hidden states.

    The engine feeds every position exactly once, in order: ``advance`` receives the layer-l states of all positions
    the drafter has not seen yet (the prompt on the first call; then usually one; two when the previous round
    accepted every draft, because the last draft's state, saved during drafting, is reused — paper phase 5).
    """

    name: str = ""

    @classmethod
    def create(cls, config: "DecodeConfig", **options: Any) -> "SelfDrafter":
        """Build the drafter from the decode config and plugin options (e.g. ``adapter=PATH``)."""
        return cls(**options)

    @abc.abstractmethod
    def bind(self, backend: Backend) -> None:
        """Attach to a loaded backend (load or initialise weights that depend on the base model)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget all positions (start of a new generation)."""

    @abc.abstractmethod
    def advance(self, token_ids: Sequence[int], hidden: torch.Tensor) -> torch.Tensor | None:
        """Consume the unseen positions and return next-token logits [V] after the last one.

        Args:
            token_ids: the whole sequence so far (prompt, output and this round's drafts).
            hidden: layer-l hidden states [n, d] of the n positions not yet seen, ending at ``token_ids[-1]``.

        Returns:
            logits over the vocabulary for the next position, or None when the drafter has nothing to propose.
        """

    @abc.abstractmethod
    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (after rejected drafts)."""


class StoppingPolicy(abc.ABC):
    """The second early exit: after each draft, decide whether to draft another.

    The engine never drafts more than ``gamma`` tokens nor past the token budget, whatever the policy says; a policy
    only decides to stop earlier. The draft that made the policy stop is still verified.
    """

    name: str = ""

    @classmethod
    def create(cls, config: "DecodeConfig", **options: Any) -> "StoppingPolicy":
        return cls(**options)

    def bind(self, backend: Backend) -> None:
        """Called once when the engine is built, with the loaded backend (e.g. to check a file made for a base model)."""

    def prepare(self, engine: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Called once at the start of each generation, before any cache is reset (e.g. to compute a reference)."""

    def start_round(self, tokens: Sequence[int]) -> None:
        """Called before the first draft of each round with the committed sequence (prompt + output so far).

        The first draft will be proposed for position ``len(tokens)``. The default calls :meth:`begin_round`, so
        policies that do not need the position only implement that.
        """
        self.begin_round()

    def begin_round(self) -> None:
        """Called before the first draft of each round (by the default :meth:`start_round`)."""

    @abc.abstractmethod
    def keep_drafting(self, step: "DraftStep") -> bool:
        """Return True to draft another token after ``step``."""


class Verifier(abc.ABC):
    """Decides how many drafts the target accepts and which target token follows them."""

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
        """Compare k drafts with the target's logits [k+1, V] (row i predicts the token after draft i)."""
