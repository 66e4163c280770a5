"""The PyTorch backend: a transformers decoder (any family of :mod:`kangaroo_backends.families`) split at the exit
layer into M[:l], M[l:] and the shared head, on CPU or CUDA.

Both halves write into one KV cache (layer indices are global); ``shallow`` runs ahead of ``deep`` while drafting,
``crop`` brings both back to the accepted length. Sliding-window layers keep every key in the cache and hide the old
ones by their mask, so ``crop`` and ``keep`` stay exact for them too.

Three strategies, one module each: eager passes (here), the captured path of fixed-width graphs
(:mod:`kangaroo_backends.torch_captured`, ``--graphs on``) and many streams' rows in one ragged pass
(:mod:`kangaroo_backends.torch_ragged`, for :class:`~kangaroo_core.batching.Batch`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from kangaroo_backends.devices import resolve_dtype
from kangaroo_backends.families import FULL, SLIDING, family_of, layer_kinds, rotary_embeddings, sliding_window
from kangaroo_backends.fast_layers import fast_layers
from kangaroo_backends.graph_passes import MAX_WIDTH, StaticKVCache
from kangaroo_backends.hf_compat import cache_keyword
from kangaroo_backends.kv_cache import KVCache, causal_mask, check_start
from kangaroo_backends.loading import load_model
from kangaroo_backends.native import small_batch_attention, small_batch_kernel, sources_digest
from kangaroo_backends.torch_captured import (GRAPHS, DEFAULT_CACHE_SIZE, DEFAULT_GRAPH_ROWS, CapturedPasses,
                                              check_graph_options)
from kangaroo_backends.torch_ragged import RaggedPasses
from kangaroo_backends.weight_arena import place_weights
from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.flags import Flag
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Backend, DeepOutput

__all__ = ["GRAPHS", "KERNELS", "TorchBackend", "describe_split_model", "model_fingerprint"]

KERNELS = ("auto", "small-batch", "plain")


def model_fingerprint(model) -> str:
    """Hash of the architecture and a slice of the weights: cheap, and different for any other base model."""
    cfg = model.config
    arch = {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "vocab_size", "intermediate_size")}
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True).encode())
    with torch.no_grad():
        for tensor in (model.model.embed_tokens.weight[:64], model.model.norm.weight, model.lm_head.weight[-64:]):
            digest.update(tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def describe_split_model(backend: Backend, model, tokenizer, exit_layer: int, model_name: str) -> None:
    """Set the identity attributes every backend of a transformers model shares (and check the exit layer)."""
    config = model.config
    backend.family = family_of(config)  # refuses an unsupported architecture in one line
    backend.num_layers = config.num_hidden_layers
    if not 1 <= exit_layer < backend.num_layers:
        raise ConfigError(f"exit_layer must be in [1, {backend.num_layers - 1}] for this {backend.num_layers}-layer model, got {exit_layer}")
    backend.model = model.eval()
    backend.tokenizer = tokenizer
    backend.exit_layer = exit_layer
    backend.model_name = model_name
    backend.vocab_size = config.vocab_size
    backend.hidden_size = config.hidden_size
    backend.max_context = config.max_position_embeddings
    backend.fingerprint = model_fingerprint(model)
    eos = model.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    backend.eos_token_ids = frozenset([eos] if isinstance(eos, int) else list(eos or []))


def choose_kernel(kernels: str, dtype: torch.dtype, device: torch.device):
    """The small-batch kernel for ``kernels`` (None: plain linears); "small-batch" insists, "auto" falls back."""
    if kernels == "plain":
        return None
    usable = device.type == "cpu" and dtype == torch.float32
    kernel, why = small_batch_kernel() if usable else (None, "it runs float32 on CPU only")
    if kernel is None and kernels == "small-batch":
        raise ConfigError(f"kernels=small-batch is unavailable: {why}; use kernels=plain")
    return kernel


class TorchBackend(CapturedPasses, RaggedPasses, Backend):
    """The target model in PyTorch (CPU or CUDA).

    ``kernels`` picks how multi-position passes run: ``"auto"`` (default) uses the backend's own view of the layers
    (:mod:`kangaroo_backends.fast_layers`: the small-batch verify kernel on CPU float32, grouped-query attention
    everywhere) so verifying n <= 8 positions costs about one forward; ``"plain"`` runs transformers' layers as they
    are; ``"small-batch"`` is "auto" that refuses to fall back.
    """

    @property
    def kernel_sources(self) -> str:
        """A digest of the package's C kernels (:func:`~kangaroo_backends.native.sources_digest`)."""
        return sources_digest()

    name = "torch"
    runtime = "torch"
    supports_trees = True
    flags = (Flag("--kernels", "kernels", choices=KERNELS,
                  help="How multi-position (verify) passes run. auto (default): the small-batch verify kernel on CPU "
                       "float32 (built once with the C compiler) + grouped attention; plain: transformers' layers as "
                       "they are; small-batch: auto, refusing to fall back."),
             Flag("--graphs", "graphs", choices=GRAPHS,
                  help="The captured decode path: a preallocated KV cache and passes padded to fixed widths, captured "
                       "as CUDA graphs on CUDA (run eagerly on CPU). auto (default): on for CUDA, off on CPU."),
             Flag("--cache-size", "cache_size", type=int, metavar="N",
                  help="--graphs on: positions preallocated in the KV cache (default 2048; prompt + new tokens must "
                       "fit in N - 64)."),
             Flag("--graph-rows", "graph_rows", type=int, metavar="N",
                  help="--graphs on: every pass is padded to at least N rows (default 8), so the target alone and a "
                       "chain's verify passes share one shape."))

    def __init__(self, model, tokenizer, exit_layer: int, model_name: str = "model", kernels: str = "auto",
                 graphs: str = "auto", cache_size: int = DEFAULT_CACHE_SIZE, graph_rows: int = DEFAULT_GRAPH_ROWS):
        config = model.config
        if kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
        describe_split_model(self, model, tokenizer, exit_layer, model_name)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.kernels = kernels
        self.graph_options = check_graph_options(graphs, cache_size, graph_rows)
        self.use_graphs = graphs == "on" or (graphs == "auto" and self.device.type == "cuda")
        self.graph_rows = graph_rows
        inner = model.model
        self.embed_tokens = inner.embed_tokens  # Gemma 3's scales by sqrt(hidden) itself
        self.rotary = rotary_embeddings(model)
        self.cache_keyword = cache_keyword(inner.layers[0])  # past_key_values (transformers 4.x) or cache (5.x)
        self.window = sliding_window(config)
        kinds = layer_kinds(config)
        self.shallow_kinds, self.deep_kinds = kinds[:exit_layer], kinds[exit_layer:]
        layers, self.lm_head = inner.layers, model.lm_head
        if kernels != "plain":
            kernel = choose_kernel(kernels, self.dtype, self.device)
            attention = small_batch_attention()[0] if kernel is not None else None
            layers = fast_layers(inner.layers, kernel, config, attention)
            self.lm_head = fast_layers([model.lm_head], kernel, config)[0]
            self.kernels = "small-batch" if kernel is not None else "grouped-attention"
        self.shallow_layers = layers[:exit_layer]
        self.deep_layers = layers[exit_layer:]
        self.final_norm = inner.norm
        if self.use_graphs:  # a pass at the last position still writes a whole width of slots
            self.max_context = min(self.max_context, cache_size - MAX_WIDTH)
        self.cache = self._new_cache()
        self.pass_graphs: dict = {}  # (part, width) -> PassGraph, made at first use (captured path)

    def _new_cache(self) -> KVCache:
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if self.use_graphs:
            return StaticKVCache(self.num_layers, config.num_key_value_heads, head_dim, self.dtype,
                                 self.graph_options["cache_size"], device=self.device)
        return KVCache(self.num_layers, config.num_key_value_heads, head_dim, self.dtype, device=self.device)

    @classmethod
    def create(cls, config: DecodeConfig, model: Any = None, device: str | None = None, dtype: str = "float32",
               kernels: str = "auto", graphs: str = "auto", cache_size: int = DEFAULT_CACHE_SIZE,
               graph_rows: int = DEFAULT_GRAPH_ROWS) -> "TorchBackend":
        if kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
        check_graph_options(graphs, cache_size, graph_rows)  # before the load
        loaded, tokenizer, name = load_model(model, dtype=resolve_dtype(dtype), device=device)
        if kernels != "plain" and loaded.device.type == "cpu":  # a model we loaded ourselves (one passed in is left as it is)
            place_weights(loaded)  # aligned, huge-page-backed CPU weights, same values (kangaroo_backends.weight_arena)
        return cls(loaded, tokenizer, config.exit_layer, name, kernels=kernels, graphs=graphs, cache_size=cache_size,
                   graph_rows=graph_rows)

    def base_model(self):
        return self.model

    def shared_head(self):
        return self.model.lm_head  # the model's own module (drafters read its weight)

    def resplit(self, exit_layer: int) -> "TorchBackend":
        kernels = "plain" if self.kernels == "plain" else "auto"
        return type(self)(self.model, self.tokenizer, exit_layer, self.model_name, kernels=kernels,
                          **self.graph_options)

    # -- cache: one KVCache for all layers (global layer indices); M[:l] runs ahead of M[l:] while drafting ---------
    def reset(self) -> None:
        self.cache.reset()

    @torch.inference_mode()  # the buffers were written under inference mode: so are the moves
    def keep(self, positions: Sequence[int]) -> None:
        self.cache.keep(positions)

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    def cache_lengths(self) -> tuple[int, int]:
        return self.cache.lengths[0], self.cache.lengths[self.exit_layer]

    # -- the split model -------------------------------------------------------------------------------------------
    def _mask(self, n: int, start: int, tree, window: int | None):
        if tree is None:
            return causal_mask(n, start, self.dtype, self.device, window=window)
        # token tree: each row sees the committed prefix and its own ancestors
        return tree.additive_mask(start + n, self.dtype, self.device, window=window)

    def _run_layers(self, layers, kinds, hidden: torch.Tensor, slots: torch.Tensor, position_ids: torch.Tensor,
                    masks: dict, cache=None) -> torch.Tensor:
        """``hidden`` [1, n, d] through ``layers``, writing keys/values at ``cache`` (default: this backend's)
        ``slots`` [n] (RoPE at ``position_ids`` [1, n]; ``masks`` by layer kind)."""
        used = set(kinds)
        both = self.family.layer_takes_both_ropes
        rope = {kind: self.rotary[kind](hidden, position_ids) for kind in (FULL, SLIDING) if kind in used or both}
        for layer, kind in zip(layers, kinds):
            out = layer(
                hidden,
                attention_mask=masks[kind],
                position_ids=position_ids,
                cache_position=slots,  # the static cache writes here (transformers 5.x hands it on in kwargs)
                **{self.cache_keyword: self.cache if cache is None else cache},
                **self.family.layer_rope_kwargs(rope.get(FULL), rope.get(SLIDING), kind),
            )
            hidden = out[0] if isinstance(out, tuple) else out  # Gemma 3's layers return a tuple
        return hidden

    def _pass_inputs(self, kinds, n: int, start: int, tree) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Cache slots [n], position ids [1, n] (a tree's: by depth) and a mask per layer kind of a pass."""
        slots = torch.arange(start, start + n, device=self.device)
        position_ids = slots[None] if tree is None else tree.position_ids(self.device)[None]
        masks = {kind: self._mask(n, start, tree, self.window if kind == SLIDING else None) for kind in set(kinds)}
        return slots, position_ids, masks

    def _shallow_fn(self, ids, slots, position_ids, **masks):
        hidden = self.embed_tokens(ids[None])
        return (self._run_layers(self.shallow_layers, self.shallow_kinds, hidden, slots, position_ids, masks)[0],)

    def _deep_states(self, hidden, slots, position_ids, **masks):
        """M[l:] + final norm: states [n, d] → [n, d]."""
        return self.final_norm(self._run_layers(self.deep_layers, self.deep_kinds, hidden[None], slots, position_ids,
                                                masks))[0]

    def _deep_fn(self, hidden, slots, position_ids, **masks):
        out = self._deep_states(hidden, slots, position_ids, **masks)
        return self.lm_head(out), out

    def _pass(self, part: str, x: torch.Tensor, start: int, tree) -> tuple[torch.Tensor, ...]:
        """Run the shallow or deep ``part`` over ``x`` (ids [n] or states [n, d]) at ``start``: eagerly, or on the
        captured path (see :mod:`kangaroo_backends.graph_passes`)."""
        shallow = part == "shallow"
        kinds, fn = (self.shallow_kinds, self._shallow_fn) if shallow else (self.deep_kinds, self._deep_fn)
        if not self.use_graphs:
            slots, position_ids, masks = self._pass_inputs(kinds, x.shape[0], start, tree)
            return fn(x, slots, position_ids, **masks)
        out = self._captured_pass(part, fn, kinds, x, start, tree)
        self.cache.advance(range(0, self.exit_layer) if shallow else range(self.exit_layer, self.num_layers),
                           start + x.shape[0])  # a captured update cannot count: the cache's lengths are set here
        return out

    @torch.inference_mode()
    def shallow(self, token_ids: Sequence[int], start: int, tree=None) -> torch.Tensor:
        check_start("shallow", start, self.cache.lengths[0])
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)  # [n]
        return self._pass("shallow", ids, start, tree)[0]  # [n, d]

    @torch.inference_mode()
    def deep(self, hidden: torch.Tensor, start: int, rows: Sequence[int] | None = None, tree=None) -> DeepOutput:
        check_start("deep", start, self.cache.lengths[self.exit_layer])
        if not self.use_graphs:  # the LM head on the picked rows only (a prompt's last row)
            slots, position_ids, masks = self._pass_inputs(self.deep_kinds, hidden.shape[0], start, tree)
            out = self._deep_states(hidden, slots, position_ids, **masks)  # [n, d]
            picked = out if rows is None else out[torch.as_tensor(list(rows), dtype=torch.long, device=out.device)]
            return DeepOutput(logits=self.lm_head(picked), hidden=out)  # logits [r, V]
        logits, out = self._pass("deep", hidden, start, tree)
        if rows is not None:
            logits = logits[torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)]
        return DeepOutput(logits=logits, hidden=out)


@hookimpl
def register_backends(register):
    register("torch", TorchBackend)
