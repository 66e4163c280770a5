"""The captured decode path (``--graphs on``): static KV cache, passes padded to fixed widths.

On CUDA those passes are replayed CUDA graphs; on CPU the same code runs eagerly, and that is what these tests prove
lossless: Kangaroo (chains and token trees) with graphs on is token-identical to the target alone with graphs on and
to the eager target alone, on tiny models of every family. Also here: every tensor a drafter, runner or cache makes
follows the backend's device and dtype (float64 models, so a hard-coded float32 shows), and ``--device`` errors.
"""

from __future__ import annotations

import random

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kangaroo_apps.cli import cli, main
from kangaroo_apps.testing import TINY_FAMILIES, TinyTokenizer, tiny_model
from kangaroo_backends.devices import resolve_device
from kangaroo_backends.graph_passes import MAX_WIDTH, StaticKVCache, padded_mask, width_for
from kangaroo_backends.kv_cache import KVCache, causal_mask
from kangaroo_backends.torch_backend import TorchBackend
from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter
from kangaroo_plugins.kangaroo.deep_context import DeepContextAdapter
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CACHE = 128  # the smallest static cache: prompt + new tokens <= 64 on the tiny models


def backend(model, graphs: str, exit_layer: int = 2) -> TorchBackend:
    return TorchBackend(model, TinyTokenizer(model.config.vocab_size, model.generation_config.eos_token_id),
                        exit_layer, f"tiny-{model.config.model_type}", graphs=graphs, cache_size=CACHE)


_MODELS: dict = {}


def models(family: str, dtype=torch.float32):
    """(target alone eager, target alone captured, the captured backend) for one tiny model, made once."""
    key = (family, dtype)
    if key not in _MODELS:
        m = tiny_model(family, 0, dtype=dtype, eos_token_id=5)
        eager, captured = backend(m, "off"), backend(m, "on")
        _MODELS[key] = (Engine.build(backend=eager, drafter=None), Engine.build(backend=captured, drafter=None),
                        captured)
    return _MODELS[key]


# -- the pieces -----------------------------------------------------------------------------------------------------
def test_widths_are_powers_of_two_from_the_minimum_and_long_passes_run_at_their_length():
    assert [width_for(n, 8) for n in (1, 7, 8, 9, 16, 17, 64)] == [8, 8, 8, 16, 16, 32, 64]
    assert [width_for(n, 1) for n in (1, 2, 3, 5)] == [1, 2, 4, 8]
    assert width_for(MAX_WIDTH + 1, 8) is None


def test_a_padded_mask_hides_every_slot_a_row_must_not_see():
    mask = padded_mask(causal_mask(3, 4, torch.float32), 3, 8, 4, 16, torch.float32, "cpu")[0, 0]
    low = torch.finfo(torch.float32).min
    assert mask.shape == (8, 16)
    for row in range(3):  # real rows: the prefix and the rows before them
        assert (mask[row, : 4 + row + 1] == 0).all() and (mask[row, 4 + row + 1:] == low).all()
    for row in range(3, 8):  # padded rows: only their own slot, after every real row
        assert mask[row].tolist().count(0) == 1 and mask[row, 4 + row] == 0
    one_row = padded_mask(None, 1, 2, 5, 16, torch.float32, "cpu")[0, 0]
    assert (one_row[0, :6] == 0).all() and (one_row[0, 6:] == low).all()


def test_the_static_cache_writes_at_the_given_slots_and_keeps_its_lengths_to_the_backend():
    cache = StaticKVCache(2, 1, 4, torch.float32, capacity=16)
    assert all((k == 0).all() for k in cache.keys)  # finite everywhere, so masked slots weigh exactly 0
    key = torch.ones(1, 1, 3, 4)
    keys, _ = cache.update(key, 2 * key, 1, {"cache_position": torch.tensor([5, 6, 7])})
    assert keys.shape[-2] == 16 and (keys[0, 0, 5:8] == 1).all() and (keys[0, 0, :5] == 0).all()
    assert cache.lengths == [0, 0]  # a captured update cannot count: the backend does
    cache.advance(range(1, 2), 8)
    assert cache.lengths == [0, 8]
    with pytest.raises(RuntimeError, match="holds 16 positions"):
        cache._grow(0, 17)


@pytest.mark.parametrize("options, message", [
    ({"graphs": "always"}, "graphs must be one of auto, on, off"),
    ({"cache_size": 100}, "cache_size must be an integer >= 128"),
    ({"graph_rows": 0}, "graph_rows must be an integer in"),
])
def test_bad_graph_options_are_refused_in_one_line(options, message):
    m = tiny_model("llama", 0, dtype=torch.float32)
    with pytest.raises(ConfigError, match=message):
        TorchBackend(m, None, 2, **options)


def test_the_captured_path_is_on_for_cuda_only_by_default_and_bounds_the_context():
    m = tiny_model("llama", 0, dtype=torch.float32)
    assert not TorchBackend(m, None, 2).use_graphs  # CPU: auto is off
    on = TorchBackend(m, None, 2, graphs="on", cache_size=160)
    assert on.use_graphs and isinstance(on.cache, StaticKVCache) and on.max_context == 160 - MAX_WIDTH
    assert isinstance(on.resplit(1).cache, StaticKVCache) and on.resplit(1).cache.capacity == 160


# -- lossless ---------------------------------------------------------------------------------------------------------
@st.composite
def cases(draw):
    family = draw(st.sampled_from(TINY_FAMILIES))
    prompt = draw(st.lists(st.integers(1, 63), min_size=1, max_size=14))
    budget = draw(st.integers(1, 64 - len(prompt)))
    gamma = draw(st.integers(1, 7))
    eta = draw(st.sampled_from([0.0, 0.3, 0.6]))
    tree = draw(st.sampled_from([None, None, 2, 5, 12]))  # a chain, or a dynamic tree of this budget
    return family, prompt, min(budget, 40), gamma, eta, tree


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_captured_kangaroo_is_token_identical_to_the_target_alone(case):
    family, prompt, budget, gamma, eta, tree = case
    eager_alone, captured_alone, captured = models(family)
    want = eager_alone.generate_ids(prompt, budget).token_ids
    assert captured_alone.generate_ids(prompt, budget).token_ids == want
    tree_args = {} if tree is None else {"tree": "dynamic", "tree_options": {"budget": tree, "depth": gamma}}
    engine = Engine.build(backend=captured, config=DecodeConfig(exit_layer=2, eta=eta, gamma=gamma), **tree_args)
    assert engine.generate_ids(prompt, budget).token_ids == want, case


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_captured_kangaroo_accepts_drafts_and_stays_identical_in_float64(family):
    """Power: drafts are accepted and verified on this path (the threshold policy at eta 0, the untrained adapter)."""
    eager_alone, _, captured = models(family, torch.float64)
    engine = Engine.build(backend=captured, config=DecodeConfig(exit_layer=2, eta=0.0, gamma=5), policy="threshold")
    for seed in range(3):
        prompt = [random.Random(seed).randrange(1, 64) for _ in range(9)]
        result = engine.generate_ids(prompt, 40)
        assert result.token_ids == eager_alone.generate_ids(prompt, 40).token_ids
        assert sum(r.accepted for r in result.rounds) > 0


# -- placement -------------------------------------------------------------------------------------------------------
def tensors_of(root, seen=None):
    """Every tensor reachable from ``root`` through kangaroo objects, modules, caches and containers."""
    seen = set() if seen is None else seen
    if id(root) in seen:
        return
    seen.add(id(root))
    if isinstance(root, torch.Tensor):
        yield root
    elif isinstance(root, torch.nn.Module):
        yield from root.parameters()
        yield from root.buffers()
        for value in vars(root).values():
            if not isinstance(value, (torch.nn.Module, torch.Tensor)) and not str(type(value)).startswith("<class 'torch"):
                yield from tensors_of(value, seen)
    elif isinstance(root, (list, tuple)):
        for item in root:
            yield from tensors_of(item, seen)
    elif isinstance(root, dict):
        for item in root.values():
            yield from tensors_of(item, seen)
    elif type(root).__module__.startswith("kangaroo") and hasattr(root, "__dict__"):
        for name, value in vars(root).items():
            if name not in ("model", "tokenizer", "backend"):  # the target's own weights are the backend's concern
                yield from tensors_of(value, seen)


def perturbed(adapter):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in adapter.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return adapter


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("drafter_kind", ["attention", "deep-context", "hybrid"])
def test_every_tensor_of_drafter_runner_and_caches_follows_the_backend(graphs, drafter_kind, tmp_path):
    m = tiny_model("qwen3", 0, dtype=torch.float64, eos_token_id=5)
    b = backend(m, graphs)
    if drafter_kind == "hybrid":
        drafter = "kangaroo-hybrid"
    else:
        network = DeepContextAdapter if drafter_kind == "deep-context" else KangarooAdapter
        from kangaroo_backends.torch_backend import model_fingerprint

        directory = tmp_path / drafter_kind
        perturbed(network.from_base_layer(m, 2, ffn=True)).save(directory, base_fingerprint=model_fingerprint(m),
                                                                exit_layer=2)
        drafter = KangarooDrafter(adapter=str(directory))
    config = DecodeConfig(exit_layer=2, eta=0.0, gamma=4)
    chain = Engine.build(backend=b, config=config, drafter=drafter)
    tree = Engine.build(backend=b, config=config, drafter=chain.drafter, tree="dynamic", tree_options={"budget": 6})
    prompt = [random.Random(1).randrange(1, 64) for _ in range(9)]
    assert chain.generate_ids(prompt, 24).token_ids == tree.generate_ids(prompt, 24).token_ids
    found = [t for root in (chain.drafter, b.cache) for t in tensors_of(root)]
    assert len(found) > 10
    floating = [t for t in found if t.is_floating_point()]
    assert floating and {t.dtype for t in floating} == {torch.float64}
    assert {t.device for t in found} == {b.device}
    assert isinstance(b.cache, StaticKVCache if graphs == "on" else KVCache)


# -- devices ---------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_cuda_asked_and_absent_is_one_line_before_any_load(capsys):
    with pytest.raises(ConfigError, match="asks for CUDA.*use --device cpu"):
        resolve_device("cuda")
    assert main(["generate", "hello", "--device", "cuda", "--model", "/nonexistent"]) == 1  # no model read
    err = capsys.readouterr().err
    assert "asks for CUDA" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "tpu"])
def test_a_device_that_is_not_one_is_refused_in_one_line(name):
    with pytest.raises(ConfigError, match="device must be cpu, cuda or cuda:N"):
        resolve_device(name)


def test_the_cpu_device_runs_from_the_cli(tiny_model_dir):
    result = CliRunner().invoke(cli, ["generate", "hello", "--model", str(tiny_model_dir), "--device", "cpu",
                                      "--graphs", "on", "--cache-size", "128", "--max-new-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output
