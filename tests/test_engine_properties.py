"""Property tests of the decode loop on tiny random float64 Llama models.

Every decoder (the target alone, the untrained Kangaroo drafter, a scripted drafter that is right or wrong on
purpose) must reproduce transformers' own greedy ``generate`` token for token. Along the way the tests check, after
every round: the target's KV cache (shallow and deep layers) and the drafter's state against a fresh prefill of the
accepted text; that M[:l] runs exactly once per position and M[l:] once per verified position; and the per-round
statistics (drafted / accepted / emitted, CR, CTAR).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_core.results import GenerationResult
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_policies.threshold import ThresholdPolicy

from kangaroo_apps.testing import ScriptedDrafter, error_positions, hf_greedy, set_eos, tiny_backend, tiny_llama

ATOL = 1e-10

PROPERTY_SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# (heads, kv_heads, head_dim) with hidden = heads * head_dim in 16..64
HEAD_GEOMETRIES = [
    (h, kv, hd)
    for h in (1, 2, 4, 8)
    for kv in (1, 2, 4, 8)
    if h % kv == 0
    for hd in (4, 8, 16, 32, 64)
    if 16 <= h * hd <= 64
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- instrumentation --------------------------------------------------------------------------------------------------
class LayerCounter:
    """Positions and calls through every decoder layer of a backend, counted only while ``active``."""

    def __init__(self, backend):
        self.backend = backend
        self.active = False
        self.layers = list(backend.shallow_layers) + list(backend.deep_layers)
        self.positions = [0] * len(self.layers)
        self.calls = [0] * len(self.layers)
        self._handles = [layer.register_forward_pre_hook(self._hook(i)) for i, layer in enumerate(self.layers)]

    def _hook(self, i):
        def hook(_module, args):
            if self.active:
                self.positions[i] += args[0].shape[1]  # hidden states [1, n, d]
                self.calls[i] += 1

        return hook

    @contextlib.contextmanager
    def counting(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def remove(self):
        for handle in self._handles:
            handle.remove()

    @property
    def shallow_positions(self):
        return self.positions[: self.backend.exit_layer]

    @property
    def deep_positions(self):
        return self.positions[self.backend.exit_layer:]

    @property
    def shallow_calls(self):
        return self.calls[: self.backend.exit_layer]

    @property
    def deep_calls(self):
        return self.calls[self.backend.exit_layer:]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.numel():
        err = (actual - expected).abs().max().item()
        assert err <= ATOL, f"{what}: max abs difference {err:.3g} > {ATOL}"


@torch.inference_mode()
def check_caches(engine: Engine, full_reference: Sequence[int], fresh, cached: int) -> dict:
    """The target's and the drafter's caches hold exactly the first ``cached`` positions of ``full_reference``.

    ``fresh`` is a second backend over the same model; it prefills those positions in one pass (M[:l] then M[l:]).
    Returns the drafter's position count.
    """
    backend = engine.backend
    assert backend.cache_lengths() == (cached, cached)
    assert backend.cache.lengths == [cached] * backend.num_layers
    fresh.reset()
    h = fresh.shallow(list(full_reference[:cached]), 0)
    fresh.deep(h, 0)
    for i in range(backend.num_layers):
        (k, v), (k_ref, v_ref) = backend.cache.layer(i), fresh.cache.layer(i)
        assert_close(k, k_ref, f"layer {i} keys")
        assert_close(v, v_ref, f"layer {i} values")

    drafter = engine.drafter
    if drafter is None:
        return 0
    seen = drafter.seen
    assert 0 <= seen <= cached
    if isinstance(drafter, KangarooDrafter):
        assert drafter.runner.cache.lengths == [seen]
        if seen:
            cache = drafter.adapter.new_cache()
            drafter.adapter(h[:seen][None], 0, cache)
            (k, v), (k_ref, v_ref) = drafter.runner.cache.layer(0), cache.layer(0)
            assert_close(k, k_ref, "adapter keys")
            assert_close(v, v_ref, "adapter values")
    elif isinstance(drafter, ScriptedDrafter):
        got = torch.stack(drafter.hidden) if seen else h[:0]
        assert_close(got, h[:seen], "layer-l states given to the drafter")
    return seen


def drive(engine: Engine, prompt: list[int], max_new_tokens: int, full_reference: Sequence[int], fresh,
          counter: LayerCounter | None = None) -> tuple[GenerationResult, list[tuple[int, int]]]:
    """Run ``engine.decode`` round by round, checking the caches at every round boundary.

    ``full_reference`` is prompt + the target's greedy continuation without EOS (at least ``max_new_tokens`` long).
    Returns the result and, per yield, (target cached positions, drafter seen positions).
    """
    gen = engine.decode(list(prompt), max_new_tokens)
    eos = engine.backend.eos_token_ids
    output: list[int] = []
    snapshots = []
    while True:
        try:
            with counter.counting() if counter else contextlib.nullcontext():
                emitted = next(gen)
        except StopIteration as stop:
            result = stop.value
            break
        assert emitted, "a round emitted nothing"
        output.extend(emitted)
        n = len(prompt) + len(output)
        assert list(full_reference[:n]) == prompt + output, "output diverged from the target's greedy decoding"
        cached = engine.backend.cache_lengths()[0]
        if output[-1] in eos:
            # accepted drafts after an EOS stay cached (they are the target's own tokens); generation ends here
            assert n - 1 <= cached <= n - 1 + engine.config.gamma
        else:
            assert cached == n - 1, "at a round boundary every token but the last is cached"
        seen = check_caches(engine, full_reference, fresh, cached)
        snapshots.append((cached, seen))
    assert result.token_ids == output
    return result, snapshots


def check_result(result: GenerationResult, prompt: list[int], max_new_tokens: int, gamma: int, eos: frozenset,
                 drafting: bool) -> None:
    """Length, EOS and statistics invariants of one generation."""
    out = result.token_ids
    assert 1 <= len(out) <= max_new_tokens
    assert result.prompt_tokens == len(prompt)
    assert result.stopped_on_eos == (out[-1] in eos)
    assert not any(t in eos for t in out[:-1]), "EOS is only ever the last token"
    if out[-1] not in eos:
        assert len(out) == max_new_tokens, "exactly max_new_tokens tokens unless EOS comes first"
    rounds = result.rounds
    assert sum(r.emitted for r in rounds) + 1 == len(out), "the prefill emits one token, each round its `emitted`"
    produced = 1
    for i, r in enumerate(rounds):
        budget = max_new_tokens - produced
        assert 0 <= r.accepted <= r.drafted <= (min(gamma, budget - 1) if drafting else 0)
        last = i == len(rounds) - 1
        if last:
            assert 1 <= r.emitted <= r.accepted + 1
        else:
            assert r.emitted == r.accepted + 1
        produced += r.emitted
    if rounds:
        assert result.mean_accepted_tokens == pytest.approx(sum(r.emitted for r in rounds) / len(rounds))
        assert 1 <= result.mean_accepted_tokens <= gamma + 1
    else:
        assert result.mean_accepted_tokens == 0.0
    ctar = result.ctar
    assert len(ctar) == gamma
    assert all(0.0 <= c <= 1.0 for c in ctar)
    assert all(a >= b for a, b in zip(ctar, ctar[1:])), f"CTAR must be non-increasing: {ctar}"
    for w, c in enumerate(ctar, start=1):
        assert c == pytest.approx(sum(r.accepted >= w for r in rounds) / len(rounds) if rounds else 0.0)


def check_counts(counter: LayerCounter, result: GenerationResult) -> None:
    """M[:l] runs once per position (prompt, each round's x_n, each draft); M[l:] once per verified position."""
    p, rounds = result.prompt_tokens, result.rounds
    drafted = sum(r.drafted for r in rounds)
    assert counter.shallow_positions == [p + len(rounds) + drafted] * len(counter.shallow_positions)
    assert counter.deep_positions == [p + sum(r.drafted + 1 for r in rounds)] * len(counter.deep_positions)
    assert counter.shallow_calls == [1 + len(rounds) + drafted] * len(counter.shallow_calls)
    assert counter.deep_calls == [1 + len(rounds)] * len(counter.deep_calls)


def check_drafter_positions(snapshots, result: GenerationResult, max_new_tokens: int) -> None:
    """After a round that drafted, the drafter has seen every accepted position but h(d_k) when all k were accepted
    (that state is handed to it next round, paper phase 5), and every accepted position otherwise."""
    assert snapshots[0][1] == 0, "the prompt's states are given to the drafter with the first draft, not at prefill"
    for (cached, seen), r in zip(snapshots[1:], result.rounds):
        if r.drafted == 0:
            continue
        all_accepted = r.accepted == r.drafted
        assert seen == (cached - 1 if all_accepted else cached), (r, cached, seen)


def simulate_scripted(drafter: ScriptedDrafter, prompt: list[int], reference_out: list[int], max_new_tokens: int,
                      gamma: int, eta: float, eos: frozenset) -> list[tuple[int, int, int]]:
    """(drafted, accepted, emitted) per round, derived from the script alone (the spec of draft/stop/verify/accept)."""
    full = prompt + reference_out
    output = [reference_out[0]]
    rounds = []
    while output[-1] not in eos and len(output) < max_new_tokens:
        t = len(prompt) + len(output)
        max_drafts = min(gamma, max_new_tokens - len(output) - 1)
        seq, k = prompt + output, 0
        while k < max_drafts and t + k not in drafter.none_at:
            token = drafter.token_at(seq)
            confidence = torch.softmax(drafter.logits_for(token, t + k).float(), dim=-1).max().item()
            seq.append(token)
            k += 1
            if token in eos or not confidence > eta:  # drafting ends after an EOS draft
                break
        m = 0
        while m < k and t + m not in drafter.wrong_at:
            m += 1
        emitted = full[t: t + m + 1]
        for i, token in enumerate(emitted):
            if token in eos:
                emitted = emitted[: i + 1]
                break
        rounds.append((k, m, len(emitted)))
        output += emitted
    return rounds


def make_engine(backend, drafter, eta: float, gamma: int, max_new_tokens: int) -> Engine:
    config = DecodeConfig(eta=eta, gamma=gamma, exit_layer=backend.exit_layer, max_new_tokens=max_new_tokens)
    return Engine(backend, drafter, ThresholdPolicy(eta=eta), GreedyVerifier(), config)


# -- strategies -------------------------------------------------------------------------------------------------------
@st.composite
def cases(draw):
    layers = draw(st.integers(2, 5))
    heads, kv_heads, head_dim = draw(st.sampled_from(HEAD_GEOMETRIES))
    vocab = draw(st.integers(32, 128))
    return {
        "seed": draw(st.integers(0, 2**16)),
        "layers": layers,
        "exit_layer": draw(st.integers(1, layers - 1)),
        "heads": heads,
        "kv_heads": kv_heads,
        "hidden": heads * head_dim,
        "vocab": vocab,
        "prompt": draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20)),
        "eta": draw(st.one_of(st.sampled_from([0.0, 0.0, 0.5, 1.0]), st.floats(0.0, 1.0))),
        "gamma": draw(st.integers(1, 6)),
        "max_new_tokens": draw(st.integers(1, 24)),
        "eos": draw(st.sampled_from(["none", "none", "from_output", "random", "several"])),
        "eos_pick": draw(st.integers(0, 10**6)),
        "error_rate": draw(st.sampled_from([0.0, 0.0, 0.1, 0.2, 0.35, 0.7])),
        "none_rate": draw(st.sampled_from([0.0, 0.0, 0.1])),
        "script_seed": draw(st.integers(0, 2**16)),
    }


# -- the properties ---------------------------------------------------------------------------------------------------
@PROPERTY_SETTINGS
@given(case=cases())
def test_every_decoder_matches_transformers_greedy(case):
    """Vanilla, Kangaroo and scripted decoding all equal ``model.generate(do_sample=False)``, with exact caches,
    M[:l] once per position, and consistent statistics."""
    prompt, n, gamma, eta = case["prompt"], case["max_new_tokens"], case["gamma"], case["eta"]
    model = tiny_llama(case["seed"], vocab=case["vocab"], hidden=case["hidden"], layers=case["layers"],
                       heads=case["heads"], kv_heads=case["kv_heads"], eos_token_id=None)
    reference_out = hf_greedy(model, prompt, n)  # no EOS: exactly n tokens
    assert len(reference_out) == n

    if case["eos"] == "none":
        eos_id = None
    elif case["eos"] == "from_output":
        eos_id = reference_out[case["eos_pick"] % n]
    elif case["eos"] == "random":
        eos_id = case["eos_pick"] % case["vocab"]
    else:  # several EOS ids (a list in the generation config), one of them from the output
        eos_id = sorted({reference_out[case["eos_pick"] % n], case["eos_pick"] % case["vocab"], (case["eos_pick"] // 7) % case["vocab"]})
    set_eos(model, eos_id)
    expected = hf_greedy(model, prompt, n)
    eos_ids = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else eos_id
    stop = next((i for i, t in enumerate(reference_out) if t in eos_ids), None)
    assert expected == (reference_out if stop is None else reference_out[: stop + 1])

    backend = tiny_backend(model, exit_layer=case["exit_layer"], seed=case["seed"])
    fresh = tiny_backend(model, exit_layer=case["exit_layer"], seed=case["seed"])
    eos = backend.eos_token_ids
    assert eos == frozenset(eos_ids)
    full = prompt + reference_out

    rng = random.Random(case["script_seed"])
    confidences: dict[int, float] = {}

    def confidence(position: int) -> float:
        return confidences.setdefault(position, rng.choice([rng.uniform(0.05, 0.999), 0.999, 0.3]))

    p = len(prompt)
    scripted = ScriptedDrafter(
        full, case["vocab"],
        wrong_at=error_positions(rng, p, p + n, case["error_rate"]),
        confidence=confidence,
        none_at=error_positions(rng, p, p + n, case["none_rate"]),
    )

    counter = LayerCounter(backend)
    try:
        for drafter in (None, KangarooDrafter(), scripted):
            counter.positions = [0] * len(counter.layers)
            counter.calls = [0] * len(counter.layers)
            engine = make_engine(backend, drafter, eta, gamma, n)
            result, snapshots = drive(engine, prompt, n, full, fresh, counter)
            label = type(drafter).__name__
            assert result.token_ids == expected, f"{label} is not lossless"
            check_result(result, prompt, n, gamma, eos, drafting=drafter is not None)
            check_counts(counter, result)
            if drafter is None:
                assert all(r.drafted == 0 and r.emitted == 1 for r in result.rounds)
            if isinstance(drafter, KangarooDrafter) or (drafter is scripted and not scripted.none_at):
                check_drafter_positions(snapshots, result, n)
            event(f"{label}: EOS {'ended' if result.stopped_on_eos else 'did not end'} the generation")
            if any(r.drafted and r.accepted == r.drafted for r in result.rounds[:-1]):
                event(f"{label}: a round accepted every draft (phase-5 reuse)")
            if any(0 < r.accepted < r.drafted for r in result.rounds):
                event(f"{label}: partial acceptance")
            if result.stopped_on_eos and result.rounds and result.rounds[-1].emitted <= result.rounds[-1].accepted:
                event(f"{label}: EOS inside the accepted drafts")
            if drafter is scripted:
                got = [(r.drafted, r.accepted, r.emitted) for r in result.rounds]
                assert got == simulate_scripted(scripted, prompt, reference_out, n, gamma, eta, eos)
    finally:
        counter.remove()


# -- targeted cases ---------------------------------------------------------------------------------------------------
def _model_and_reference(seed=3, vocab=48, hidden=32, layers=4, heads=4, kv_heads=2, prompt=(5, 9, 2, 7), n=24):
    model = tiny_llama(seed, vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads)
    return model, list(prompt), hf_greedy(model, list(prompt), n)


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("n", [2, 13, 24])
def test_perfect_drafter_gets_every_draft_accepted(gamma, n):
    """A drafter that never errs, with eta=0: every round drafts min(gamma, budget-1) and all are accepted, so
    CR == gamma+1 (but for the budget-limited last round), CTAR == 1; the last draft's layer-l state is reused."""
    model, prompt, ref = _model_and_reference(n=24)
    ref = ref[:n]
    backend = tiny_backend(model, exit_layer=2)
    fresh = tiny_backend(model, exit_layer=2)
    drafter = ScriptedDrafter(prompt + ref, model.config.vocab_size, confidence=0.95)
    counter = LayerCounter(backend)
    try:
        result, snapshots = drive(make_engine(backend, drafter, 0.0, gamma, n), prompt, n, prompt + ref, fresh, counter)
    finally:
        counter.remove()
    assert result.token_ids == ref
    check_result(result, prompt, n, gamma, backend.eos_token_ids, drafting=True)
    check_counts(counter, result)
    check_drafter_positions(snapshots, result, n)

    full_rounds, rest = divmod(n - 1, gamma + 1)
    expected = [(gamma, gamma, gamma + 1)] * full_rounds + ([(rest - 1, rest - 1, rest)] if rest else [])
    assert [(r.drafted, r.accepted, r.emitted) for r in result.rounds] == expected
    if full_rounds:
        assert result.ctar[gamma - 1] == pytest.approx(full_rounds / len(result.rounds))
    if not rest and full_rounds:
        assert result.mean_accepted_tokens == gamma + 1
        assert result.ctar == [1.0] * gamma
    # phase 5: after the first round the drafter gets h(d_k) (saved while drafting) together with h(x_n)
    drafting_rounds = sum(1 for r in result.rounds if r.drafted)
    first_calls = [n_states for _, n_states in drafter.calls if n_states > 1]
    assert first_calls == ([len(prompt) + 1] + [2] * (drafting_rounds - 1) if drafting_rounds else [])
    assert len(drafter.calls) == sum(r.drafted for r in result.rounds)  # one advance per draft


def test_partial_acceptance_rolls_back_exactly():
    """Errors at chosen positions: each round accepts up to the first wrong draft, the caches keep only the accepted
    positions, and the target's correction continues the output."""
    model, prompt, ref = _model_and_reference(n=24)
    p, gamma, n = len(prompt), 4, 24
    wrong = {p + 1, p + 3, p + 4, p + 12, p + 13, p + 14}
    backend, fresh = tiny_backend(model, exit_layer=1), tiny_backend(model, exit_layer=1)
    drafter = ScriptedDrafter(prompt + ref, model.config.vocab_size, wrong_at=wrong, confidence=0.9)
    counter = LayerCounter(backend)
    try:
        result, snapshots = drive(make_engine(backend, drafter, 0.5, gamma, n), prompt, n, prompt + ref, fresh, counter)
    finally:
        counter.remove()
    assert result.token_ids == ref
    check_counts(counter, result)
    check_drafter_positions(snapshots, result, n)
    got = [(r.drafted, r.accepted, r.emitted) for r in result.rounds]
    assert got == simulate_scripted(drafter, prompt, ref, n, gamma, 0.5, frozenset())
    # round 1 drafts positions p+1..p+4 and stops at the wrong p+1; round 2 starts at p+2, p+3 is wrong
    assert got[:3] == [(4, 0, 1), (4, 1, 2), (4, 0, 1)]
    assert any(a == d for d, a, _ in got) and any(a < d for d, a, _ in got)


def _eos_inside_draft_case(gamma: int):
    """A model whose greedy output has a token that first occurs strictly inside a draft (more drafts after it)."""
    prompt, n = [5, 9, 2, 7], 24
    for seed in range(200):
        model = tiny_llama(seed, vocab=48, hidden=32, layers=3, heads=4, kv_heads=2)
        ref = hf_greedy(model, prompt, n)
        for j, token in enumerate(ref):
            # output index j sits at draft slot (j-1) % (gamma+1) of its round (slot gamma is the target's own token)
            if j >= 1 and token not in ref[:j] and (j - 1) % (gamma + 1) <= gamma - 2 and j + gamma < n:
                return model, prompt, ref, j
    raise AssertionError("no seed gives an EOS candidate inside a draft")


@pytest.mark.parametrize("gamma", [3, 6])
@pytest.mark.parametrize("drafter_kind", ["scripted", "kangaroo"])
def test_eos_inside_a_draft_ends_generation_there(gamma, drafter_kind):
    model, prompt, ref, j = _eos_inside_draft_case(gamma)
    eos_id = ref[j]
    set_eos(model, eos_id)
    expected = hf_greedy(model, prompt, 24)
    assert expected == ref[: j + 1]
    backend, fresh = tiny_backend(model, exit_layer=1), tiny_backend(model, exit_layer=1)
    if drafter_kind == "scripted":
        drafter = ScriptedDrafter(prompt + ref, model.config.vocab_size, confidence=0.99)
    else:
        drafter = KangarooDrafter()
    result, snapshots = drive(make_engine(backend, drafter, 0.0, gamma, 24), prompt, 24, prompt + ref, fresh)
    assert result.token_ids == expected
    assert result.stopped_on_eos
    check_result(result, prompt, 24, gamma, backend.eos_token_ids, drafting=True)
    if drafter_kind == "scripted":
        last = result.rounds[-1]
        slot = (j - 1) % (gamma + 1)
        # drafting stops at the EOS draft (nothing after it could be emitted): drafts up to EOS, all accepted
        assert slot < gamma
        assert (last.drafted, last.accepted, last.emitted) == (slot + 1, slot + 1, slot + 1)
        assert [r.emitted for r in result.rounds[:-1]] == [gamma + 1] * (len(result.rounds) - 1)
        assert snapshots[-1][0] == len(prompt) + j + 1  # the caches end at the EOS


def test_engine_is_reusable_across_generations():
    """One engine, several prompts (long, then short, then long): every generation starts from clean caches."""
    model = tiny_llama(11, vocab=40, hidden=48, layers=3, heads=6, kv_heads=2)
    backend, fresh = tiny_backend(model, exit_layer=1), tiny_backend(model, exit_layer=1)
    prompts = [list(range(3, 21)), [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    references = [hf_greedy(model, prompt, 16) for prompt in prompts]
    for drafter in (KangarooDrafter(), ScriptedDrafter(prompts[0] + references[0], 40, wrong_at={20, 23})):
        engine = make_engine(backend, drafter, 0.2, 4, 16)
        for prompt, ref in zip(prompts, references):
            if isinstance(drafter, ScriptedDrafter):
                drafter.reference = prompt + ref
            result, _ = drive(engine, prompt, 16, prompt + ref, fresh)
            assert result.token_ids == ref


# -- the checks themselves can fail -----------------------------------------------------------------------------------
def test_cache_check_detects_a_corrupted_cache():
    model, prompt, ref = _model_and_reference(n=10)
    backend, fresh = tiny_backend(model, exit_layer=2), tiny_backend(model, exit_layer=2)
    drafter = KangarooDrafter()
    engine = make_engine(backend, drafter, 0.3, 3, 10)
    drive(engine, prompt, 10, prompt + ref, fresh)
    cached = backend.cache_lengths()[0]
    check_caches(engine, prompt + ref, fresh, cached)
    backend.cache.keys[3][0, 0, cached - 2, 0] += 1e-6
    with pytest.raises(AssertionError, match="layer 3 keys"):
        check_caches(engine, prompt + ref, fresh, cached)
    backend.cache.keys[3][0, 0, cached - 2, 0] -= 1e-6
    drafter.runner.cache.values[0][0, 0, 1, 0] += 1e-6
    with pytest.raises(AssertionError, match="adapter values"):
        check_caches(engine, prompt + ref, fresh, cached)


def test_scripted_drafter_checks_the_feeding_contract():
    drafter = ScriptedDrafter([1, 2, 3, 4, 5], 8)
    h = torch.zeros(3, 4, dtype=torch.float64)
    logits = drafter.advance([1, 2, 3], h)
    assert int(logits.argmax()) == 4
    assert torch.softmax(logits, -1).max().item() == pytest.approx(0.9)
    with pytest.raises(AssertionError):
        drafter.advance([1, 2, 3, 4, 5], h[:1])  # one position skipped
    drafter.crop(2)
    assert drafter.seen == 2
    assert int(drafter.advance([1, 2, 3], h[:1]).argmax()) == 4
    drafter = ScriptedDrafter([1, 2, 3, 4, 5], 8, wrong_at={3})
    assert int(drafter.advance([1, 2, 3], h).argmax()) != 4
