"""Eager PyTorch backend: a transformers decoder (any family of :mod:`kangaroo_backends.families`) split at the exit
layer into M[:l], M[l:] and the shared head.

Both halves write into one KV cache (layer indices are global); ``shallow`` runs ahead of ``deep`` while drafting,
``crop`` brings both back to the accepted length. Sliding-window layers keep every key in the cache and hide the old
ones by their mask, so ``crop`` and ``keep`` stay exact for them too.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from kangaroo_backends.devices import resolve_dtype
from kangaroo_backends.families import FULL, SLIDING, family_of, layer_kinds, rotary_embeddings, sliding_window
from kangaroo_backends.fast_layers import EXACT_ROWS, fast_layers
from kangaroo_backends.graph_passes import MAX_WIDTH, PassGraph, StaticKVCache, padded_mask, slots_like, width_for
from kangaroo_backends.hf_compat import cache_keyword
from kangaroo_backends.kv_cache import KVCache, causal_mask
from kangaroo_backends.loading import load_model
from kangaroo_backends.native import small_batch_attention, small_batch_kernel
from kangaroo_backends.ragged import Ragged, RaggedCache, exact_rows
from kangaroo_backends.weight_arena import place_weights
from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.flags import Flag
from kangaroo_core.hookspecs import hookimpl
from kangaroo_core.interfaces import Backend, DeepOutput

KERNELS = ("auto", "small-batch", "plain")
GRAPHS = ("auto", "on", "off")
DEFAULT_CACHE_SIZE = 2048
DEFAULT_GRAPH_ROWS = 8


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


def check_start(what: str, start: int, length: int) -> None:
    """Positions are explicit: a call must append right after what the cache holds."""
    if start != length:
        raise RuntimeError(f"{what}: asked to write at position {start}, but the cache holds {length} positions")


def choose_kernel(kernels: str, dtype: torch.dtype, device: torch.device):
    """The small-batch kernel for ``kernels`` (None: plain linears); "small-batch" insists, "auto" falls back."""
    if kernels == "plain":
        return None
    usable = device.type == "cpu" and dtype == torch.float32
    kernel, why = small_batch_kernel() if usable else (None, "it runs float32 on CPU only")
    if kernel is None and kernels == "small-batch":
        raise ConfigError(f"kernels=small-batch is unavailable: {why}; use kernels=plain")
    return kernel


def check_graph_options(graphs: str, cache_size: int, graph_rows: int) -> dict:
    """The captured path's options, checked in one line each."""
    if graphs not in GRAPHS:
        raise ConfigError(f"graphs must be one of {', '.join(GRAPHS)}, got {graphs!r}")
    if not isinstance(cache_size, int) or cache_size < 2 * MAX_WIDTH:
        raise ConfigError(f"cache_size must be an integer >= {2 * MAX_WIDTH}, got {cache_size!r}")
    if not isinstance(graph_rows, int) or not 1 <= graph_rows <= MAX_WIDTH:
        raise ConfigError(f"graph_rows must be an integer in [1, {MAX_WIDTH}], got {graph_rows!r}")
    return {"graphs": graphs, "cache_size": cache_size, "graph_rows": graph_rows}


class TorchBackend(Backend):
    """The target model in eager PyTorch (CPU or CUDA).

    ``kernels`` picks how multi-position passes run: ``"auto"`` (default) uses the backend's own view of the layers
    (:mod:`kangaroo_backends.fast_layers`: the small-batch verify kernel on CPU float32, grouped-query attention
    everywhere) so verifying n <= 8 positions costs about one forward; ``"plain"`` runs transformers' layers as they
    are; ``"small-batch"`` is "auto" that refuses to fall back.
    """

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

    def _chain_fn(self, fn, kinds):
        """``fn`` for a chain pass whose slots, positions and masks are computed from ``start`` on the device (so a
        captured chain pass takes two small copies from the host: its rows and where they start)."""
        def chain(x, start):
            slots = start + torch.arange(x.shape[0], device=self.device)
            keys = torch.arange(self.cache.capacity, device=self.device)[None]
            causal = keys <= slots[:, None]
            zero = torch.zeros((), dtype=self.dtype, device=self.device)
            low = torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
            masks = {}
            for kind in set(kinds):
                seen = causal & (keys > slots[:, None] - self.window) if kind == SLIDING else causal
                masks[kind] = torch.where(seen, zero, low)[None, None]
            return fn(x, slots, slots[None], **masks)
        return chain

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

    def _captured_pass(self, part: str, fn, kinds, x: torch.Tensor, start: int, tree) -> tuple[torch.Tensor, ...]:
        """A chain pass: its rows and start copied into its width's graph; a tree pass: padded rows, positions and
        masks; a prompt: once, eagerly, at its own length."""
        n = x.shape[0]
        width = width_for(n, self.graph_rows)
        capture = self.device.type == "cuda"
        if width is not None and tree is None:
            key = (part, width, "chain")
            if key not in self.pass_graphs:
                rows = torch.zeros((width, *x.shape[1:]), dtype=x.dtype, device=self.device)
                inputs = {"x": rows, "start": slots_like(self.device)}
                self.pass_graphs[key] = PassGraph(self._chain_fn(fn, kinds), inputs, capture=capture)
            return tuple(t[:n] for t in self.pass_graphs[key].run_prefix(x=x, start=torch.tensor([start])))
        slots, position_ids, masks = self._pass_inputs(kinds, n, start, tree)
        if width is None:
            return fn(x, slots, position_ids, **{k: padded_mask(m, n, n, start, self.cache.capacity, self.dtype,
                                                                self.device) for k, m in masks.items()})
        pad = width - n
        inputs = {"ids" if part == "shallow" else "hidden": torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]),
                  "slots": torch.cat([slots, torch.arange(start + n, start + width, device=self.device)]),
                  "position_ids": torch.cat([position_ids[0], slots.new_zeros(pad)])[None],
                  **{k: padded_mask(m, n, width, start, self.cache.capacity, self.dtype, self.device)
                     for k, m in masks.items()}}
        if (part, width) not in self.pass_graphs:
            self.pass_graphs[part, width] = PassGraph(fn, inputs, capture=capture)
        return tuple(t[:n] for t in self.pass_graphs[part, width].run(**inputs))

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

    # -- many streams: a view per stream (its own cache), their rows in one ragged pass ---------------------------
    def stream_view(self) -> "TorchBackend":
        view = copy.copy(self)  # layers, weights and options shared
        view.cache, view.pass_graphs = self._new_cache(), {}
        return view

    def _ragged(self, parts) -> bool:
        """Whether these parts run as one ragged pass: only where every row is computed alone whatever the pass
        holds (the small-batch kernels: CPU float32), every part a chain or tree of at most 16 rows (a longer one,
        a prompt, runs alone as its stream would run it). Elsewhere (a GPU's GEMMs may round a row differently
        beside other rows) each stream's pass runs on its own: still continuous batching, not yet merged."""
        return (len(parts) > 1 and self.kernels == "small-batch" and not self.use_graphs
                and all(len(p[1]) <= EXACT_ROWS for p in parts))

    def _ragged_pass(self, layers, kinds, hidden: torch.Tensor, parts) -> torch.Tensor:
        """``hidden`` [N, d]: the rows of ``parts`` (view, rows, start, tree) end to end, through ``layers``."""
        bounds, lo = [], 0
        for _, rows, _, _ in parts:
            bounds.append((lo, lo + len(rows)))
            lo += len(rows)
        inputs = [view._pass_inputs(kinds, len(rows), start, tree) for view, rows, start, tree in parts]
        slots = torch.cat([i[0] for i in inputs])
        position_ids = torch.cat([i[1] for i in inputs], dim=1)
        masks = {kind: Ragged(tuple(bounds), tuple(i[2][kind] for i in inputs)) for kind in set(kinds)}
        cache = RaggedCache([view.cache for view, *_ in parts], bounds)
        with exact_rows():
            return self._run_layers(layers, kinds, hidden[None], slots, position_ids, masks, cache)[0]

    @torch.inference_mode()
    def shallow_many(self, parts):
        if not self._ragged(parts):
            return super().shallow_many(parts)
        for view, ids, start, _ in parts:
            check_start("shallow", start, view.cache.lengths[0])
        ids = torch.as_tensor([t for _, part_ids, _, _ in parts for t in part_ids], dtype=torch.long,
                              device=self.device)
        out = self._ragged_pass(self.shallow_layers, self.shallow_kinds, self.embed_tokens(ids[None])[0], parts)
        return list(out.split([len(p[1]) for p in parts]))

    @torch.inference_mode()
    def deep_many(self, parts):
        plain = [(view, hidden, start, tree) for view, hidden, start, _, tree in parts]
        if not self._ragged(plain):
            return super().deep_many(parts)
        for view, _, start, _, _ in parts:
            check_start("deep", start, view.cache.lengths[self.exit_layer])
        out = self.final_norm(self._ragged_pass(self.deep_layers, self.deep_kinds,
                                                torch.cat([p[1] for p in parts]), plain))
        states = out.split([p[1].shape[0] for p in parts])
        picked = [s if rows is None else s[list(rows)] for s, (_, _, _, rows, _) in zip(states, parts)]
        with exact_rows():
            logits = self.lm_head(torch.cat(picked)).split([p.shape[0] for p in picked])
        return [DeepOutput(logits=lg, hidden=st) for lg, st in zip(logits, states)]


@hookimpl
def register_backends(register):
    register("torch", TorchBackend)
