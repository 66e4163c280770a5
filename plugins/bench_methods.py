"""Built-in bench methods for ``kangaroo bench``.

* ``hf_vanilla`` — transformers ``generate``, greedy: the reference for speedups and for losslessness;
* ``hf_static`` — transformers ``generate`` with a static KV cache (``cache_implementation="static"``), which
  transformers compiles itself on CUDA (``torch.compile``, mode ``reduce-overhead``: CUDA graphs);
* ``hf_prompt_lookup`` — transformers prompt-lookup decoding (``prompt_lookup_num_tokens=10``);
* ``hf_early_exit`` — transformers ``assistant_early_exit=l`` (LayerSkip-style self-speculation at our exit layer);
* ``vanilla`` — our engine with no drafter (the same loop, one token per pass);
* ``kangaroo`` — our engine with the configured drafter, adapter, policy and verifier.

The onnxruntime methods (``ort_vanilla``, ``vanilla_onnx``, ``kangaroo_onnx``) live in
:mod:`kangaroo_plugins.onnx_bench_methods`.

The transformers methods run on the backend's own model object (loaded once, shared). They report CR as new tokens
per full-depth target pass (counted with a pre-hook on the last decoder layer, which early-exit drafts never reach),
and no CTAR (transformers does not expose per-round acceptance).

Every method's clock is read after the device's queued work (:func:`sync`): CUDA runs asynchronously, and a clock read
while kernels are still queued measures the launches, not the work.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch

from kangaroo_backends.devices import synchronize
from kangaroo_core.bench_context import RUN_DEFAULT, BenchContext, BenchMethod, Messages, MethodResult, trim
from kangaroo_core.errors import KangarooError
from kangaroo_core.hookspecs import hookimpl


def sync(device: Any) -> None:
    """Wait for a CUDA device's queued work before the clock is read (a CPU device, or none: nothing to wait for)."""
    if isinstance(device, torch.device) and torch.cuda.is_available():
        synchronize(device)


class HFGenerate(BenchMethod):
    """transformers ``model.generate`` on the shared model; subclasses add generate kwargs."""

    name = "hf_vanilla"
    rank = 0

    def generate_kwargs(self, context: BenchContext) -> dict[str, Any]:
        return {}

    def load_model(self, context: BenchContext) -> Any:
        """The object whose ``generate`` is measured: the bench's own transformers model."""
        model = context.model
        if model is None or not hasattr(model, "generate"):
            raise KangarooError(f"{self.name} needs a backend holding a transformers model (the torch backend)")
        return model

    def prepare(self, context: BenchContext) -> None:
        model = self.load_model(context)
        self.context, self.model = context, model
        sampling = context.config.sampling
        eos = sorted(context.eos_token_ids)
        self.kwargs: dict[str, Any] = {"pad_token_id": eos[0] if eos else None}
        if sampling.greedy:
            self.kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            self.kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                               top_p=sampling.top_p)
        self.seed = sampling.seed
        self.kwargs.update(self.generate_kwargs(context))
        # full-depth passes are counted on the last decoder layer (an ONNX model has none: CR is not reported)
        try:
            base = model.get_decoder()  # every family (Gemma 3's base_model_prefix is empty)
        except (AttributeError, NotImplementedError):
            base = None
        layers = getattr(base, "layers", None) if isinstance(base, torch.nn.Module) else None
        self.last_layer = layers[-1] if layers is not None and len(layers) else None

    @torch.inference_mode()
    def run(self, messages: Messages, max_new_tokens: int) -> MethodResult:
        ids = torch.tensor([self.context.encode(messages)], device=self.model.device)
        passes = [0]

        def count(_module, _args):
            passes[0] += 1

        handle = self.last_layer.register_forward_pre_hook(count) if self.last_layer is not None else None
        try:
            if self.seed is not None:
                torch.manual_seed(self.seed)
            sync(ids.device)
            started = time.perf_counter()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      **self.kwargs)
            sync(ids.device)
            seconds = time.perf_counter() - started
        finally:
            if handle is not None:
                handle.remove()
        new = out[0, ids.shape[1]:].tolist()
        return MethodResult(trim(new, self.context.eos_token_ids, max_new_tokens), seconds,
                            target_passes=passes[0] or None, generated_tokens=len(new))


class HFStatic(HFGenerate):
    """transformers ``generate`` with a static KV cache, as transformers recommends for speed: on CUDA it compiles the
    decoding forward itself (``torch.compile``, mode ``reduce-overhead``, i.e. CUDA graphs; the prefill stays eager);
    on the CPU it runs the static cache eagerly (transformers compiles there only when asked).

    transformers keeps one static cache per model and reallocates it, at a new size, whenever a generation needs more
    room — and a new size means compiling again. So that no timed turn pays for compiling, a turn that needs more
    room first grows the cache outside the clock, to a power of two (at least 256 slots, at most the model's
    context), with a short untimed generation that compiles and captures the new size. The timed call is the plain
    ``model.generate(..., cache_implementation="static")``. No drafter, so no target alone (its identity check is
    against ``hf_vanilla``); CR is 1 by construction: one full pass per new token (no pass-counting hook — a hook
    would force recompiles and does not run under CUDA-graph replay).
    """

    name = "hf_static"
    rank = 1
    target_alone = ""  # transformers' own target, compiled: compared with hf_vanilla (identical_to_vanilla)

    def generate_kwargs(self, context: BenchContext) -> dict[str, Any]:
        return {"cache_implementation": "static"}

    def prepare(self, context: BenchContext) -> None:
        super().prepare(context)
        self.last_layer = None
        text_config = self.model.config.get_text_config()
        self.max_positions = getattr(text_config, "max_position_embeddings", None)

    def cache_slots(self) -> int:
        """Slots of the static cache transformers holds for this model now (0: none yet): transformers 4.x keeps the
        cache on the model (``_cache``); 5.x makes one per call, of the largest size asked so far
        (``_previous_max_cache_length``), so a turn within that size compiles nothing new either."""
        cache = getattr(self.model, "_cache", None)
        if cache is not None:
            return getattr(cache, "max_cache_len", 0) or 0
        return max(0, getattr(self.model, "_previous_max_cache_length", 0) or 0)

    @torch.inference_mode()
    def grow_cache(self, prompt: list[int], max_new_tokens: int) -> None:
        """Outside the clock: make transformers' static cache hold this turn (generate allocates prompt + new - 1
        slots), compiling and capturing the new size with a 4-token generation over a filler prompt."""
        need = len(prompt) + max_new_tokens - 1
        if need <= self.cache_slots():
            return
        size = max(256, 1 << (need - 1).bit_length())
        size = max(need, min(size, self.max_positions or size))
        steps = min(4, size)
        filler = (prompt * (size // max(1, len(prompt)) + 1))[: size - steps + 1]
        ids = torch.tensor([filler], device=self.model.device)
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                            **self.kwargs)

    def run(self, messages: Messages, max_new_tokens: int) -> MethodResult:
        self.grow_cache(self.context.encode(messages), max_new_tokens)
        result = super().run(messages, max_new_tokens)
        return attrs.evolve(result, target_passes=result.generated_tokens)


class HFPromptLookup(HFGenerate):
    """transformers prompt-lookup decoding: drafts are n-gram matches copied from the prompt."""

    name = "hf_prompt_lookup"
    rank = 1

    def __init__(self, prompt_lookup_num_tokens: int = 10):
        self.num_tokens = prompt_lookup_num_tokens

    def generate_kwargs(self, context: BenchContext) -> dict[str, Any]:
        return {"prompt_lookup_num_tokens": self.num_tokens}


class HFEarlyExit(HFGenerate):
    """transformers self-speculation with an early exit at layer l (LayerSkip): drafts from M[:l] + final norm + head."""

    name = "hf_early_exit"
    rank = 2

    def __init__(self, exit_layer: int | None = None):
        self.exit_layer = exit_layer

    def generate_kwargs(self, context: BenchContext) -> dict[str, Any]:
        return {"assistant_early_exit": self.exit_layer or context.config.exit_layer}


class EngineMethod(BenchMethod):
    """Our engine on the shared backend: the target alone unless a subclass builds the engine otherwise."""

    def make_engine(self, context: BenchContext):
        return context.engine(drafter=None)

    def prepare(self, context: BenchContext) -> None:
        self.engine = self.make_engine(context)

    def run(self, messages: Messages, max_new_tokens: int) -> MethodResult:
        ids = self.engine.encode(list(messages))
        sync(getattr(self.engine.backend, "device", None))  # no earlier queued work in this run's time
        result = self.engine.generate_ids(ids, max_new_tokens)
        # the engine's own clock: prefill + loop, without a policy's untimed preparation (the oracle's reference);
        # every round ends on token ids read back to the host, so that clock runs after the device's work
        return MethodResult(list(result.token_ids), result.seconds, rounds=list(result.rounds))


class KangarooMethod(EngineMethod):
    """Our engine with drafting. Options override the run's choices: ``eta``, ``gamma``, ``adapter``, ``exit_layer``,
    ``policy`` and ``policy_options`` (a dict; None: the run's ``--policy-option`` values)."""

    name = "kangaroo"
    rank = 4
    target_alone = "vanilla"
    #: the drafter plugin (None: the run's ``--drafter``)
    drafter: str | None = None

    def __init__(self, eta: float | None = None, gamma: int | None = None, adapter: str | None = None,
                 exit_layer: int | None = None, policy: str | None = None, policy_options: dict | None = None,
                 drafter: str | None = None):
        self.eta, self.gamma, self.adapter, self.exit_layer = eta, gamma, adapter, exit_layer
        self.policy, self.policy_options = policy, policy_options
        self.drafter = drafter if drafter is not None else type(self).drafter

    def config_for(self, context: BenchContext):
        changes = {k: v for k, v in (("eta", self.eta), ("gamma", self.gamma), ("exit_layer", self.exit_layer))
                   if v is not None}
        return context.config.replace(**changes)

    @property
    def adapter_or_default(self) -> Any:
        return self.adapter if self.adapter is not None else RUN_DEFAULT

    def make_engine(self, context: BenchContext):
        return context.engine(config=self.config_for(context), adapter=self.adapter_or_default, policy=self.policy,
                              policy_options=self.policy_options, drafter=self.drafter or RUN_DEFAULT,
                              **self.tree_arguments(context))

    def tree_arguments(self, context: BenchContext) -> dict[str, Any]:
        """``tree`` / ``tree_options`` for :meth:`BenchContext.engine` (none: chain rounds)."""
        return {}


class KangarooHybridMethod(KangarooMethod):
    """Our engine with the hybrid drafter (prompt lookup where it has been accepted, the adapter otherwise)."""

    name = "kangaroo_hybrid"
    rank = 4
    drafter = "kangaroo-hybrid"


class KangarooTreeMethod(KangarooMethod):
    """Our engine drafting a token tree per round (the run's drafter and adapter; the shaper ``tree``, else the
    run's ``--tree NAME``, else ``dynamic``). Options: ``budget`` (nodes verified per round, or "auto"), ``topk``,
    ``depth``; unset ones come from the run's ``--tree-budget`` / ``--tree-topk`` / ``--tree-depth``."""

    name = "kangaroo_tree"
    rank = 5

    def __init__(self, tree: str | None = None, budget: int | str | None = None, topk: int | None = None,
                 depth: int | None = None, **options: Any):
        super().__init__(**options)
        self.tree = tree
        self.tree_options = {k: v for k, v in (("budget", budget), ("topk", topk), ("depth", depth)) if v is not None}

    def tree_arguments(self, context: BenchContext) -> dict[str, Any]:
        return {"tree": self.tree or getattr(context, "tree", None) or "dynamic", "tree_options": self.tree_options}


class VanillaMethod(EngineMethod):
    """Our engine with no drafter: one token per pass (the engine's own baseline)."""

    name = "vanilla"
    rank = 3


@hookimpl
def register_bench_methods(register):
    register("hf_vanilla", HFGenerate)
    register("hf_static", HFStatic)
    register("hf_prompt_lookup", HFPromptLookup)
    register("hf_early_exit", HFEarlyExit)
    register("vanilla", VanillaMethod)
    register("kangaroo", KangarooMethod)
    register("kangaroo_hybrid", KangarooHybridMethod)
    register("kangaroo_tree", KangarooTreeMethod)
