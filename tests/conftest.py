"""Shared fixtures: a tiny random Llama saved as a real HF directory (for CLI/API tests; never for claims)."""

from __future__ import annotations

import json

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Make threads predictable on the 2-core CI machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Keep test runs off the user's real cache: everything kangaroo caches (converted GGUF models, ONNX exports) goes to
# a directory of this run. KANGAROO_TEST_CACHE_DIR names a directory to reuse between runs instead (it is never the
# user's ~/.cache/kangaroo unless they say so).
USER_CACHE = Path(os.environ.get("KANGAROO_CACHE_DIR") or Path.home() / ".cache" / "kangaroo")
os.environ["KANGAROO_CACHE_DIR"] = os.environ.get("KANGAROO_TEST_CACHE_DIR") or tempfile.mkdtemp(prefix="kangaroo-test-cache-")
# Only a directory made for this run is ours to empty: the real models' conversions and ONNX bundles take gigabytes,
# and a CI machine may have little disk (a run once failed with "No space left on device").
RUN_CACHE = None if os.environ.get("KANGAROO_TEST_CACHE_DIR") else Path(os.environ["KANGAROO_CACHE_DIR"])
# The default cost-aware policy times this machine's rounds once per model and backend when an engine is built; the
# suite builds dozens, and checks what the policy does with a curve, not how steady the curve is: 3 timings per size.
os.environ.setdefault("KANGAROO_COST_REPEATS", "3")


def _drop_from_run_cache(path: Path) -> None:
    """Remove ``path`` if it lies in this run's own cache directory (never in a reused KANGAROO_TEST_CACHE_DIR)."""
    if RUN_CACHE is not None and Path(path).resolve().is_relative_to(RUN_CACHE.resolve()):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def drop_from_run_cache():
    """A module's fixture removes what only it needed (a converted model) from this run's cache with this."""
    return _drop_from_run_cache


def pytest_sessionfinish(session, exitstatus):
    if RUN_CACHE is not None:
        shutil.rmtree(RUN_CACHE, ignore_errors=True)


@pytest.fixture
def drops_its_onnx_exports():
    """A real model's ONNX bundles are hundreds of MB each: the test that makes them removes them when it ends."""
    root = Path(os.environ["KANGAROO_CACHE_DIR"]) / "onnx"
    before = set(root.glob("*/*"))
    yield
    for bundle in set(root.glob("*/*")) - before:
        _drop_from_run_cache(bundle)


WORDS = (
    "the a an sky sea is blue green red why how what because light sun water cold warm day night cat dog runs "
    "jumps over under and or not very small big old new one two three four five six seven eight nine ten "
    "hello world poem write explain tell me about story time once upon there was"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + ["assistant", "user", "system"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_bpe_tokenizer():
    """A byte-level BPE tokenizer trained on :data:`WORDS` (~300 tokens), no chat template: for a family whose
    transformers 5.x tokenizer class rebuilds itself from the saved vocabulary and merges (Qwen2), where
    :func:`make_tokenizer`'s word-level vocabulary would read every text as no tokens at all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>")


def write_prompts(path: Path, count: int) -> Path:
    """A prompts file in the training prompts' format (``{"id", "prompt"}`` per line) of short tiny-vocabulary texts."""
    words = "the sky is blue why the sea is green tell me a story about the cat and the dog".split()
    with open(path, "w") as handle:
        for i in range(count):
            handle.write(json.dumps({"id": f"p{i}", "prompt": " ".join(words[i % 7: i % 7 + 3 + i % 5])}) + "\n")
    return path


def save_tiny_model(directory: Path, *, seed: int = 0, layers: int = 4, hidden: int = 32, max_positions: int = 128,
                    dtype=torch.float32) -> Path:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture
def fresh_global_registry(monkeypatch):
    """A process-wide plugin registry rebuilt from entry points for this test, dropped afterwards."""
    from kangaroo_core import plugins

    monkeypatch.setattr(plugins, "_registry", None)
    yield
    plugins._registry = None


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: intra-op threads only add synchronisation overhead (milliseconds per op on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def other_tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("other-tiny-llama"), seed=1)
