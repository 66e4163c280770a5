import json

import pytest

from kangaroo_apps.cli import main
from kangaroo_apps.testing import TinyTokenizer
from kangaroo_pass_log import PassLogBackend

PROMPT = "t5 t9 t14 t5 t9 t14 t5 t9"  # words the saved tokenizer knows; repetitive, so drafts get accepted


@pytest.fixture(scope="module")
def model_dir(kangaroo_tiny_model, tmp_path_factory):
    """The conformance kit's tiny model saved as a Hugging Face directory, with a tokenizer (token i is "t<i>")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("tiny")
    kangaroo_tiny_model.model.save_pretrained(directory, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(kangaroo_tiny_model.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(directory)
    return directory


def generate(model_dir, capsys, *flags):
    """`kangaroo generate --json` on the tiny model: (exit code, the JSON result or None, stderr). The threshold
    policy: the default cost-aware one times this backend's passes when the engine is built, which the log would
    hold too."""
    code = main(["generate", PROMPT, "--model", str(model_dir), "--exit-layer", "1", "--max-new-tokens", "16",
                 "--no-chat", "--json", "--policy", "threshold", *flags])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def read_log(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_flag_and_the_backend_option_write_the_log_and_the_output_is_the_torch_backends(model_dir, tmp_path,
                                                                                            capsys):
    code, torch_result, _ = generate(model_dir, capsys, "--backend", "torch")
    assert code == 0
    by_flag, by_option = tmp_path / "flag.jsonl", tmp_path / "option.jsonl"
    for flags, log in [(("--pass-log", str(by_flag)), by_flag), (("--backend-option", f"log={by_option}"), by_option)]:
        code, result, _ = generate(model_dir, capsys, "--backend", "pass-log", *flags)
        assert code == 0
        assert result["token_ids"] == torch_result["token_ids"]  # the same computation: lossless, identical
    passes = read_log(by_flag)
    assert [(p["part"], p["start"], p["positions"]) for p in passes] == \
        [(p["part"], p["start"], p["positions"]) for p in read_log(by_option)]
    assert set(passes[0]) == {"part", "start", "positions", "ms"}
    assert passes[0]["part"] == "shallow" and passes[0]["start"] == 0 and passes[0]["positions"] == len(PROMPT.split())
    assert all(p["ms"] >= 0 for p in passes)
    deep = [p for p in passes if p["part"] == "deep"]
    assert len(deep) == 1 + torch_result["rounds"]  # the prefill, then one verify pass per round
    assert max(p["positions"] for p in deep[1:]) > 1  # drafts were verified together


def test_a_flag_of_another_backend_is_refused_in_one_line(model_dir, tmp_path, capsys):
    code, _, err = generate(model_dir, capsys, "--backend", "torch", "--pass-log", str(tmp_path / "log.jsonl"))
    assert code == 2
    assert err.strip().count("\n") == 0
    assert "--pass-log is an option of the pass-log backend" in err
    assert not (tmp_path / "log.jsonl").exists()


def test_an_unknown_backend_option_is_refused_naming_the_valid_ones(model_dir, capsys):
    code, _, err = generate(model_dir, capsys, "--backend", "pass-log", "--backend-option", "nope=1")
    assert code == 1  # refused before the model is loaded
    assert err.strip().count("\n") == 0
    assert "backend 'pass-log': unknown option(s) nope; valid options: model, dtype, kernels, log" in err


def test_resplit_keeps_the_log(kangaroo_tiny_model, tmp_path):
    model = kangaroo_tiny_model.model
    backend = PassLogBackend(model, TinyTokenizer(model.config.vocab_size), 1, log=str(tmp_path / "log.jsonl"))
    other = backend.resplit(2)
    assert type(other) is PassLogBackend and other.exit_layer == 2 and other.log == backend.log
    other.shallow([3, 1, 4], 0)
    assert read_log(tmp_path / "log.jsonl") == [{"part": "shallow", "start": 0, "positions": 3,
                                                 "ms": other.passes[0].ms}]
