"""Test helpers (not a test module): tiny random Llama models, a stand-in tokenizer, and a scripted drafter.

* :func:`tiny_llama` builds a random ``transformers.LlamaForCausalLM`` (float64 by default, so that the split model
  and transformers' own forward agree to ~1e-12 and greedy argmaxes never flip on rounding).
* :class:`TinyTokenizer` is just enough tokenizer for :class:`~kangaroo_backends.torch_eager.TorchBackend` and the
  engine (``decode``, ``encode``, ``chat_template``, ``eos_token_id``).
* :class:`ScriptedDrafter` is a real :class:`~kangaroo_core.interfaces.SelfDrafter` that proposes tokens from a known
  continuation (usually the target's own greedy output), wrong on purpose at chosen positions. The untrained Kangaroo
  adapter almost never gets a draft accepted; this drafter reaches the all-accepted (phase-5 reuse of h(d_k)),
  partially-accepted and EOS-inside-a-draft paths of the engine on demand. It also checks the engine's side of the
  drafter contract (every position fed exactly once, in order, ending at ``token_ids[-1]``) and keeps the layer-l
  states it was given, so tests can compare them with a fresh prefill.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kangaroo_backends.torch_eager import TorchBackend
from kangaroo_core.interfaces import Backend, SelfDrafter


# -- model and tokenizer ----------------------------------------------------------------------------------------------
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


def tiny_llama(
    seed: int,
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 3,
    heads: int = 4,
    kv_heads: int = 2,
    dtype: torch.dtype = torch.float64,
    eos_token_id: int | Sequence[int] | None = None,
    tie_word_embeddings: bool | None = None,
    init_std: float = 0.2,
) -> LlamaForCausalLM:
    """A random Llama model; ``tie_word_embeddings=None`` picks tied or untied from the seed.

    ``init_std`` is larger than transformers' default (0.02) so the random model's greedy output is not one token
    repeated forever.
    """
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
    with torch.no_grad():  # random norm weights too, so the final norm / adapter norms are not all ones
        for module in model.modules():
            if hasattr(module, "variance_epsilon"):
                module.weight.uniform_(0.5, 1.5)
    set_eos(model, eos_token_id)
    return model


def set_eos(model: LlamaForCausalLM, eos_token_id: int | Sequence[int] | None) -> None:
    """Make ``eos_token_id`` (one id, several, or nothing) the model's end of sequence, for transformers and for TorchBackend."""
    model.config.eos_token_id = eos_token_id
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None


def tiny_backend(model: LlamaForCausalLM | None = None, exit_layer: int = 1, seed: int = 0, **llama_options) -> TorchBackend:
    """A TorchBackend over ``model`` (or a fresh :func:`tiny_llama`); its EOS is the model's generation-config EOS."""
    if model is None:
        model = tiny_llama(seed, **llama_options)
    eos = model.generation_config.eos_token_id
    return TorchBackend(model, TinyTokenizer(model.config.vocab_size, eos), exit_layer, model_name=f"tiny-{seed}")


@torch.inference_mode()
def hf_greedy(model: LlamaForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding: the reference every decoder must reproduce token for token.

    It stops after emitting the generation config's EOS (when set), like the engine.
    """
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        pad_token_id=0,
        eos_token_id=model.generation_config.eos_token_id,
    )
    return out[0, len(prompt_ids):].tolist()


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
        self.hidden: list[torch.Tensor] = []
        self.calls: list[tuple[int, int]] = []  # (len(token_ids), states given) per advance
        self.proposed: list[tuple[int, int]] = []  # (position, token) per proposal
        self.backend: Backend | None = None

    @property
    def seen(self) -> int:
        return len(self.hidden)

    def bind(self, backend: Backend) -> None:
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

    def logits_for(self, token: int, position: int) -> torch.Tensor:
        c = self.confidence(position) if callable(self.confidence) else self.confidence
        c = float(min(max(c, 1.5 / self.vocab_size), 1 - 1e-6))  # top-1 must stay the argmax
        logits = torch.full((self.vocab_size,), torch.log(torch.tensor((1 - c) / (self.vocab_size - 1))).item(),
                            dtype=torch.float64)
        logits[token] = torch.log(torch.tensor(c, dtype=torch.float64))
        return logits

    def advance(self, token_ids: Sequence[int], hidden: torch.Tensor) -> torch.Tensor | None:
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
