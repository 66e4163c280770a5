"""Kangaroo inside transformers: ``model.generate(..., custom_generate=kangaroo_generate)``.

transformers (4.57 and 5.x alike) hands a callable ``custom_generate`` the prepared ``generation_config``,
``logits_processor`` and ``stopping_criteria``; :func:`kangaroo_generate` runs the Kangaroo loop on the caller's
*already loaded* model (its modules and weights shared, nothing reloaded) and returns what ``generate`` returns::

    from kangaroo_apps.hf import kangaroo_generate
    out = model.generate(input_ids, max_new_tokens=64, custom_generate=kangaroo_generate)   # == plain generate()

What maps where:
    max_new_tokens / max_length  the token budget (``generation_config.max_length`` minus the prompt).
    eos_token_id                 the engine's end-of-sequence set; every other stopping criterion (stop strings,
                                 max_time, your own) is checked after each emitted token, as ``generate`` does.
    do_sample, temperature, top_k, top_p
                                 :class:`~kangaroo_core.config.SamplingConfig`; speculative sampling keeps the
                                 output distributed as ``generate``'s. The seed is drawn from torch's global generator,
                                 so ``torch.manual_seed(s)`` before the call reproduces a sampled answer.
    streamer                     transformers does not pass ``streamer=`` to a callable: give it as
                                 ``kangaroo_streamer=`` (any ``BaseStreamer``, e.g. ``TextStreamer``); it receives the
                                 prompt, then each round's accepted tokens, then ``end()``.

Refused in one line (a :class:`~kangaroo_core.errors.KangarooError`): batch > 1, padding in the attention mask,
beam search, several return sequences, scores/logits/attentions/hidden states in the output, logits processors
other than the sampling warpers (repetition penalty, min length, ...), an adapter made for another model.

The engine (backend view of the layers, adapter) is built at the first call and cached on the model object for the
next ones; :func:`last_result` gives the :class:`~kangaroo_core.results.GenerationResult` (CR, timings) of the last
call.
"""

from __future__ import annotations


import torch

from kangaroo_core.config import DEFAULT_EXIT_LAYER, DEFAULT_POLICY, DecodeConfig, SamplingConfig
from kangaroo_core.errors import KangarooError
from kangaroo_core.machine import host_threads

#: Logits processors that are the sampling warpers Kangaroo applies itself (from generation_config's values).
SAMPLING_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")
#: Output options of generate() that Kangaroo cannot fill in (its passes are not one forward per token).
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")

#: attributes on the user's model object: its engines (by settings) and the last result. Kept on the model itself,
#: not in a module-level map, so ``del model`` frees everything (engine -> backend -> model is a collectable cycle).
ENGINES_ATTR = "_kangaroo_engines"
LAST_ATTR = "_kangaroo_last_result"


class UnsupportedGenerateOption(KangarooError, ValueError):
    """A ``generate()`` option that the Kangaroo loop cannot honour losslessly."""


def kangaroo_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    *,
    kangaroo_streamer=None,
    kangaroo_adapter: str | None = None,
    kangaroo_exit_layer: int | None = None,
    kangaroo_eta: float = 0.6,
    kangaroo_gamma: int = 6,
    kangaroo_policy: str = DEFAULT_POLICY,
    kangaroo_kernels: str = "auto",
    **model_kwargs,
):
    """The Kangaroo loop as transformers' ``custom_generate`` (see the module docstring for what maps where).

    Args:
        kangaroo_streamer (transformers.generation.streamers.BaseStreamer | None): a transformers streamer fed as
            the answer grows (``streamer=`` is dropped by transformers for callables).
        kangaroo_adapter: an adapter directory or shipped adapter name; None: the shipped adapter made for this
            model at this exit layer (an untrained one, still lossless, when none fits).
        kangaroo_exit_layer: None (default) for the layer of the shipped adapter made for this model, else 2.
        kangaroo_eta: as the CLI's ``--eta``.
        kangaroo_gamma: as the CLI's ``--gamma``.
        kangaroo_policy: as the CLI's ``--policy``.
        kangaroo_kernels: as the CLI's ``--kernels`` (torch backend).

    Returns: ``[1, prompt + new]`` token ids, or a ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``.
    """
    _check_supported(input_ids, generation_config, logits_processor, model_kwargs)
    prompt = input_ids[0].tolist()
    budget = generation_config.max_length - len(prompt)
    if kangaroo_streamer is not None:
        kangaroo_streamer.put(input_ids.cpu())
    new: list[int] = []
    if budget > 0:
        engine = _engine_for(model, kangaroo_adapter, kangaroo_exit_layer, kangaroo_eta, kangaroo_gamma,
                             kangaroo_policy, kangaroo_kernels)
        engine = engine.with_sampling(_sampling(generation_config))
        engine.backend.eos_token_ids = _eos_ids(generation_config)
        new, result = _decode(engine, prompt, budget, input_ids, stopping_criteria, kangaroo_streamer)
        model.__dict__[LAST_ATTR] = result
    if kangaroo_streamer is not None:
        kangaroo_streamer.end()
    sequences = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def last_result(model):
    """The :class:`~kangaroo_core.results.GenerationResult` of the last :func:`kangaroo_generate` call on ``model``
    (None before the first): CR (``mean_accepted_tokens``), rounds, draft/verify seconds."""
    return model.__dict__.get(LAST_ATTR)


# -- steps --------------------------------------------------------------------------------------------------------
def _check_supported(input_ids, generation_config, logits_processor, model_kwargs) -> None:
    """Refuse, in one line, what the loop would not reproduce exactly."""
    if generation_config.num_beams != 1:
        raise UnsupportedGenerateOption(f"kangaroo_generate does not do beam search (num_beams={generation_config.num_beams})")
    if generation_config.num_return_sequences != 1:
        raise UnsupportedGenerateOption("kangaroo_generate returns one sequence "
                                        f"(num_return_sequences={generation_config.num_return_sequences})")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise UnsupportedGenerateOption(f"kangaroo_generate decodes one sequence at a time; got input_ids of shape "
                                        f"{tuple(input_ids.shape)} (batch > 1 is not supported)")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise UnsupportedGenerateOption("kangaroo_generate does not take padded inputs (the attention mask has zeros)")
    asked = [name for name in UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
    if asked:
        raise UnsupportedGenerateOption(f"kangaroo_generate cannot return {', '.join(asked)} (its passes verify "
                                        "several tokens at once); call generate() without them")
    others = [type(p).__name__ for p in (logits_processor or []) if type(p).__name__ not in SAMPLING_WARPERS]
    if others:
        raise UnsupportedGenerateOption(f"kangaroo_generate applies only temperature/top_k/top_p; unsupported logits "
                                        f"processor(s): {', '.join(others)}")
    if getattr(generation_config, "return_legacy_cache", None) is True:
        raise UnsupportedGenerateOption("kangaroo_generate returns no cache (return_legacy_cache=True)")
    for warper in logits_processor or []:  # a warper passed in by hand must say what generation_config says
        name, config = type(warper).__name__, generation_config
        mismatch = ((name == "TemperatureLogitsWarper" and warper.temperature != config.temperature)
                    or (name == "TopKLogitsWarper" and warper.top_k != max(config.top_k or 0, 1))
                    or (name == "TopPLogitsWarper" and warper.top_p != config.top_p))
        if mismatch:
            raise UnsupportedGenerateOption(f"kangaroo_generate reads temperature/top_k/top_p from generate()'s "
                                            f"arguments, not from a {name} passed in logits_processor")


def _sampling(generation_config) -> SamplingConfig:
    """generate()'s sampling settings; the seed comes from torch's global generator (``torch.manual_seed`` works)."""
    if not generation_config.do_sample:
        return SamplingConfig()
    seed = int(torch.randint(0, 2**62, (1,)))
    return SamplingConfig(temperature=float(generation_config.temperature if generation_config.temperature is not None else 1.0),
                          top_k=int(generation_config.top_k or 0),
                          top_p=float(generation_config.top_p if generation_config.top_p is not None else 1.0), seed=seed)


def _eos_ids(generation_config) -> frozenset[int]:
    eos = generation_config.eos_token_id
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _engine_for(model, adapter, exit_layer, eta, gamma, policy, kernels):
    """One engine per (model object, settings), assembled once by the composition root around the torch backend's
    view of the model's own layers (the backend class resolved through the plugin registry, like every backend)."""
    from kangaroo_core.assembly import EngineSpec
    from kangaroo_core.engine import assemble
    from kangaroo_core.plugins import get_registry

    param = next(model.parameters())
    key = (adapter, exit_layer, eta, gamma, policy, kernels, param.device, param.dtype)  # a moved model: a new view
    engines = model.__dict__.setdefault(ENGINES_ATTR, {})
    if key not in engines:
        name = getattr(model, "name_or_path", "model") or "model"
        TorchBackend = get_registry().resolve("backend", "torch")
        config = DecodeConfig(eta=eta, gamma=gamma, exit_layer=DEFAULT_EXIT_LAYER if exit_layer is None else exit_layer)
        backend = TorchBackend(model, None, config.exit_layer, model_name=name, kernels=kernels)
        spec = EngineSpec(model=name, backend="torch", adapter=adapter, policy=policy, exit_layer=exit_layer,
                          config=config)
        engines[key] = assemble(spec, backend=backend)
    return engines[key]


def _decode(engine, prompt, budget, input_ids, stopping_criteria, streamer):
    """Run the loop; cut after the first token at which a stopping criterion fires (generate checks every token).

    Returns the new tokens and the engine's result (None when a criterion of the caller's, a stop string say,
    ended the answer before the engine would have)."""
    loop = engine.decode(prompt, budget)
    new: list[int] = []
    sequence = input_ids.clone()
    eos = engine.backend.eos_token_ids
    while True:
        try:
            with host_threads(engine.backend):  # as TextStream drives the loop
                emitted = next(loop)
        except StopIteration as done:
            return new, done.value
        taken = emitted
        for i, token in enumerate(emitted):
            sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=1)
            if stopping_criteria is not None and bool(stopping_criteria(sequence, None).any()):
                taken = emitted[: i + 1]
                break
        new.extend(taken)
        if streamer is not None and taken:
            streamer.put(torch.tensor([taken], dtype=input_ids.dtype))
        engine_done = new[-1] in eos or len(new) >= budget
        if len(taken) < len(emitted) or (taken is not emitted and not engine_done):
            loop.close()
            return new, None
