"""``model.generate(custom_generate=kangaroo_generate)``: transformers' own API running the Kangaroo loop.

Tiny random Llamas (float64) for the mechanics; the real SmolLM2 (slow tier) for identity with ``generate`` and for
the shipped adapter being picked up on the user's own model object.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

from kangaroo_core.errors import AdapterMismatchError, KangarooError
from kangaroo_apps.hf import UnsupportedGenerateOption, kangaroo_generate, last_result
from kangaroo_apps.testing import tiny_llama

PROMPT = torch.tensor([[1, 2, 3, 4, 7, 9, 11]])
#: transformers 4.x's generate() takes return_legacy_cache (kangaroo_generate refuses True); 5.x dropped the option
LEGACY_CACHE = hasattr(GenerationConfig(), "return_legacy_cache")


class Collect(BaseStreamer):
    """Records every put() (the prompt first, then each round's tokens) and end()."""

    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def kangaroo(model, ids=PROMPT, **kwargs):
    return model.generate(ids, pad_token_id=0, custom_generate=kangaroo_generate, kangaroo_exit_layer=1, **kwargs)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(3, vocab=64, eos_token_id=5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_new_tokens", [1, 7, 40])
def test_greedy_equals_plain_generate(seed, max_new_tokens):
    model = tiny_llama(seed, vocab=64, eos_token_id=[5, 6] if seed % 2 else 5)
    reference = model.generate(PROMPT, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    produced = kangaroo(model, max_new_tokens=max_new_tokens, do_sample=False)
    assert produced.tolist() == reference.tolist()
    result = last_result(model)
    assert result.token_ids == produced[0, PROMPT.shape[1]:].tolist()


def test_the_users_model_is_not_copied_and_the_engine_is_reused(tiny):
    before = {name: p.data_ptr() for name, p in tiny.named_parameters()}
    kangaroo(tiny, max_new_tokens=5)
    from kangaroo_apps import hf

    engines = tiny.__dict__[hf.ENGINES_ATTR]
    backend = next(iter(engines.values())).backend
    kangaroo(tiny, max_new_tokens=5)
    assert len(tiny.__dict__[hf.ENGINES_ATTR]) == 1 and next(iter(tiny.__dict__[hf.ENGINES_ATTR].values())).backend is backend
    assert backend.model is tiny and backend.embed_tokens is tiny.model.embed_tokens
    assert {name: p.data_ptr() for name, p in tiny.named_parameters()} == before


def test_deleting_the_model_frees_it_and_its_engine():
    import gc
    import weakref

    model = tiny_llama(8, vocab=64)
    kangaroo(model, max_new_tokens=3)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_return_dict_and_max_length(tiny):
    out = kangaroo(tiny, max_new_tokens=6, return_dict_in_generate=True)
    assert type(out).__name__ == "GenerateDecoderOnlyOutput" and out.sequences.shape[1] <= PROMPT.shape[1] + 6
    reference = tiny.generate(PROMPT, max_length=12, do_sample=False, pad_token_id=0)
    assert kangaroo(tiny, max_length=12).tolist() == reference.tolist()


def test_streamer_gets_the_prompt_then_the_rounds_then_end(tiny):
    streamer = Collect()
    out = kangaroo(tiny, max_new_tokens=20, kangaroo_streamer=streamer)
    assert streamer.ended and streamer.puts[0] == PROMPT[0].tolist()
    assert sum(streamer.puts[1:], []) == out[0, PROMPT.shape[1]:].tolist()


def test_text_iterator_streamer_from_another_thread():
    """The documented streaming recipe: TextIteratorStreamer + generate in a thread."""
    import threading

    from conftest import make_tokenizer

    tokenizer = make_tokenizer()
    model = tiny_llama(5, vocab=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    ids = torch.tensor([tokenizer.encode("tell me a story about the sea")])
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=kangaroo(model, ids, max_new_tokens=24,
                                                                      kangaroo_streamer=streamer)))
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text.strip() == tokenizer.decode(box["out"][0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_stop_strings_and_other_stopping_criteria_cut_where_generate_does(tiny):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):  # the caller's own criterion: stop once token 9 has been generated twice
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([(input_ids[0, PROMPT.shape[1]:] == 9).sum() >= 2])

    full = tiny.generate(PROMPT, max_new_tokens=40, do_sample=False, pad_token_id=0).tolist()
    reference = tiny.generate(PROMPT, max_new_tokens=40, do_sample=False, pad_token_id=0,
                              stopping_criteria=StoppingCriteriaList([StopAfter()]))
    produced = kangaroo(tiny, max_new_tokens=40, stopping_criteria=StoppingCriteriaList([StopAfter()]))
    assert produced.tolist() == reference.tolist()
    assert last_result(tiny) is None or produced.tolist() == full  # a criterion of ours ended it early


def test_sampling_is_reproducible_under_torch_manual_seed_and_follows_top_k(tiny):
    def sample(seed):
        torch.manual_seed(seed)
        return kangaroo(tiny, max_new_tokens=24, do_sample=True, temperature=0.7, top_k=3)

    a, b, c = sample(0), sample(0), sample(1)
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    # every sampled token is among the target's top-3 after its prefix (top_k is honoured)
    with torch.inference_mode():
        logits = tiny(a).logits[0]
    for i in range(PROMPT.shape[1], a.shape[1]):
        assert int(a[0, i]) in torch.topk(logits[i - 1], 3).indices.tolist()


@pytest.mark.parametrize("options,message", [
    ({"num_beams": 2}, "beam search"),
    ({"num_return_sequences": 2, "do_sample": True}, "returns one sequence"),
    ({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
    ({"min_new_tokens": 3}, "MinNewTokensLengthLogitsProcessor"),
    ({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
    pytest.param({"return_dict_in_generate": True, "return_legacy_cache": True}, "return_legacy_cache",
                 marks=pytest.mark.skipif(not LEGACY_CACHE, reason="transformers 5.x has no return_legacy_cache: "
                                                                    "generate() refuses it before custom_generate")),
])
def test_what_it_cannot_do_is_refused_in_one_line(tiny, options, message):
    with pytest.raises(UnsupportedGenerateOption, match=message) as info:
        kangaroo(tiny, max_new_tokens=5, **options)
    assert "\n" not in str(info.value)


def test_a_hand_made_warper_that_disagrees_with_the_arguments_is_refused(tiny):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    with pytest.raises(UnsupportedGenerateOption, match="TemperatureLogitsWarper"):
        kangaroo(tiny, max_new_tokens=5, do_sample=True,
                 logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))


def test_batch_and_padding_are_refused(tiny):
    with pytest.raises(UnsupportedGenerateOption, match="batch > 1"):
        kangaroo(tiny, torch.cat([PROMPT, PROMPT]), max_new_tokens=5)
    mask = torch.ones_like(PROMPT)
    mask[0, 0] = 0
    with pytest.raises(UnsupportedGenerateOption, match="padded"):
        kangaroo(tiny, attention_mask=mask, max_new_tokens=5)


def test_an_adapter_made_for_another_model_is_refused(tiny, tmp_path):
    from kangaroo_backends.torch_backend import model_fingerprint
    from kangaroo_plugins.kangaroo.adapter import KangarooAdapter

    other = tiny_llama(11, vocab=64)
    KangarooAdapter.from_base_layer(other, 1).save(tmp_path, base_fingerprint=model_fingerprint(other), exit_layer=1)
    with pytest.raises(AdapterMismatchError):
        kangaroo(tiny, max_new_tokens=5, kangaroo_adapter=str(tmp_path))
    assert issubclass(AdapterMismatchError, KangarooError)


@pytest.mark.slow
def test_real_model_generate_is_identical_and_uses_the_shipped_adapter():
    """The real SmolLM2 as a user loads it: model.generate with and without custom_generate, 3 chat prompts."""
    from kangaroo_backends.loading import load_model

    model, tokenizer, _ = load_model(None)
    accepted = 0.0
    prompts = ["Write a short poem about the sea.", "What is 17 times 23? Show your steps.",
               "Write a Python function that reverses a string."]
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt")
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        reference = model.generate(ids, max_new_tokens=48, do_sample=False)
        produced = model.generate(ids, max_new_tokens=48, do_sample=False, custom_generate=kangaroo_generate)
        assert produced.tolist() == reference.tolist(), prompt
        accepted += last_result(model).mean_accepted_tokens
    # a stop string, as the docs say to pass one: StopStringCriteria in stopping_criteria, cut where generate cuts
    from transformers import StoppingCriteriaList, StopStringCriteria

    text = tokenizer.decode(reference[0, ids.shape[1]:], skip_special_tokens=True)
    stop = text.split()[len(text.split()) // 2]
    criteria = lambda: StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])])  # noqa: E731
    cut = model.generate(ids, max_new_tokens=48, do_sample=False, stopping_criteria=criteria())
    assert cut.shape[1] < reference.shape[1]
    assert model.generate(ids, max_new_tokens=48, do_sample=False, stopping_criteria=criteria(),
                          custom_generate=kangaroo_generate).tolist() == cut.tolist()
    from kangaroo_apps import hf

    engine = next(iter(model.__dict__[hf.ENGINES_ATTR].values()))
    assert engine.drafter.resolved_adapter is not None  # the shipped SmolLM2 adapter, found by fingerprint
    assert accepted / len(prompts) > 1.2  # a trained adapter: drafts are accepted
