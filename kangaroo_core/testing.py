"""Conformance kit for plugin authors: check your drafter or stopping policy against the contract and losslessness.

Everything runs on a tiny random Llama that the kit builds itself (float64, a few layers, no download, well under a
second per check on a CPU), so a plugin's own test suite can call it::

    from kangaroo_core.testing import check_drafter, check_policy

    def test_my_drafter_conforms():
        check_drafter(MyDrafter)            # a class, a factory ``f() -> SelfDrafter``, or a registered name

    def test_my_policy_conforms():
        check_policy(MyPolicy)

``check_drafter`` / ``check_policy`` run the contract checks (:func:`check_drafter_contract`,
:func:`check_policy_contract`) and then :func:`check_lossless`: the engine's greedy output with your piece must be
token-identical to ``transformers``' own ``generate`` on the same model. Each failure is an ``AssertionError`` that
says which rule was broken.

The module is also a pytest plugin (entry point ``pytest11``: ``kangaroo``), providing the fixtures
``kangaroo_tiny_model`` (a :class:`TinyTarget`) and ``kangaroo_conformance`` (this module).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from kangaroo_core.config import DecodeConfig

__all__ = [
    "TinyTarget",
    "TinyTokenizer",
    "tiny_target",
    "hf_greedy",
    "make_draft_step",
    "check_drafter_contract",
    "check_policy_contract",
    "check_lossless",
    "check_drafter",
    "check_policy",
]

#: Prompts the losslessness check decodes: a repetitive one (where lookup-style drafters get drafts accepted),
#: a short one, and a random one.
DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9),
    (3, 1, 4, 1, 5),
    tuple(random.Random(0).randrange(2, 64) for _ in range(20)),
)


class TinyTokenizer:
    """Just enough tokenizer for the engine: token ``i`` is the word ``t<i>``."""

    chat_template = None

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def encode(self, text: str, **_: object) -> list[int]:
        return [int(w[1:]) % self.vocab_size if w[1:].isdigit() else sum(map(ord, w)) % self.vocab_size
                for w in text.split()]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False, **_: object) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens and self.eos_token_id is not None:
            ids = [i for i in ids if i != self.eos_token_id]
        return " ".join(f"t{i}" for i in ids)


@attrs.define
class TinyTarget:
    """A tiny random ``LlamaForCausalLM`` (``model``) and a factory for fresh backends over it.

    Attributes:
        model: the transformers model (float64, eval mode).
        exit_layer: where :meth:`backend` splits it.
    """

    model: Any
    exit_layer: int = 1

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def backend(self):
        """A fresh :class:`~kangaroo_backends.torch_eager.TorchBackend` over :attr:`model` (empty KV cache)."""
        from kangaroo_backends.torch_eager import TorchBackend

        eos = self.model.generation_config.eos_token_id
        return TorchBackend(self.model, TinyTokenizer(self.vocab_size, eos), self.exit_layer, model_name="kangaroo-tiny")

    def config(self, **changes: Any) -> DecodeConfig:
        """A :class:`DecodeConfig` whose ``exit_layer`` matches this target."""
        return DecodeConfig(exit_layer=self.exit_layer, **changes)


def tiny_target(seed: int = 0, *, vocab: int = 64, hidden: int = 32, layers: int = 3, exit_layer: int = 1,
                init_std: float = 0.02, eos_token_id: int | None = None) -> TinyTarget:
    """Build a tiny random Llama target. float64, so the split model and transformers agree to ~1e-12.

    With transformers' default ``init_std=0.02`` the greedy output of a random model soon repeats itself, which is
    the case where a lookup drafter should get drafts accepted; a larger ``init_std`` gives less regular output.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=init_std,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    return TinyTarget(model, exit_layer)


def hf_greedy(model: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """``transformers``' own greedy decoding of ``prompt_ids``: the reference for losslessness."""
    import torch

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=0, pad_token_id=0, eos_token_id=model.generation_config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def make_draft_step(probs: Sequence[float] | Any, index: int = 1):
    """A :class:`~kangaroo_core.results.DraftStep` for a given draft distribution (its top-1 is the token)."""
    import torch

    from kangaroo_core.results import DraftStep

    p = torch.as_tensor(probs, dtype=torch.float32)
    p = p / p.sum()
    confidence, token = p.max(dim=-1)
    return DraftStep(index=index, token=int(token), probs=p, confidence=float(confidence))


# -- building the piece under test ------------------------------------------------------------------------------------
def _build(kind: str, piece: Any, config: DecodeConfig, options: dict | None):
    """A class (built with ``create(config, **options)``), a registered name, a zero-argument factory, or an instance."""
    from kangaroo_core.plugins import get_registry

    if isinstance(piece, str):
        piece = get_registry().resolve(kind, piece)
    if isinstance(piece, type):
        return piece.create(config, **(options or {}))
    if callable(piece) and not hasattr(piece, "advance") and not hasattr(piece, "keep_drafting"):
        return piece()
    return piece


# -- contracts ---------------------------------------------------------------------------------------------------------
def check_drafter_contract(drafter: Any, *, target: TinyTarget | None = None, options: dict | None = None) -> None:
    """Check the :class:`~kangaroo_core.interfaces.SelfDrafter` contract outside the engine.

    * it is a ``SelfDrafter`` and ``bind(backend)`` accepts a loaded backend;
    * ``advance(token_ids, hidden)`` returns None or a floating-point tensor of shape ``[V]`` with no NaN, for the
      prompt and then one position at a time;
    * ``crop(length)`` then ``advance`` from the cropped position gives the same answer as the first time
      (rolling back after rejected drafts forgets them);
    * ``reset()`` then advancing over the same positions gives the same answers (a new generation starts clean).
    """
    import torch

    from kangaroo_core.interfaces import SelfDrafter

    target = target or tiny_target()
    backend = target.backend()
    drafter = _build("drafter", drafter, target.config(), options)
    assert isinstance(drafter, SelfDrafter), f"{drafter!r} is not a SelfDrafter"
    drafter.bind(backend)
    V = backend.vocab_size
    tokens = list(DEFAULT_PROMPTS[0]) + [5, 9, 14, 2, 7]
    backend.reset()
    hidden = backend.shallow(tokens)

    def check(out, where):
        if out is None:
            return None
        assert isinstance(out, torch.Tensor), f"advance() must return a torch.Tensor or None, got {type(out)} {where}"
        assert out.shape == (V,), f"advance() must return logits of shape [{V}], got {tuple(out.shape)} {where}"
        assert out.is_floating_point(), f"advance() must return floating-point logits, got {out.dtype} {where}"
        assert not torch.isnan(out).any(), f"advance() returned NaN logits {where}"
        return out.detach().clone()

    def run(start: int) -> list:
        answers = []
        answers.append(check(drafter.advance(tokens[:start], hidden[:start]), f"after the {start}-token prompt"))
        for i in range(start + 1, len(tokens) + 1):
            answers.append(check(drafter.advance(tokens[:i], hidden[i - 1:i]), f"at position {i}"))
        return answers

    def same(a, b, what):
        assert (a is None) == (b is None), f"{what}: advance() returned None once and logits once for the same input"
        if a is not None:
            assert torch.allclose(a.double(), b.double(), atol=1e-6), f"{what}: advance() gave different logits"

    start = len(DEFAULT_PROMPTS[0])
    drafter.reset()
    first = run(start)
    # crop back to start + 2 and replay the last positions
    cut = start + 2
    drafter.crop(cut)
    for i in range(cut + 1, len(tokens) + 1):
        same(check(drafter.advance(tokens[:i], hidden[i - 1:i]), f"at position {i} after crop({cut})"),
             first[i - start], f"crop({cut}) then advance at position {i}")
    drafter.reset()
    for a, b in zip(run(start), first):
        same(a, b, "reset() then the same positions again")


def check_policy_contract(policy: Any, *, options: dict | None = None, vocab: int = 64, seed: int = 0) -> None:
    """Check the :class:`~kangaroo_core.interfaces.StoppingPolicy` contract.

    ``begin_round()`` is callable; ``keep_drafting(step)`` returns a real ``bool`` (not a tensor, not None) for
    confident, flat and random draft distributions, and answers the same for the same step after ``begin_round()``.
    """
    import torch

    from kangaroo_core.interfaces import StoppingPolicy

    policy = _build("policy", policy, DecodeConfig(), options)
    assert isinstance(policy, StoppingPolicy), f"{policy!r} is not a StoppingPolicy"
    gen = torch.Generator().manual_seed(seed)
    peaked = torch.full((vocab,), 1e-4)
    peaked[3] = 1.0
    dists = [peaked, torch.ones(vocab)] + [torch.rand(vocab, generator=gen) ** 4 for _ in range(8)]
    answers = []
    for round_ in range(2):
        policy.begin_round()
        row = []
        for index, probs in enumerate(dists, start=1):
            answer = policy.keep_drafting(make_draft_step(probs, index=index))
            assert type(answer) is bool, f"keep_drafting() must return a bool, got {type(answer).__name__}: {answer!r}"
            row.append(answer)
        answers.append(row)
    assert answers[0] == answers[1], "keep_drafting() answered differently for the same steps after begin_round()"


# -- losslessness ------------------------------------------------------------------------------------------------------
def check_lossless(
    *,
    drafter: Any = "kangaroo",
    policy: Any = "threshold",
    drafter_options: dict | None = None,
    policy_options: dict | None = None,
    target: TinyTarget | None = None,
    prompts: Iterable[Sequence[int]] = DEFAULT_PROMPTS,
    max_new_tokens: int = 24,
    gammas: Iterable[int] = (1, 4),
) -> list:
    """Greedy decoding with this drafter and policy must equal ``transformers``' ``generate`` token for token.

    Each piece may be a class, a registered name, a zero-argument factory or an instance (an instance is reused
    across runs, so it must honour ``reset``). Returns the :class:`~kangaroo_core.results.GenerationResult` of every
    (prompt, gamma) run, e.g. to assert on ``mean_accepted_tokens``.
    """
    from kangaroo_core.engine import Engine
    from kangaroo_plugins.greedy_verifier import GreedyVerifier

    target = target or tiny_target()
    results = []
    for gamma in gammas:
        config = target.config(gamma=gamma, max_new_tokens=max_new_tokens)
        engine = Engine(target.backend(), _build("drafter", drafter, config, drafter_options),
                        _build("policy", policy, config, policy_options), GreedyVerifier(), config)
        for prompt in prompts:
            reference = hf_greedy(target.model, prompt, max_new_tokens)
            result = engine.generate_ids(list(prompt), max_new_tokens=max_new_tokens)
            assert result.token_ids == reference, (
                f"not lossless (gamma={gamma}, prompt={list(prompt)}):\n  engine:       {result.token_ids}\n"
                f"  transformers: {reference}"
            )
            results.append(result)
    return results


def check_drafter(drafter: Any, *, options: dict | None = None, policy: Any = "threshold", **lossless: Any) -> list:
    """:func:`check_drafter_contract`, then :func:`check_lossless` with the given policy; returns the results."""
    check_drafter_contract(drafter, options=options)
    return check_lossless(drafter=drafter, drafter_options=options, policy=policy, **lossless)


def check_policy(policy: Any, *, options: dict | None = None, drafter: Callable | Any = None, **lossless: Any) -> list:
    """:func:`check_policy_contract`, then :func:`check_lossless` with the given drafter.

    The default drafter is ``kangaroo`` with an untrained adapter (its confidence varies, so the policy both stops
    and continues); returns the results.
    """
    check_policy_contract(policy, options=options)
    if drafter is None:
        drafter, lossless["drafter_options"] = "kangaroo", {"adapter": "untrained", **lossless.get("drafter_options", {})}
    return check_lossless(policy=policy, policy_options=options, drafter=drafter, **lossless)


# -- pytest plugin -----------------------------------------------------------------------------------------------------
try:
    import pytest
except ImportError:  # the kit's functions work without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def kangaroo_tiny_model() -> TinyTarget:
        """A :class:`TinyTarget` (tiny random float64 Llama), built once per session."""
        return tiny_target()

    @pytest.fixture
    def kangaroo_conformance():
        """This module: ``kangaroo_conformance.check_drafter(MyDrafter)``."""
        import kangaroo_core.testing as kit

        return kit

