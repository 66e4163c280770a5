"""The Kangaroo adapter: RMSNorm → one multi-head attention (base model's head geometry, RoPE) → residual → RMSNorm.

Its blocks are the base model's own family classes (:mod:`kangaroo_backends.families`: Llama's, Gemma 3's with its
q/k norms and ``1 + w`` RMSNorm, ...), built like the exit layer (its RoPE), attending over the whole context.

Its output goes through the target's shared LM head. Files: ``adapter.safetensors`` (weights) and ``adapter.json``
(metadata: format version, base model fingerprint, exit layer, architecture). Loading an adapter made for another
model, exit layer or architecture raises :class:`~kangaroo_core.errors.AdapterMismatchError`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from kangaroo_backends.families import adapter_config, family_of
from kangaroo_backends.fast_layers import linear_rows
from kangaroo_backends.hf_compat import cache_keyword, rope_theta, rotary_for
from kangaroo_backends.kv_cache import KVCache, causal_mask
from kangaroo_core import __version__
from kangaroo_core.errors import AdapterMismatchError
from kangaroo_core.files import read_json

FORMAT = "kangaroo-adapter"
FORMAT_VERSION = 1
WEIGHTS_FILE = "adapter.safetensors"
METADATA_FILE = "adapter.json"
DRAFT_VOCAB_TENSOR = "draft_vocab"


def adapter_architecture(model_config, *, kind: str = "attention", ffn: bool = False, separate_head: bool = False,
                         draft_head: bool = False, draft_vocab_size: int | None = None) -> dict:
    """What an adapter file records of its network (``model_config``: the adapter's own, :func:`adapter_config`)."""
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    extra = {} if draft_vocab_size is None else {"draft_vocab_size": int(draft_vocab_size)}
    if draft_head:  # only written when set, so adapters made before the option still load
        extra["draft_head"] = True
    family = family_of(model_config).name
    if family != "llama":  # likewise: Llama adapters made before families existed still load
        extra["family"] = family
    return {
        "type": kind,
        "hidden_size": model_config.hidden_size,
        "num_attention_heads": model_config.num_attention_heads,
        "num_key_value_heads": model_config.num_key_value_heads,
        "head_dim": head_dim,
        "rope_theta": rope_theta(model_config),  # the one (full-attention) layer's RoPE base
        "rms_norm_eps": model_config.rms_norm_eps,
        "ffn": ffn,
        "separate_head": separate_head,
        **extra,
    }


class DraftHead(nn.Module):
    """An LM head restricted to a draft vocabulary (token ids ``index``): only those rows are multiplied, every other
    token gets logit -inf. Drafting then never proposes a token outside the list — the verification is unchanged, so
    output stays lossless — and the head costs K/V of the full one (the full 49k-row head dominates a SmolLM2 draft
    step). The scatter back to the full vocabulary keeps every consumer (policies, verifiers) unchanged."""

    def __init__(self, weight: torch.Tensor, index: torch.Tensor, *, vocab: torch.Tensor | None = None,
                 vocab_size: int | None = None):
        super().__init__()
        # weight [V, d] with rows index [K] (the shared head), or weight [K, d] itself (a draft head: index = 0..K-1,
        # vocab = the token ids of its rows)
        self.vocab_size = vocab_size or weight.shape[0]
        self.register_buffer("rows", weight.detach()[index].clone().contiguous(), persistent=False)  # [K, d]
        self.register_buffer("index", (index if vocab is None else vocab).clone(), persistent=False)  # [K]
        self.kernel = None  # the small-batch kernel, when drafting runs its rows alone (kangaroo_backends.fast_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d] → [..., V]
        sub = linear_rows(x, self.rows, None, self.kernel)  # [..., K]
        full = torch.full((*sub.shape[:-1], self.vocab_size), float("-inf"), dtype=sub.dtype, device=sub.device)
        return full.scatter(-1, self.index.expand(*sub.shape[:-1], -1), sub)


def read_metadata(directory: str | Path, *, base_fingerprint: str, exit_layer: int) -> dict:
    """An adapter directory's ``adapter.json``, checked against the loaded model and exit layer (format, base model,
    exit layer; ``architecture`` a JSON object when present). The network it names: :func:`network_type`."""
    directory = Path(directory)
    meta_path, weights_path = directory / METADATA_FILE, directory / WEIGHTS_FILE
    if not meta_path.is_file() or not weights_path.is_file():
        raise AdapterMismatchError(f"{directory} is not an adapter directory (needs {METADATA_FILE} and {WEIGHTS_FILE})")
    meta = read_json(meta_path, AdapterMismatchError)
    if not isinstance(meta, dict):
        raise AdapterMismatchError(f"{meta_path} must hold a JSON object, not a {type(meta).__name__}")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise AdapterMismatchError(
            f"{meta_path}: unsupported adapter format {meta.get('format')!r} v{meta.get('format_version')!r} "
            f"(this kangaroo reads {FORMAT} v{FORMAT_VERSION})"
        )
    if meta.get("base_model_fingerprint") != base_fingerprint:
        raise AdapterMismatchError(
            f"adapter {directory} was made for base model {meta.get('base_model_fingerprint')}, "
            f"not for the loaded model {base_fingerprint}"
        )
    if meta.get("exit_layer") != exit_layer:
        raise AdapterMismatchError(
            f"adapter {directory} was trained at exit layer {meta.get('exit_layer')}, but exit layer {exit_layer} was requested"
        )
    if not isinstance(meta.get("architecture") or {}, dict):
        raise AdapterMismatchError(f"{meta_path}: 'architecture' must be a JSON object")
    return meta


def network_type(meta: dict) -> str:
    """The network type (``architecture.type``) an adapter's checked metadata names: ``attention`` when absent
    (:func:`~kangaroo_plugins.kangaroo.networks.adapter_class` gives its class)."""
    return str((meta.get("architecture") or {}).get("type", "attention"))



def placement(model) -> dict:
    """Where an adapter of ``model`` lives: the model's device and dtype (it reads the model's hidden states and
    shares its head)."""
    param = next(model.parameters())
    return {"device": param.device, "dtype": param.dtype}

class KangarooAdapter(nn.Module):
    """One attention block on the target's layer-l hidden states; returns states for the shared LM head.

    Ablation variants (paper Table 2): ``ffn`` adds a Llama MLP block after the attention; ``separate_head`` gives the
    adapter its own LM head (initialised from the shared one) instead of sharing the target's; ``draft_head`` gives
    it a trainable head over the draft vocabulary only (rows initialised from the shared head, EAGLE-3 / FR-Spec
    style; needs a draft vocabulary, see :meth:`set_draft_vocab`).
    """

    kind = "attention"
    #: whether the drafter must hand it the target's deep states (:mod:`kangaroo_plugins.kangaroo.deep_context`)
    reads_deep_states = False

    def __init__(self, model_config, *, ffn: bool = False, separate_head: bool = False, draft_head: bool = False,
                 exit_layer: int | None = None):
        super().__init__()
        if separate_head and draft_head:
            raise ValueError("an adapter has either its own full head (separate_head) or a draft-vocabulary head, not both")
        self.ffn, self.separate_head, self.draft_head = ffn, separate_head, draft_head
        self.draft_rows: nn.Parameter | None = None  # the trainable draft head [K, d] (draft_head only)
        self.draft_vocab: torch.Tensor | None = None  # token ids the drafter may propose (None: all)
        family = family_of(model_config)
        config = adapter_config(model_config, exit_layer)  # one layer like layer l (its RoPE), no window
        config._attn_implementation = model_config._attn_implementation or "sdpa"
        if config._attn_implementation not in ("sdpa", "eager"):
            config._attn_implementation = "sdpa"
        self.config = config
        norm = family.module_class("RMSNorm")
        self.input_norm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = family.module_class("Attention")(config, layer_idx=0)
        self.output_norm = norm(config.hidden_size, eps=config.rms_norm_eps)
        # (x, position_ids) -> cos, sin; transformers 5.x Gemma 3's module computes one RoPE per layer type
        self.rotary_emb = rotary_for(family.module_class("RotaryEmbedding")(config))
        if ffn:
            self.mlp_norm = norm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp = family.module_class("MLP")(config)
        if separate_head:
            self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def from_base_layer(cls, model, exit_layer: int, *, ffn: bool = False, separate_head: bool = False,
                        draft_head: bool = False) -> "KangarooAdapter":
        """A sensible untrained adapter: the attention (and MLP) and norms of layer l, the model's final norm."""
        adapter = cls(model.config, ffn=ffn, separate_head=separate_head, draft_head=draft_head, exit_layer=exit_layer)
        layer = model.model.layers[exit_layer]
        adapter.attention.load_state_dict(layer.self_attn.state_dict())
        adapter.input_norm.load_state_dict(layer.input_layernorm.state_dict())
        adapter.output_norm.load_state_dict(model.model.norm.state_dict())
        if ffn:
            adapter.mlp.load_state_dict(layer.mlp.state_dict())
            adapter.mlp_norm.load_state_dict(family_of(model.config).mlp_norm(layer).state_dict())
        if separate_head:
            adapter.head.weight.data.copy_(model.lm_head.weight.data)
        return adapter.to(**placement(model))

    def architecture(self) -> dict:
        size = None if self.draft_vocab is None else len(self.draft_vocab)
        return adapter_architecture(self.config, kind=self.kind, ffn=self.ffn, separate_head=self.separate_head,
                                    draft_head=self.draft_head, draft_vocab_size=size)

    def set_draft_vocab(self, token_ids, shared_head: nn.Module | None = None) -> None:
        """Restrict drafting to these token ids (None: the whole vocabulary). With ``draft_head`` this creates the
        trainable rows, initialised from ``shared_head`` (zeros without one: about to be loaded)."""
        if token_ids is None:
            if self.draft_head:
                raise ValueError("a draft-vocabulary head needs a draft vocabulary")
            self.draft_vocab = None
            return
        ids = torch.as_tensor(sorted({int(t) for t in token_ids}), dtype=torch.long)
        if len(ids) == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary must be non-empty token ids in [0, {self.config.vocab_size})")
        self.draft_vocab = ids
        if self.draft_head:
            param = next(self.parameters())
            rows = (shared_head.weight.detach()[ids.to(shared_head.weight.device)].clone() if shared_head is not None
                    else torch.zeros(len(ids), self.config.hidden_size))
            self.draft_rows = nn.Parameter(rows.to(device=param.device, dtype=param.dtype))

    def train_logits(self, out: torch.Tensor, shared_head: nn.Module) -> torch.Tensor:
        """Adapter output → training logits: over the draft vocabulary [.., K] when there is one (what drafting
        samples from, so confidences are calibrated for it), else over the whole vocabulary [.., V]."""
        if self.draft_head:
            return nn.functional.linear(out, self.draft_rows)
        if self.draft_vocab is None:
            return self.full_logits(out, shared_head)
        base = self.head if self.separate_head else shared_head
        return nn.functional.linear(out, base.weight[self.draft_vocab.to(base.weight.device)])

    def full_logits(self, out: torch.Tensor, shared_head: nn.Module) -> torch.Tensor:
        """Adapter output → logits over the whole vocabulary (training): its own head if it has one, else the
        target's shared head."""
        return self.head(out) if self.separate_head else shared_head(out)

    def drafting_head(self, shared_head: nn.Module) -> nn.Module:
        """The head used for drafting: the full one, or a :class:`DraftHead` over the draft vocabulary (a copy of
        those rows: build it once, as the drafter does when it binds, not per token)."""
        if self.draft_head:
            return DraftHead(self.draft_rows, torch.arange(len(self.draft_vocab), device=self.draft_rows.device),
                             vocab=self.draft_vocab.to(self.draft_rows.device), vocab_size=self.config.vocab_size)
        base = self.head if self.separate_head else shared_head
        if self.draft_vocab is None:
            return base
        return DraftHead(base.weight, self.draft_vocab.to(base.weight.device))

    def logits(self, out: torch.Tensor, shared_head: nn.Module) -> torch.Tensor:
        """Adapter output → drafting logits (-inf outside the draft vocabulary when there is one); for one-off use
        (evaluation, export checks) — it builds the drafting head each call."""
        return self.drafting_head(shared_head)(out)

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits with every token outside the draft vocabulary set to -inf (evaluation)."""
        if self.draft_vocab is None:
            return logits
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[self.draft_vocab.to(logits.device)] = True
        return logits.masked_fill(~keep, float("-inf"))

    def new_cache(self) -> KVCache:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        param = next(self.parameters())
        return KVCache(1, c.num_key_value_heads, head_dim, param.dtype, device=param.device)

    def forward(self, hidden: torch.Tensor, start: int, cache: KVCache | None = None, tree=None) -> torch.Tensor:
        """hidden: layer-l states [B, n, d] of positions start..start+n-1 → [B, n, d] (before the LM head).

        Batches (training) must be right-padded: the causal mask keeps real positions away from the padding.
        ``tree`` (a :class:`~kangaroo_core.tree.TreeAttention`, drafting a token tree): the rows are tree nodes at
        cache slots start..; positions and visibility come from the tree.
        """
        n = hidden.shape[1]
        positions = torch.arange(start, start + n, device=hidden.device)
        if tree is None:
            position_embeddings = self.rotary_emb(hidden, positions[None])
            mask = causal_mask(n, start if cache is not None else 0, hidden.dtype, hidden.device)
        else:
            position_embeddings = self.rotary_emb(hidden, tree.position_ids(hidden.device)[None])
            mask = tree.additive_mask(start + n, hidden.dtype, hidden.device)
        attended, _ = self.attention(
            self.input_norm(hidden),
            position_embeddings=position_embeddings,
            attention_mask=mask,
            cache_position=positions,
            **{cache_keyword(self.attention): cache},
        )
        out = hidden + attended
        if self.ffn:
            out = out + self.mlp(self.mlp_norm(out))
        return self.output_norm(out)

    # -- files -----------------------------------------------------------------------------------------------------
    def save(self, directory: str | Path, *, base_fingerprint: str, exit_layer: int, extra: dict | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items() if "rotary_emb" not in k}
        if self.draft_vocab is not None:
            tensors[DRAFT_VOCAB_TENSOR] = self.draft_vocab.cpu().contiguous()
        save_file(tensors, directory / f".{WEIGHTS_FILE}.tmp")
        os.replace(directory / f".{WEIGHTS_FILE}.tmp", directory / WEIGHTS_FILE)  # atomic: never half a file
        metadata = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kangaroo_version": __version__,
            "base_model_fingerprint": base_fingerprint,
            "exit_layer": exit_layer,
            "architecture": self.architecture(),
            **(extra or {}),
        }
        (directory / f".{METADATA_FILE}.tmp").write_text(json.dumps(metadata, indent=2) + "\n")
        os.replace(directory / f".{METADATA_FILE}.tmp", directory / METADATA_FILE)
        return directory

    @classmethod
    def load(cls, directory: str | Path, model, *, base_fingerprint: str, exit_layer: int) -> "KangarooAdapter":
        """The adapter saved in ``directory``, which must be of this network's type (:attr:`kind`); one of any type:
        :func:`~kangaroo_plugins.kangaroo.networks.load_adapter`."""
        directory = Path(directory)
        meta_path, weights_path = directory / METADATA_FILE, directory / WEIGHTS_FILE
        meta = read_metadata(directory, base_fingerprint=base_fingerprint, exit_layer=exit_layer)
        if network_type(meta) != cls.kind:
            raise AdapterMismatchError(f"adapter {directory} is a {network_type(meta)!r} adapter, not {cls.kind!r} "
                                       "(kangaroo_plugins.kangaroo.networks.load_adapter loads any type)")
        arch = meta.get("architecture") or {}
        variant = {"ffn": bool(arch.get("ffn")), "separate_head": bool(arch.get("separate_head")),
                   "draft_head": bool(arch.get("draft_head"))}
        expected = adapter_architecture(adapter_config(model.config, exit_layer), kind=cls.kind, **variant,
                                        draft_vocab_size=arch.get("draft_vocab_size"))
        if arch != expected:
            raise AdapterMismatchError(f"adapter {directory} architecture {arch} does not fit this model ({expected})")
        try:
            adapter = cls(model.config, **variant, exit_layer=exit_layer).to(**placement(model))
        except ValueError as exc:
            raise AdapterMismatchError(f"adapter {directory}: {exc}") from None
        try:
            state = load_file(weights_path)
        except (SafetensorError, OSError) as exc:
            raise AdapterMismatchError(f"{weights_path} is not a readable safetensors file (truncated or foreign?): {exc}") from None
        draft_vocab = state.pop(DRAFT_VOCAB_TENSOR, None)
        if (draft_vocab is None) != (arch.get("draft_vocab_size") is None) or (
                draft_vocab is not None and len(draft_vocab) != arch["draft_vocab_size"]):
            raise AdapterMismatchError(f"adapter {weights_path}: draft vocabulary does not match {meta_path}")
        if draft_vocab is not None:
            try:
                adapter.set_draft_vocab(draft_vocab.tolist())
            except ValueError as exc:
                raise AdapterMismatchError(f"adapter {weights_path}: {exc}") from None
        try:
            missing, unexpected = adapter.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # a tensor of the wrong shape
            first = str(exc).strip().splitlines()
            raise AdapterMismatchError(f"adapter {weights_path}: {first[-1].strip() if first else exc}") from None
        missing = [k for k in missing if "rotary_emb" not in k and not k.startswith("rope.")]
        if missing or unexpected:
            raise AdapterMismatchError(f"adapter {weights_path}: missing tensors {missing}, unexpected {unexpected}")
        return adapter


def adapter_key(adapter_path: str | os.PathLike | None) -> str:
    """Identifies an adapter in exports: ``untrained`` (initialised from layer l) or a hash of its two files.

    Hashing megabytes happens once per file version (cached by path, mtime and size), never per generation."""
    if adapter_path is None:
        return "untrained"
    paths = [Path(adapter_path) / name for name in (METADATA_FILE, WEIGHTS_FILE)]
    stamp = tuple((str(p.resolve()), p.stat().st_mtime_ns, p.stat().st_size) if p.is_file() else (str(p), None, None)
                  for p in paths)
    if stamp not in _ADAPTER_KEYS:
        digest = hashlib.sha256()
        for path in paths:
            if path.is_file():
                digest.update(path.read_bytes())
        _ADAPTER_KEYS[stamp] = digest.hexdigest()[:16]
    return _ADAPTER_KEYS[stamp]


_ADAPTER_KEYS: dict[tuple, str] = {}
