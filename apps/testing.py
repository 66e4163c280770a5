"""Conformance kit for plugin authors: check your drafter or stopping policy against the contract and losslessness.

Everything runs on a tiny random Llama that the kit builds itself (float64, a few layers, no download, well under a
second per check on a CPU), so a plugin's own test suite can call it::

    from kangaroo_apps.testing import check_drafter, check_policy

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
from kangaroo_core.interfaces import SelfDrafter

__all__ = [
    "TinyTarget",
    "TinyTokenizer",
    "tiny_target",
    "tiny_llama",
    "tiny_model",
    "tiny_backend",
    "set_eos",
    "hf_greedy",
    "check_rows_exact",
    "ScriptedDrafter",
    "error_positions",
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
    """Token ``i`` is the word ``t<i>``; the EOS token is skipped by ``decode(skip_special_tokens=True)``."""

    chat_template = None

    def __init__(self, vocab_size: int, eos_token_id: int | Sequence[int] | None = None):
        self.vocab_size = vocab_size
        self.special_ids = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        # a real tokenizer has one EOS token; the model's generation config may list several
        self.eos_token_id = eos_token_id if not isinstance(eos_token_id, (list, tuple)) else eos_token_id[0]

    def encode(self, text: str, **_: object) -> list[int]:
        ids = []
        for word in text.split():
            if word.startswith("t") and word[1:].isdigit() and int(word[1:]) < self.vocab_size:
                ids.append(int(word[1:]))
            else:  # any other word: a stable id from its characters
                ids.append(sum(map(ord, word)) % self.vocab_size)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False, **_: object) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
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
        """A fresh :class:`~kangaroo_backends.torch_backend.TorchBackend` over :attr:`model` (empty KV cache)."""
        from kangaroo_core.plugins import get_registry

        TorchBackend = get_registry().resolve("backend", "torch")
        eos = self.model.generation_config.eos_token_id
        return TorchBackend(self.model, TinyTokenizer(self.vocab_size, eos), self.exit_layer, model_name="kangaroo-tiny")

    def config(self, **changes: Any) -> DecodeConfig:
        """A :class:`DecodeConfig` whose ``exit_layer`` matches this target."""
        return DecodeConfig(exit_layer=self.exit_layer, **changes)


def tiny_llama(
    seed: int,
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 3,
    heads: int = 4,
    kv_heads: int = 2,
    dtype: Any = None,
    eos_token_id: int | Sequence[int] | None = None,
    tie_word_embeddings: bool | None = None,
    init_std: float = 0.2,
    random_norms: bool = True,
) -> Any:
    """A random ``transformers.LlamaForCausalLM`` (float64 by default, so the split model and transformers' own
    forward agree to ~1e-12 and greedy argmaxes never flip on rounding).

    ``tie_word_embeddings=None`` picks tied or untied from the seed. ``init_std`` is larger than transformers'
    default (0.02) so the random model's greedy output is not one token repeated forever; ``random_norms`` draws the
    norm weights too, so the final norm and the adapter's norms are not all ones.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.float64 if dtype is None else dtype
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"invalid head geometry: hidden={hidden}, heads={heads}, kv_heads={kv_heads}")
    rng = random.Random(seed)
    if tie_word_embeddings is None:
        tie_word_embeddings = rng.random() < 0.5
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rope_theta=10000.0,
        initializer_range=init_std,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    if random_norms:
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "variance_epsilon"):
                    module.weight.uniform_(0.5, 1.5)
    set_eos(model, eos_token_id)
    return model


#: the families :func:`tiny_model` builds (every family of :mod:`kangaroo_backends.families`)
TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


def tiny_model(family: str, seed: int = 0, *, vocab: int = 64, hidden: int = 32, layers: int = 4, heads: int = 4,
               kv_heads: int = 2, window: int = 6, dtype: Any = None, eos_token_id: int | None = None,
               init_std: float = 0.2) -> Any:
    """A random float64 model of one decoder family, small enough for unit tests, with the family's quirks switched
    on: Mistral slides every layer and Qwen2 its upper layers within ``window`` positions, Qwen3 has q/k norms,
    Gemma 3 alternates sliding and full layers (two RoPE bases), sandwich norms and scaled embeddings. ``window``
    is shorter than the test sequences, so the windows are exercised."""
    import torch
    import transformers

    if family == "llama":
        return tiny_llama(seed, vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                          dtype=dtype, eos_token_id=eos_token_id, init_std=init_std)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  initializer_range=init_std, tie_word_embeddings=bool(seed % 2), bos_token_id=None,
                  eos_token_id=eos_token_id, pad_token_id=None, attn_implementation="sdpa")
    if family == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=window, rope_theta=10000.0)
        cls = transformers.MistralForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=window,
                                          max_window_layers=layers // 2, rope_theta=10000.0)
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=hidden // heads, rope_theta=10000.0)
        cls = transformers.Qwen3ForCausalLM
    elif family == "gemma3":
        config = transformers.Gemma3TextConfig(**common, head_dim=hidden // heads, sliding_window=window,
                                               layer_types=["sliding_attention" if (i + 1) % 3 else "full_attention"
                                                            for i in range(layers)],
                                               query_pre_attn_scalar=hidden // heads * 2, rope_theta=1e6,
                                               rope_local_base_freq=10000.0, final_logit_softcapping=None,
                                               attn_logit_softcapping=None)
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(TINY_FAMILIES)}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float64 if dtype is None else dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + w: small w; the others by w: around 1
                param.uniform_(-0.3, 0.3) if family == "gemma3" else param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, init_std)
    set_eos(model, eos_token_id)
    return model


def set_eos(model: Any, eos_token_id: int | Sequence[int] | None) -> None:
    """Make ``eos_token_id`` (one id, several, or nothing) the model's end of sequence, for transformers and for TorchBackend."""
    model.config.eos_token_id = eos_token_id
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None


def tiny_backend(model: Any = None, exit_layer: int = 1, seed: int = 0, **llama_options) -> Any:
    """A TorchBackend over ``model`` (or a fresh :func:`tiny_llama`); its EOS is the model's generation-config EOS."""
    from kangaroo_core.plugins import get_registry

    TorchBackend = get_registry().resolve("backend", "torch")
    if model is None:
        model = tiny_llama(seed, **llama_options)
    eos = model.generation_config.eos_token_id
    return TorchBackend(model, TinyTokenizer(model.config.vocab_size, eos), exit_layer, model_name=f"tiny-{seed}")


def tiny_target(seed: int = 0, *, vocab: int = 64, hidden: int = 32, layers: int = 3, exit_layer: int = 1,
                init_std: float = 0.02, eos_token_id: int | None = None) -> TinyTarget:
    """Build a tiny random Llama target (:func:`tiny_llama`, untied, unit norms). float64, so the split model and
    transformers agree to ~1e-12.

    With transformers' default ``init_std=0.02`` the greedy output of a random model soon repeats itself, which is
    the case where a lookup drafter should get drafts accepted; a larger ``init_std`` gives less regular output.
    """
    model = tiny_llama(seed, vocab=vocab, hidden=hidden, layers=layers, eos_token_id=eos_token_id,
                       tie_word_embeddings=False, init_std=init_std, random_norms=False)
    return TinyTarget(model, exit_layer)


def random_deep_context_adapter(model: Any, exit_layer: int, seed: int, *, draft_vocab: Sequence[int] | None = None,
                                ffn: bool = False) -> Any:
    """A deep-context adapter for ``model`` with random, non-zero fusions (an untrained one equals the paper's
    adapter), in the model's dtype; ``draft_vocab`` gives it a draft head over those token ids."""
    import torch

    from kangaroo_plugins.kangaroo.deep_context import DeepContextAdapter

    adapter = DeepContextAdapter.from_base_layer(model, exit_layer, ffn=ffn, draft_head=draft_vocab is not None)
    if draft_vocab is not None:
        adapter.set_draft_vocab(draft_vocab, model.lm_head)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (adapter.kv_fuse, adapter.query_fuse, adapter.depth_embedding):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen, dtype=torch.float64) * 0.3)
    return adapter.to(next(model.parameters()).dtype)


def hf_greedy(model: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """``transformers``' own greedy decoding of ``prompt_ids``: the reference for losslessness."""
    import torch

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=0, pad_token_id=0, eos_token_id=model.generation_config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def check_rows_exact(backend: Any, prompt: Sequence[int], tokens: Sequence[int],
                     splits: Iterable[Sequence[int]] = ()) -> None:
    """Assert that a backend's multi-position passes reproduce its one-position passes bit for bit.

    After a prefill of ``prompt``, ``tokens`` go through one-position passes; then, for each split (chunk lengths,
    e.g. ``(1, 7)``: a one-row pass then a 7-row verify pass), the same tokens go through passes of those sizes, and
    the logits and final states of every row must be equal (``torch.equal``) to the one-position ones. This is what
    makes Kangaroo equal the backend's own target alone by construction rather than up to near-ties.
    """
    import torch

    def passes(chunks: Sequence[int]):
        backend.reset()
        backend.deep(backend.shallow(list(prompt), 0), 0)  # the prefill: the same pass either way
        start, logits, hidden = len(prompt), [], []
        for size in chunks:
            out = backend.deep(backend.shallow(list(tokens[start - len(prompt): start - len(prompt) + size]), start),
                               start)
            logits.append(out.logits)
            hidden.append(out.hidden)
            start += size
        return torch.cat(logits), torch.cat(hidden)

    one_by_one = passes([1] * len(tokens))
    for split in splits:
        if sum(split) > len(tokens):
            raise ValueError(f"split {tuple(split)} covers more than the {len(tokens)} tokens")
        logits, hidden = passes(split)
        for row in range(len(logits)):
            assert torch.equal(logits[row], one_by_one[0][row]) and torch.equal(hidden[row], one_by_one[1][row]), (
                f"split {tuple(split)}: row {row} differs from its one-position pass")


def make_draft_step(probs: Sequence[float] | Any, index: int = 1):
    """A :class:`~kangaroo_core.results.DraftStep` for a given draft distribution (its top-1 is the token)."""
    import torch

    from kangaroo_core.results import DraftStep

    p = torch.as_tensor(probs, dtype=torch.float32)
    p = p / p.sum()
    confidence, token = p.max(dim=-1)
    return DraftStep(index=index, token=int(token), probs=p, confidence=float(confidence))


# -- the scripted drafter ---------------------------------------------------------------------------------------------
class ScriptedDrafter(SelfDrafter):
    """Proposes the next token of a known ``reference`` sequence (prompt + continuation), wrong on purpose at some positions.

    Args:
        reference: prompt + the continuation to propose (typically the target's greedy output).
        vocab_size: size of the logits vector.
        wrong_at: absolute positions (index into ``reference``) where the proposal is deliberately wrong.
        confidence: the top-1 probability of each proposal: a number in (1/V, 1) or ``f(position) -> number``.
        none_at: positions where :meth:`advance` returns None (nothing to propose).
        strict: assert the engine feeds every position exactly once, in order, ending at ``token_ids[-1]``.

    When the sequence so far is not a prefix of ``reference`` (or runs past it), a fallback token is proposed.
    ``hidden`` keeps the layer-l state of every seen position (rolled back by :meth:`crop`).
    """

    name = "scripted"

    def __init__(
        self,
        reference: Sequence[int],
        vocab_size: int,
        wrong_at: Iterable[int] = (),
        confidence: float | Callable[[int], float] = 0.9,
        none_at: Iterable[int] = (),
        strict: bool = True,
    ):
        self.reference = [int(t) for t in reference]
        self.vocab_size = vocab_size
        self.wrong_at = set(wrong_at)
        self.confidence = confidence
        self.none_at = set(none_at)
        self.strict = strict
        self.hidden: list = []
        self.calls: list[tuple[int, int]] = []  # (len(token_ids), states given) per advance
        self.proposed: list[tuple[int, int]] = []  # (position, token) per proposal
        self.backend: Any = None

    @property
    def seen(self) -> int:
        return len(self.hidden)

    def bind(self, backend: Any) -> None:
        self.backend = backend
        if backend.vocab_size != self.vocab_size:
            raise ValueError(f"vocab {self.vocab_size} != backend vocab {backend.vocab_size}")

    def reset(self) -> None:
        self.hidden = []
        self.calls = []
        self.proposed = []

    def crop(self, length: int) -> None:
        del self.hidden[length:]

    def expected(self, token_ids: Sequence[int]) -> int:
        """The token this drafter proposes after ``token_ids`` (before the deliberate errors)."""
        pos = len(token_ids)
        if pos < len(self.reference) and list(token_ids) == self.reference[:pos]:
            return self.reference[pos]
        return (7 * pos + 3 + sum(token_ids[-2:])) % self.vocab_size  # fallback: off the script

    def token_at(self, token_ids: Sequence[int]) -> int:
        token = self.expected(token_ids)
        if len(token_ids) in self.wrong_at:
            token = (token + 1 + len(token_ids) % (self.vocab_size - 1)) % self.vocab_size
        return token

    def logits_for(self, token: int, position: int) -> Any:
        import torch

        c = self.confidence(position) if callable(self.confidence) else self.confidence
        c = float(min(max(c, 1.5 / self.vocab_size), 1 - 1e-6))  # top-1 must stay the argmax
        logits = torch.full((self.vocab_size,), torch.log(torch.tensor((1 - c) / (self.vocab_size - 1))).item(),
                            dtype=torch.float64)
        logits[token] = torch.log(torch.tensor(c, dtype=torch.float64))
        return logits

    def advance(self, token_ids: Sequence[int], hidden: Any) -> Any:
        n = hidden.shape[0]
        if self.strict:
            assert n >= 1, "advance() got no unseen state"
            assert self.seen + n == len(token_ids), (
                f"drafter had seen {self.seen} positions, got {n} more, but the sequence has {len(token_ids)} tokens"
            )
        self.calls.append((len(token_ids), n))
        self.hidden.extend(h.detach().clone() for h in hidden)
        pos = len(token_ids)
        if pos in self.none_at:
            return None
        token = self.token_at(token_ids)
        self.proposed.append((pos, token))
        return self.logits_for(token, pos)


def error_positions(rng: random.Random, start: int, end: int, rate: float) -> set[int]:
    """Each absolute position in [start, end) independently with probability ``rate``."""
    return {p for p in range(start, end) if rng.random() < rate}


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
    * ``seen`` is 0 after ``reset()``, counts the positions advanced over, and follows ``crop``;
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
    hidden = backend.shallow(tokens, 0)

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
    assert drafter.seen == 0, f"seen must be 0 after reset(), got {drafter.seen}"
    first = run(start)
    assert drafter.seen == len(tokens), f"seen must count the positions advanced over ({len(tokens)}), got {drafter.seen}"
    # crop back to start + 2 and replay the last positions
    cut = start + 2
    drafter.crop(cut)
    assert drafter.seen == cut, f"seen must be {cut} after crop({cut}), got {drafter.seen}"
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
    from kangaroo_core.plugins import get_registry

    target = target or tiny_target()
    results = []
    for gamma in gammas:
        config = target.config(gamma=gamma, max_new_tokens=max_new_tokens)
        engine = Engine(target.backend(), _build("drafter", drafter, config, drafter_options),
                        _build("policy", policy, config, policy_options),
                        get_registry().resolve("verifier", "greedy")(), config)
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
        import kangaroo_apps.testing as kit

        return kit

