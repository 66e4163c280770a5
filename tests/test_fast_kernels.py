"""The torch backend's verify fast path: the small-batch kernel, grouped attention, the switch, the cost model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kangaroo_backends import native
from kangaroo_backends.fast_layers import SmallBatchLinear, fast_layers, grouped_sdpa, kernel_attention
from kangaroo_backends.kv_cache import causal_mask
from kangaroo_backends.torch_backend import TorchBackend
from kangaroo_backends.weight_arena import place_weights
from kangaroo_policies.cost_model import measure_costs
from kangaroo_apps.cli import main
from kangaroo_core.config import ConfigError, DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_core.machine import cpu_identity
from kangaroo_apps.testing import TinyTokenizer, check_rows_exact, hf_greedy, tiny_llama, tiny_model
from kangaroo_core.tree import TreeAttention
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_policies.threshold import ThresholdPolicy

kernel, why_not = native.small_batch_kernel()
attention_kernel = native.small_batch_attention()[0]
needs_kernel = pytest.mark.skipif(kernel is None, reason=f"small-batch kernel unavailable: {why_not}")
NEAR_TIE = 1e-4


def run_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0])
    assert kernel(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], w.shape[0], torch.get_num_threads()) == 0
    return y


@needs_kernel
@pytest.mark.parametrize("shape", [(32, 64), (576, 1536), (1536, 576), (40, 33), (17, 5), (576, 49152)])
def test_kernel_matches_blas_and_ignores_batch_size(shape):
    inner, out = shape
    gen = torch.Generator().manual_seed(inner * out)
    w = torch.randn(out, inner, generator=gen) * 0.05
    x = torch.randn(8, inner, generator=gen)
    full = run_kernel(x, w)
    torch.testing.assert_close(full, F.linear(x, w), rtol=1e-5, atol=1e-5)
    for n in range(1, 8):  # the same numbers, bit for bit, whatever else came in the batch
        assert torch.equal(run_kernel(x[:n].contiguous(), w), full[:n])


@needs_kernel
@needs_kernel
@pytest.mark.parametrize("shape", [(576, 1536), (40, 33)])
def test_kernel_takes_any_number_of_rows_each_computed_alone(shape):
    """More than 8 rows go through each block of weights 8 at a time (a ragged pass of many streams): every row is
    still bit for bit what it is alone, and no rows at all are refused."""
    inner, out = shape
    gen = torch.Generator().manual_seed(inner + out)
    w = torch.randn(out, inner, generator=gen) * 0.05
    x = torch.randn(27, inner, generator=gen)
    alone = torch.cat([run_kernel(x[i:i + 1].contiguous(), w) for i in range(27)])
    for n in (9, 16, 17, 27):
        assert torch.equal(run_kernel(x[:n].contiguous(), w), alone[:n])
    assert kernel(x.data_ptr(), w.data_ptr(), torch.empty(1, out).data_ptr(), 0, inner, out, 1) == -1


def test_small_batch_linear_falls_back_to_blas_where_it_does_not_apply():
    linear = torch.nn.Linear(16, 24, bias=True)
    fast = SmallBatchLinear(linear, kernel=lambda *a: pytest.fail("kernel called"))
    for x in (torch.randn(1, 17, 16), torch.randn(2, 16, dtype=torch.float64)):
        with torch.no_grad():
            ref = F.linear(x, linear.weight.to(x.dtype), linear.bias.to(x.dtype))
            got = fast(x) if x.dtype == torch.float32 else SmallBatchLinear(linear.double(), fast.kernel)(x)
        assert torch.equal(got, ref)


@needs_kernel
def test_small_batch_linear_adds_bias_and_keeps_shape():
    linear = torch.nn.Linear(32, 48, bias=True)
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        torch.testing.assert_close(SmallBatchLinear(linear, kernel)(x), linear(x), rtol=1e-5, atol=1e-5)


def _attention_masks(q: int, past: int) -> dict:
    """Every mask a verify pass meets: causal, causal in a sliding window, a token tree (siblings hidden)."""
    tree = TreeAttention(committed=past, visible=[(past,), (past, past + 1), (past, past + 2), (past + 3,),
                                                 (past + 3, past + 4), (past, past + 1, past + 5),
                                                 (past, past + 1, past + 5, past + 6), (past + 3, past + 7)][:q],
                         positions=[past, past + 1, past + 1, past, past + 1, past + 2, past + 3, past + 1][:q])
    return {"causal": causal_mask(q, past, torch.float32), "window": causal_mask(q, past, torch.float32, window=20),
            "tree": tree.additive_mask(past + q, torch.float32)}


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 1, 256), (6, 2, 40), (2, 2, 16)])
def test_attention_kernel_matches_sdpa_and_computes_each_row_alone(heads, kv_heads, d):
    """Each row's output is bit for bit what the row computes alone over only the keys it sees (the target alone's
    one-position pass): hidden keys, later rows and tree siblings change nothing."""
    gen = torch.Generator().manual_seed(heads * d)
    past, q, capacity = 37, 8, 64
    keys, values = torch.randn(2, 1, kv_heads, capacity, d, generator=gen)  # cache-like views: head stride capacity*d
    query = torch.randn(1, heads, q, d, generator=gen).transpose(2, 3).contiguous().transpose(2, 3)  # not contiguous
    projected = query.transpose(1, 2).contiguous().transpose(1, 2)  # the q projection's layout: read in place
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    for name, mask in _attention_masks(q, past).items():
        key, value = keys[:, :, : past + q], values[:, :, : past + q]
        got = kernel_attention(attention_kernel, query, key, value, mask, 0.3)
        assert torch.equal(kernel_attention(attention_kernel, projected, key, value, mask, 0.3), got), name
        assert torch.equal(kernel_attention(attention_kernel, query.contiguous(), key, value, mask, 0.3), got), name
        ref, _ = grouped_sdpa(module, query, key, value, mask, scaling=0.3)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)
        for i in range(q):
            seen = (mask[0, 0, i] == 0).nonzero()[:, 0]
            alone = kernel_attention(attention_kernel, query[:, :, i:i + 1], key[:, :, seen], value[:, :, seen], None,
                                     0.3)
            assert torch.equal(alone[0, 0], got[0, i]), (name, i)


@needs_kernel
def test_attention_kernel_leaves_what_it_does_not_handle_to_sdpa():
    key = torch.randn(1, 2, 20, 16)
    assert kernel_attention(attention_kernel, torch.randn(1, 4, 17, 16), key, key, None, None) is None  # > 16 rows
    assert kernel_attention(attention_kernel, torch.randn(1, 4, 2, 16).double(), key.double(), key.double(), None,
                            None) is None
    assert kernel_attention(attention_kernel, torch.randn(1, 4, 2, 16), key.transpose(2, 3).contiguous().transpose(2, 3),
                            key, None, None) is None  # keys not stored row by row


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2"])
def test_a_verify_pass_reproduces_the_one_position_passes_bit_for_bit(family):
    """The torch backend's fast path: logits and final states of an n-row pass (chain or token tree; n <= 16, beyond
    the 8 rows of one kernel call) equal those of one-position passes over the same tokens, bit for bit — what makes Kangaroo equal its target alone by
    construction. Gemma 3 and Qwen2 slide a window shorter than the context over some layers."""
    model = tiny_model(family, seed=3, vocab=96, hidden=64, layers=4, heads=4, kv_heads=2, window=12,
                       dtype=torch.float32, init_std=0.3)
    backend = TorchBackend(model, TinyTokenizer(96, None), 2, "t")
    ids = [(13 * i + 5) % 96 for i in range(40)]
    past = 20
    splits = [(n,) for n in (*range(2, 10), 12, 16)]
    check_rows_exact(backend, ids[:past], ids[past:past + 16], splits=splits)
    with pytest.raises(AssertionError, match="differs from its one-position pass"):  # the check has power:
        plain = TorchBackend(model, TinyTokenizer(96, None), 2, "t", kernels="plain")  # transformers' layers fail it
        check_rows_exact(plain, ids[:past], ids[past:past + 16], splits=splits)
    backend.reset()  # the one-position passes again, as the tree's reference
    backend.deep(backend.shallow(ids[:past], 0), 0)
    alone = []
    for i in range(3):
        out = backend.deep(backend.shallow(ids[past + i: past + i + 1], past + i), past + i)
        alone.append((out.logits[0], out.hidden[0]))
    # a token tree: row 1 is row 0's child, row 2 its sibling (hidden from row 1 and 3), row 3 row 1's child
    tree = TreeAttention(committed=past, visible=[(past,), (past, past + 1), (past, past + 2), (past, past + 1, past + 3)],
                         positions=[past, past + 1, past + 1, past + 2])
    backend.crop(past)
    tokens = [ids[past], ids[past + 1], 7, ids[past + 2]]
    out = backend.deep(backend.shallow(tokens, past, tree=tree), past, tree=tree)
    for row, i in ((0, 0), (1, 1), (3, 2)):  # the path 0 -> 1 -> 3 is the sequence's next three tokens
        assert torch.equal(out.logits[row], alone[i][0]) and torch.equal(out.hidden[row], alone[i][1]), row


@pytest.mark.parametrize("q,past", [(1, 0), (1, 7), (4, 0), (5, 11)])
def test_grouped_attention_equals_transformers_sdpa(q, past):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kangaroo_backends.kv_cache import causal_mask

    torch.manual_seed(q * 31 + past)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    query = torch.randn(1, 6, q, 8, dtype=torch.float64)
    key, value = torch.randn(2, 1, 2, past + q, 8, dtype=torch.float64)
    mask = causal_mask(q, past, torch.float64)
    ref, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = grouped_sdpa(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def fp32_target(seed: int):
    model = tiny_llama(seed, vocab=96, hidden=64, layers=4, heads=4, kv_heads=2, dtype=torch.float32, init_std=0.3)
    return model, TinyTokenizer(96, model.generation_config.eos_token_id)


def test_backend_views_share_weights_and_leave_the_model_alone():
    model, tokenizer = fp32_target(0)
    before = {name: type(m) for name, m in model.named_modules()}
    backend = TorchBackend(model, tokenizer, 2, "tiny")
    assert {name: type(m) for name, m in model.named_modules()} == before
    assert model.config._attn_implementation != "kangaroo_grouped_sdpa"
    fast = backend.deep_layers[0].mlp.down_proj
    assert fast.weight is model.model.layers[2].mlp.down_proj.weight  # shared, not copied
    assert backend.kernels == ("small-batch" if kernel is not None else "grouped-attention")
    assert TorchBackend(model, tokenizer, 2, "tiny", kernels="plain").deep_layers[0] is model.model.layers[2]


def _passes(backend, ids, sizes):
    backend.reset()
    h = backend.shallow(ids, 0)
    out = [backend.deep(h, 0).logits]
    start = len(ids)
    for n in sizes:
        new = [(7 * start + i) % 96 for i in range(n)]
        h = backend.shallow(new, start)
        out.append(backend.deep(h, start).logits)
        start += n
    return out


def test_fast_and_plain_passes_agree():
    model, tokenizer = fp32_target(1)
    ids = list(range(3, 40))
    sizes = [1, 2, 3, 8, 5, 4, 6, 7, 1, 9]
    fast = _passes(TorchBackend(model, tokenizer, 1, "t"), ids, sizes)
    plain = _passes(TorchBackend(model, tokenizer, 1, "t", kernels="plain"), ids, sizes)
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _same_or_near_tie(model, prompt, reference, produced):
    if produced == reference:
        return
    first = next(i for i, (a, b) in enumerate(zip(produced + [None], reference + [None])) if a != b)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + reference[:first]])).logits[0, -1].double()
    top = torch.topk(logits, 2).values
    assert float(top[0] - top[1]) < NEAR_TIE, f"token {first} differs and is not a near-tie"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kernels", ["auto", "plain"])
def test_fp32_greedy_identity_with_transformers(seed, kernels):
    """float32 (the kernel's dtype): every position of every verify pass through the fast path, output = transformers."""
    model, tokenizer = fp32_target(seed)
    prompt = [(11 * seed + 5 * i) % 96 for i in range(9)]
    reference = hf_greedy(model, prompt, 40)
    backend = TorchBackend(model, tokenizer, 1 + seed % 3, "t", kernels=kernels)
    config = DecodeConfig(eta=0.0, gamma=7, exit_layer=backend.exit_layer, max_new_tokens=40)
    engine = Engine(backend, KangarooDrafter(), ThresholdPolicy(eta=0.0), GreedyVerifier(), config)
    result = engine.generate_ids(prompt)
    _same_or_near_tie(model, prompt, reference, result.token_ids)
    vanilla = Engine(backend, None, ThresholdPolicy(eta=0.0), GreedyVerifier(), config).generate_ids(prompt)
    _same_or_near_tie(model, prompt, vanilla.token_ids, result.token_ids)


def test_kernel_switch_errors_and_fallback(monkeypatch):
    model, tokenizer = fp32_target(2)
    with pytest.raises(ConfigError, match="kernels must be one of"):
        TorchBackend(model, tokenizer, 1, "t", kernels="fast")
    monkeypatch.setenv("KANGAROO_NATIVE", "0")
    native._library.cache_clear()
    try:
        assert native.small_batch_kernel() == (None, "disabled by KANGAROO_NATIVE=0")
        assert TorchBackend(model, tokenizer, 1, "t").kernels == "grouped-attention"
        with pytest.raises(ConfigError, match="kernels=small-batch is unavailable: disabled by KANGAROO_NATIVE=0"):
            TorchBackend(model, tokenizer, 1, "t", kernels="small-batch")
    finally:
        native._library.cache_clear()


def test_a_failing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("KANGAROO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    native._library.cache_clear()
    try:
        function, why = native.small_batch_kernel()
        assert function is None and why.startswith("building the small-batch kernel failed")
    finally:
        native._library.cache_clear()


def test_a_native_build_is_kept_per_cpu(monkeypatch, tmp_path):
    """-march=native code can crash another CPU with an illegal instruction: a cache directory shared between machines
    keeps one build per CPU (model name and instruction sets), and one build for all CPUs without -march=native."""
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("KANGAROO_CACHE_DIR", str(tmp_path))
    sources = {"one.c": b"int one(void) { return 1; }\n"}
    flags = ("-O1", "-march=native", "-shared", "-fPIC")
    here = native.build_library(cc, sources, flags, "one")
    assert native.build_library(cc, sources, flags, "one") == here and here.is_file()
    assert native.cpu_identity() and native.cpu_identity() == native.cpu_identity()
    monkeypatch.setattr(native, "cpu_identity", lambda: "another CPU|avx2")
    there = native.build_library(cc, sources, flags, "one")
    assert there != here and there.is_file()
    portable = ("-O1", "-shared", "-fPIC")
    monkeypatch.setattr(native, "cpu_identity", lambda: "a third CPU")
    first = native.build_library(cc, sources, portable, "one")
    monkeypatch.setattr(native, "cpu_identity", lambda: "a fourth CPU")
    assert native.build_library(cc, sources, portable, "one") == first


def test_fast_layers_only_swap_linears_and_attention_config():
    model, _ = fp32_target(3)
    twin = fast_layers(model.model.layers[:1], None, model.config)[0]
    assert twin is not model.model.layers[0]
    assert twin.self_attn.q_proj is model.model.layers[0].self_attn.q_proj  # no kernel: the linears are the model's
    assert twin.self_attn.config._attn_implementation == "kangaroo_grouped_sdpa"


def test_measure_costs_on_a_tiny_backend():
    model, tokenizer = fp32_target(0)
    backend = TorchBackend(model, tokenizer, 1, "t")
    drafter = KangarooDrafter()
    drafter.bind(backend)
    curve = measure_costs(backend, drafter, context=20, positions=(4, 1, 2), repeats=3)
    assert curve.positions == (1, 2, 4) and len(curve.verify_ms) == 3 and all(ms > 0 for ms in curve.verify_ms)
    assert curve.relative[1] == 1.0 and curve.draft_step_ms > 0
    assert "| × one position | 1.00 |" in curve.table()
    with pytest.raises(ValueError, match="exceeds"):
        measure_costs(backend, None, context=backend.max_context, positions=(1,), repeats=1)


def test_profile_command(tiny_model_dir, tmp_path, capsys):
    out, plot = tmp_path / "curve.json", tmp_path / "curve.png"
    code = main(["profile", "--model", str(tiny_model_dir), "--context", "16", "--positions", "1,2,4", "--repeats", "2",
                 "--compare-plain", "--out", str(out), "--plot", str(plot)])
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert printed.count("| positions | 1 | 2 | 4 |") == 2 and "kernels: plain" in printed
    curves = json.loads(out.read_text())
    assert [c["positions"] for c in curves] == [[1, 2, 4]] * 2 and plot.stat().st_size > 1000
    assert main(["profile", "--model", str(tiny_model_dir), "--positions", "0"]) == 2
    assert "positive" in capsys.readouterr().err


def test_place_weights_aligns_every_weight_and_changes_nothing_else(tiny_model_dir):
    """Weights mapped from safetensors sit at the file's 8-byte offsets; placed, each starts on a page (so every
    weight row a kernel streams is cache-line aligned), with the same values, the same Parameter objects and the
    tied head still tied — and the model computes the same logits bit for bit. Placing twice moves nothing."""
    from kangaroo_backends.loading import load_model

    model, _, _ = load_model(tiny_model_dir)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        before_logits = model(ids).logits
    params = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert place_weights(model) == len(params)
    assert dict(model.named_parameters()) == params  # the same objects
    for name, p in model.named_parameters():
        assert p.data_ptr() % 4096 == 0, name
        assert torch.equal(p, before[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before_logits)
    assert place_weights(model) == 0


def test_the_torch_backend_places_the_weights_of_models_it_loads_only(tiny_model_dir):
    """The backend's own loading (CLI, bench, ``create``) places the weights for the fast path; ``kernels=plain``
    keeps transformers' model exactly as loaded; a model object passed in is never touched."""
    config = DecodeConfig(exit_layer=2)
    fast = TorchBackend.create(config, model=str(tiny_model_dir))
    assert all(p.data_ptr() % 4096 == 0 for p in fast.model.parameters())
    plain = TorchBackend.create(config, model=str(tiny_model_dir), kernels="plain")
    assert not all(p.data_ptr() % 4096 == 0 for p in plain.model.parameters())  # the file's own offsets
    users = tiny_llama(3, vocab=64, dtype=torch.float32)
    pointers = [p.data_ptr() for p in users.parameters()]
    TorchBackend(users, TinyTokenizer(64, None), 2, "t")
    assert [p.data_ptr() for p in users.parameters()] == pointers


@needs_kernel
@pytest.mark.skipif("avx2" not in cpu_identity(),
                    reason="builds and runs an x86-64-v3 library: needs an x86 CPU with AVX2")
def test_the_avx2_build_of_the_small_batch_kernels_gives_this_cpu_s_bits(monkeypatch, tmp_path):
    """An AVX2-only CPU runs the kernels built for its 8-lane registers: a 16-lane GCC vector has no register there
    and every operation on it went through memory (docs/backends.md, "Kernels on an AVX2-only CPU"). The 8-lane
    build keeps each output's additions, so it gives the bits of this CPU's own build (16 lanes with AVX-512): a
    row's result, and so a greedy answer, does not depend on the CPU generation. Built for x86-64-v3 here, whatever
    this CPU is."""
    import ctypes
    from importlib import resources

    cc = native.compiler()
    monkeypatch.setenv("KANGAROO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    sources = {name: resources.files("kangaroo_backends").joinpath(name).read_bytes() for name in native.SOURCES}
    builds = [native.build_library(cc, sources, native.FLAGS, "small_batch")]
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    builds.append(native.build_library(cc, sources, native.FLAGS, "small_batch"))
    assert builds[0] != builds[1]
    libraries = [ctypes.CDLL(str(path)) for path in builds]
    for lib in libraries:
        lib.small_batch_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
        lib.small_batch_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 10 + [ctypes.c_float, ctypes.c_int]
    gen = torch.Generator().manual_seed(0)

    def linear(lib, x, w):
        y = torch.empty(x.shape[0], w.shape[0])
        assert lib.small_batch_linear(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], w.shape[0], 2) == 0
        return y

    for rows in (1, 2, 3, 5, 8, 11):
        for inner, out in ((576, 96), (72, 37), (40, 5)):  # widths with and without a 16-element remainder
            x, w = torch.randn(rows, inner, generator=gen), torch.randn(out, inner, generator=gen)
            wide, narrow = (linear(lib, x, w) for lib in libraries)
            assert torch.equal(wide.view(torch.int32), narrow.view(torch.int32)), (rows, inner, out)

    def attention(lib, q, k, v, mask):
        rows, heads, d = q.shape
        keys, kv_heads, _ = k.shape
        out = torch.empty_like(q)
        assert lib.small_batch_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(), heads,
                                         kv_heads, rows, keys, d, d, heads * d, d, kv_heads * d, keys, 0.125, 2) == 0
        return out

    for rows, keys, d in ((1, 1, 64), (1, 300, 64), (3, 37, 64), (6, 129, 72), (2, 9, 256)):
        q = torch.randn(rows, 9, d, generator=gen)
        k, v = torch.randn(keys, 3, d, generator=gen), torch.randn(keys, 3, d, generator=gen)
        mask = torch.zeros(rows, keys)
        mask[:, keys // 2:] = torch.where(torch.rand(rows, keys - keys // 2, generator=gen) < 0.3, float("-inf"), 0.0)
        wide, narrow = (attention(lib, q, k, v, mask) for lib in libraries)
        assert torch.equal(wide.view(torch.int32), narrow.view(torch.int32)), (rows, keys, d)
