"""How good is a stopping policy? Exact greedy simulation on the target's own answers, a measured cost model, and the
draft-confidence calibration (``kangaroo analyze-policies``).

Why a simulation is exact here: under greedy decoding a draft continues only while it equals the target's own greedy
token, so every draft the engine ever *accepts* was made from the true prefix. The drafter's prediction at answer
position j with the true prefix (teacher forcing, one :meth:`SelfDrafter.advance` per position) is therefore exactly
the draft the engine would make there, with the same confidence — for any policy, eta and gamma. One greedy run of the
target plus one teacher-forced pass of the drafter per answer replay every policy's rounds without re-decoding:

* a round starting after answer token j drafts positions j+1, j+2, ... and stops at the first wrong draft (the verify
  rejects it), when the policy says stop (that draft is still proposed), at gamma drafts, or at the token budget;
* the policy sees the same :class:`DraftStep` objects (index, token, probs, confidence) the engine would show it.

Glossary: ``correct[j]`` — the draft for answer token j+1 equals it (accepted if reached); ``confidence[j]`` — that
draft's top-1 probability; a round = (accepted, drafted).

Cost model (measured here, per call, median of repeats): ``t_exit`` = M[:l] for one token (step 1 of a round),
``t_draft`` = one draft step (drafter advance + M[:l] of the draft), ``t_verify[k]`` = M[l:] over k+1 positions,
fitted by a line base + slope·k. Predicted time of a round = t_exit + drafted·t_draft + verify(drafted); target alone
= t_exit + verify(0) per token. On a CPU the verify is compute-bound, so every extra position costs ``slope`` — one
more draft really costs (t_draft + slope) / base verify passes (``marginal_draft_cost``: the number to give the
``learned`` policy as ``draft_cost``). Predicted speedup = tokens·(t_exit + t_verify[0]) / Σ rounds' time. It ignores Python overhead per round, so
it ranks policies rather than promising a wall-time figure (``kangaroo bench`` measures those).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from kangaroo_core import metrics
from kangaroo_core.interfaces import Backend, SelfDrafter, StoppingPolicy
from kangaroo_core.results import RoundResult
from kangaroo_tools.replay import Answer, replay_answer, simulate_policy

#: Confidence bins of the calibration plot.
CALIBRATION_BINS = 10
#: The eta grid of the optimal-eta search.
ETA_GRID = tuple(round(0.05 * i, 2) for i in range(20))


@attrs.frozen
class Costs:
    """Measured seconds per call (medians): see the module docstring."""

    t_exit: float
    t_draft: float
    t_verify: tuple[float, ...]  # t_verify[k]: M[l:] over k + 1 positions, k = 0..gamma

    @property
    def verify_line(self) -> tuple[float, float]:
        """Least-squares ``t_verify[k] ≈ base + slope·k`` (single medians are noisy on a shared machine)."""
        ks = range(len(self.t_verify))
        n, mean_k = len(self.t_verify), (len(self.t_verify) - 1) / 2
        mean_t = sum(self.t_verify) / n
        var = sum((k - mean_k) ** 2 for k in ks)
        slope = sum((k - mean_k) * (t - mean_t) for k, t in zip(ks, self.t_verify)) / var if var else 0.0
        return mean_t - slope * mean_k, slope

    def verify_seconds(self, drafted: int) -> float:
        base, slope = self.verify_line
        return base + slope * drafted

    def round_seconds(self, drafted: int) -> float:
        return self.t_exit + drafted * self.t_draft + self.verify_seconds(drafted)

    @property
    def vanilla_token_seconds(self) -> float:
        return self.t_exit + self.verify_seconds(0)

    def as_dict(self) -> dict[str, Any]:
        base, slope = self.verify_line
        return {"t_exit": self.t_exit, "t_draft": self.t_draft, "t_verify": list(self.t_verify),
                "verify_fit": {"base": base, "per_extra_position": slope},
                "draft_cost_per_verify": self.t_draft / base,
                # what one more draft really costs, in verify passes: the draft step + one more verified position
                "marginal_draft_cost": (self.t_draft + slope) / base}


def round_summary(rounds: Sequence[RoundResult], costs: Costs | None, gamma: int) -> dict[str, Any]:
    """CR, CTAR(1..gamma), drafts per round (:func:`kangaroo_core.metrics.round_summary`) and the cost model's
    predicted speedup of a set of replayed rounds."""
    out = {**metrics.round_summary(rounds, gamma), "predicted_speedup": None}
    if rounds and costs is not None:
        seconds = sum(costs.round_seconds(r.drafted) for r in rounds)
        out["predicted_speedup"] = sum(r.emitted for r in rounds) * costs.vanilla_token_seconds / seconds
    return out


@torch.inference_mode()
def measure_costs(backend: Backend, drafter: SelfDrafter, prompt_ids: Sequence[int], gamma: int,
                  repeats: int = 15) -> Costs:
    """Median seconds of one first early exit, one draft step and each verify width, at the end of a real prompt."""
    prompt = list(prompt_ids)
    backend.reset()
    drafter.reset()
    hidden = backend.shallow(prompt, 0)
    backend.deep(hidden, 0, rows=[len(prompt) - 1])
    drafter.advance(prompt, hidden)
    n = len(prompt)
    token = prompt[-1]
    exits, drafts = [], []
    verify: list[list[float]] = [[] for _ in range(gamma + 1)]
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = backend.shallow([token], n)
        t1 = time.perf_counter()
        drafter.advance(prompt + [token], h)
        backend.shallow([token], n + 1)
        t2 = time.perf_counter()
        exits.append(t1 - t0)
        drafts.append(t2 - t1)
        backend.crop(n)
        drafter.crop(n)
        for k in range(gamma + 1):
            states = backend.shallow(prompt[-(k + 1):] if n >= k + 1 else [token] * (k + 1), n)
            t3 = time.perf_counter()
            backend.deep(states, n)
            verify[k].append(time.perf_counter() - t3)
            backend.crop(n)
    return Costs(statistics.median(exits), statistics.median(drafts), tuple(statistics.median(v) for v in verify))


@attrs.frozen
class AnswerRecord:
    """What the analysis keeps of one answer once its policies are simulated (the drafts' probs are dropped)."""

    subtask: str
    confidence: list[float]
    correct: list[bool]
    rounds: dict[str, list[RoundResult]]  # policy label -> replayed rounds


def threshold_label(eta: float) -> str:
    return f"threshold(eta={eta:g})"


def analyze_answer(answer: Answer, factories: dict[str, Callable[[Answer], StoppingPolicy]], gamma: int,
                   etas: Sequence[float] = ETA_GRID) -> AnswerRecord:
    """Simulate every policy and every threshold eta on one answer."""
    from kangaroo_policies.threshold import ThresholdPolicy

    rounds = {threshold_label(eta): simulate_policy(answer, ThresholdPolicy(eta=eta), gamma) for eta in etas}
    for label, factory in factories.items():
        rounds[label] = simulate_policy(answer, factory(answer), gamma)
    return AnswerRecord(answer.subtask, answer.confidence, answer.correct, rounds)


def _scopes(records: Sequence[AnswerRecord]) -> list[str]:
    return [*dict.fromkeys(r.subtask for r in records), "overall"]


def _pooled(records: Sequence[AnswerRecord], scope: str, label: str) -> list[RoundResult]:
    return [x for r in records if scope in ("overall", r.subtask) for x in r.rounds[label]]


def calibration(records: Sequence[AnswerRecord], bins: int = CALIBRATION_BINS) -> dict[str, Any]:
    """Per subtask (and overall): binned draft confidence vs the share of those drafts the target accepts, and the
    expected calibration error (count-weighted |confidence - acceptance| over the bins)."""
    out: dict[str, Any] = {}
    for scope in _scopes(records):
        pairs = [(c, ok) for r in records if scope in ("overall", r.subtask) for c, ok in zip(r.confidence, r.correct)]
        rows = []
        for b in range(bins):
            inside = [(c, ok) for c, ok in pairs if min(int(c * bins), bins - 1) == b]
            rows.append({"bin": [b / bins, (b + 1) / bins], "count": len(inside),
                         "mean_confidence": sum(c for c, _ in inside) / len(inside) if inside else None,
                         "acceptance_rate": sum(ok for _, ok in inside) / len(inside) if inside else None})
        n = len(pairs)
        ece = (sum(r["count"] / n * abs(r["mean_confidence"] - r["acceptance_rate"]) for r in rows if r["count"])
               if n else None)
        out[scope] = {"drafts": n, "acceptance_rate": sum(ok for _, ok in pairs) / n if n else None,
                      "mean_confidence": sum(c for c, _ in pairs) / n if n else None,
                      "expected_calibration_error": ece, "bins": rows}
    return out


def eta_curves(records: Sequence[AnswerRecord], costs: Costs, gamma: int,
               etas: Sequence[float] = ETA_GRID) -> dict[str, Any]:
    """Per subtask (and overall): simulated CR and predicted speedup of the threshold policy for every eta, and the
    eta with the best predicted speedup."""
    out: dict[str, Any] = {}
    for scope in _scopes(records):
        points = [{"eta": eta, **round_summary(_pooled(records, scope, threshold_label(eta)), costs, gamma)}
                  for eta in etas]
        best = max(points, key=lambda p: p["predicted_speedup"] or 0.0)
        out[scope] = {"points": points, "optimal_eta": best["eta"],
                      "optimal_predicted_speedup": best["predicted_speedup"]}
    return out


def compare_policies(records: Sequence[AnswerRecord], costs: Costs, gamma: int, labels: Sequence[str]) -> dict[str, Any]:
    """Simulated CR / CTAR / drafts per round / predicted speedup of each policy, per subtask and overall."""
    return {label: {scope: round_summary(_pooled(records, scope, label), costs, gamma) for scope in _scopes(records)}
            for label in labels}


def plot_calibration(data: dict[str, Any], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_n) = plt.subplots(2, 1, figsize=(7, 7), gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=0.8, label="perfectly calibrated")
    for name, entry in data.items():
        xs = [r["mean_confidence"] for r in entry["bins"] if r["count"]]
        ys = [r["acceptance_rate"] for r in entry["bins"] if r["count"]]
        style = {"color": "black", "linewidth": 2.5} if name == "overall" else {"linewidth": 1.2, "alpha": 0.8}
        ax.plot(xs, ys, marker="o", markersize=3, label=f"{name} (ECE {entry['expected_calibration_error']:.2f})",
                **style)
    overall = data["overall"]["bins"]
    ax_n.bar([(r["bin"][0] + r["bin"][1]) / 2 for r in overall], [r["count"] for r in overall], width=0.09,
             color="grey")
    ax.set(ylabel="acceptance rate (target agrees)", title="Draft confidence vs acceptance (teacher-forced, greedy)",
           xlim=(0, 1), ylim=(0, 1))
    ax_n.set(xlabel="draft top-1 probability (confidence)", ylabel="drafts")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_eta_curves(data: dict[str, Any], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cr, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    for name, entry in data.items():
        etas = [p["eta"] for p in entry["points"]]
        style = {"color": "black", "linewidth": 2.5} if name == "overall" else {"linewidth": 1.2, "alpha": 0.8}
        ax_cr.plot(etas, [p["cr"] or 0 for p in entry["points"]], label=name, **style)
        ax_speed.plot(etas, [p["predicted_speedup"] or 0 for p in entry["points"]],
                      label=f"{name} (best eta {entry['optimal_eta']:g})", **style)
    ax_cr.set(xlabel="eta", ylabel="CR (simulated, exact for greedy)")
    ax_speed.set(xlabel="eta", ylabel="predicted speedup vs target alone (cost model)")
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    for ax in (ax_cr, ax_speed):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the driver behind `kangaroo analyze-policies` ---------------------------------------------------------------------
def policy_factories(specs: Sequence[tuple[str, str, dict]], engine: Any) -> dict[str, Callable[[Answer], StoppingPolicy]]:
    """``(label, policy name, options)`` → factories. Policies are resolved and bound once; the oracle gets the
    answer it is replayed on as its reference (so it never runs the target again)."""
    from kangaroo_core.plugins import get_registry

    registry = get_registry()
    factories: dict[str, Callable[[Answer], StoppingPolicy]] = {}
    for label, name, options in specs:
        cls = registry.resolve("policy", name)
        if name == "oracle":
            def make(answer: Answer, cls=cls, options=options) -> StoppingPolicy:
                policy = cls.create(engine.config, **options, reference=list(answer.prompt_ids) + list(answer.answer))
                policy.bind(engine.backend)
                return policy
        else:
            policy = cls.create(engine.config, **options)
            policy.bind(engine.backend)

            def make(answer: Answer, policy=policy) -> StoppingPolicy:
                return policy
        factories[label] = make
    return factories


def target_answers(engine: Any, questions: Sequence[Any], *, max_new_tokens: int,
                   progress: bool = True) -> list[tuple[str, list[int], list[int]]]:
    """``(subtask, prompt ids, the target's greedy answer)`` for every question turn (a conversation goes on with the
    target's own answer): what every drafter is replayed on."""
    import sys

    from tqdm import tqdm

    from kangaroo_core.engine import Engine
    from kangaroo_policies.fixed import FixedPolicy

    alone = Engine(engine.backend, None, FixedPolicy(), engine.verifier, engine.config)
    turns: list[tuple[str, list[int], list[int]]] = []
    total = sum(len(q.turns) for q in questions)
    with tqdm(total=total, desc="target alone", unit="turn", file=sys.stderr, disable=not progress) as bar:
        for question in questions:
            history: list[dict[str, str]] = []
            for text in question.turns:
                messages = history + [{"role": "user", "content": text}]
                prompt = engine.encode(messages)
                answer = list(alone.generate_ids(prompt, max_new_tokens).token_ids)
                turns.append((question.subtask, prompt, answer))
                history = messages + [{"role": "assistant",
                                       "content": engine.backend.tokenizer.decode(answer, skip_special_tokens=True)}]
                bar.update(1)
    return turns


def run_analysis(engine: Any, questions: Sequence[Any], specs: Sequence[tuple[str, str, dict]], *, max_new_tokens: int,
                 progress: bool = True, etas: Sequence[float] = ETA_GRID,
                 answers: Sequence[tuple[str, list[int], list[int]]] | None = None) -> dict[str, Any]:
    """Answer every question turn with the target alone (or take ``answers`` from :func:`target_answers`), replay
    every policy on it, measure the costs."""
    import sys

    from tqdm import tqdm

    backend, drafter, gamma = engine.backend, engine.drafter, engine.config.gamma
    if drafter is None:
        raise ValueError("analyze-policies needs a drafter")
    if answers is None:
        answers = target_answers(engine, questions, max_new_tokens=max_new_tokens, progress=progress)
    factories = policy_factories(specs, engine)
    records: list[AnswerRecord] = []
    for subtask, prompt, answer in tqdm(answers, desc="replay", unit="turn", file=sys.stderr, disable=not progress):
        replay = replay_answer(backend, drafter, subtask, prompt, answer, gamma=gamma, max_new_tokens=max_new_tokens)
        records.append(analyze_answer(replay, factories, gamma, etas))
    costs = measure_costs(backend, drafter, answers[0][1] if answers else [0], gamma)
    return {
        "answers": len(records),
        "answer_tokens": sum(len(r.correct) + 1 for r in records),
        "gamma": gamma,
        # a drafter that reads deep states is replayed without the drafts that follow a rejected one (tools.replay)
        "drafted_exact": not drafter.wants_deep_states,
        "costs": costs.as_dict(),
        "calibration": calibration(records),
        "eta": eta_curves(records, costs, gamma, etas),
        "policies": compare_policies(records, costs, gamma, [label for label, _, _ in specs]),
    }


def drafters_markdown(results: dict[str, dict[str, Any]], info: dict[str, Any]) -> str:
    """Drafters side by side (``analyze-policies --adapters``): each one's CTAR(1..gamma) and CR under every replayed
    policy on the same target answers, and its measured draft step."""
    names = list(results)
    first = results[names[0]]["costs"]["t_draft"]
    lines = ["# kangaroo analyze-policies: drafters side by side", "", f"- command: `{info.get('command', '')}`",
             f"- answers: {results[names[0]]['answers']} question turns, the target's own greedy answers, replayed "
             "exactly for each drafter (teacher-forced: every round's drafts are what the drafter proposes there)"]
    rows = [[name, 1e3 * r["costs"]["t_draft"], r["costs"]["t_draft"] / first, r["costs"]["draft_cost_per_verify"]]
            for name, r in results.items()]
    lines += _table("Draft step (measured, median)", ["drafter", "ms", f"× {names[0]}", "in one-token verify passes"],
                    rows)
    gamma = results[names[0]]["gamma"]
    for label in results[names[0]]["policies"]:
        rows = []
        for name, r in results.items():
            o = r["policies"][label]["overall"]
            mark = "" if r["drafted_exact"] else " *"
            rows.append([name + mark, o["cr"], *(o["ctar"] or [None] * gamma), o["drafts_per_round"],
                         o["predicted_speedup"]])
        lines += _table(f"Policy `{label}`", ["drafter", "CR", *(f"CTAR({w})" for w in range(1, gamma + 1)),
                                             "drafts/round", "predicted speedup"], rows)
    lines += ["", "CTAR(w): share of rounds whose first w drafts were all accepted; under `fixed` every round drafts "
              "gamma tokens, so its CTAR is the drafter's own acceptance, free of any stopping rule."]
    if not all(r["drafted_exact"] for r in results.values()):
        lines += ["", "\\* " + PAST_A_REJECTION]
    return "\n".join(lines) + "\n"


def _table(title: str, header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown section: floats with 3 decimals, None as –, the first column left-aligned."""
    cell = lambda v: "–" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def analysis_markdown(result: dict[str, Any], info: dict[str, Any]) -> str:
    """A short human-readable summary (tables) of :func:`run_analysis`'s result."""
    lines = ["# kangaroo analyze-policies", "", f"- command: `{info.get('command', '')}`",
             f"- answers: {result['answers']} question turns, {result['answer_tokens']} answer tokens, gamma "
             f"{result['gamma']}"]
    c = result["costs"]
    lines.append(f"- measured costs: first exit {1e3 * c['t_exit']:.2f} ms, draft step {1e3 * c['t_draft']:.2f} ms, "
                 f"verify 1/{len(c['t_verify'])} positions {1e3 * c['t_verify'][0]:.2f}/{1e3 * c['t_verify'][-1]:.2f} ms "
                 f"(draft step = {c['draft_cost_per_verify']:.2f} verify; one more draft incl. its verify position = "
                 f"{c['marginal_draft_cost']:.2f} verify)")
    cal = [[scope, e["drafts"], e["mean_confidence"], e["acceptance_rate"], e["expected_calibration_error"]]
           for scope, e in result["calibration"].items()]
    lines += _table("Calibration (draft confidence vs acceptance)",
                    ["scope", "drafts", "mean confidence", "acceptance rate", "ECE"], cal)
    eta_rows = []
    for scope, e in result["eta"].items():
        best = next(p for p in e["points"] if p["eta"] == e["optimal_eta"])
        at06 = next((p for p in e["points"] if abs(p["eta"] - 0.6) < 1e-9), {})
        eta_rows.append([scope, f"{e['optimal_eta']:g}", best["predicted_speedup"], best["cr"],
                         at06.get("predicted_speedup")])
    lines += _table("Optimal eta (threshold policy, cost-model speedup)",
                    ["scope", "optimal eta", "predicted speedup there", "CR there", "predicted speedup at eta 0.6"],
                    eta_rows)
    policy_rows = []
    for label, scopes in result["policies"].items():
        o = scopes["overall"]
        ctar = (o["ctar"] or []) + [None, None]
        policy_rows.append([label, o["cr"], ctar[0], ctar[1], o["drafts_per_round"], o.get("wasted_drafts_per_round"),
                            o["predicted_speedup"]])
    lines += _table("Policies (simulated exactly on the target's greedy answers)",
                    ["policy", "CR", "CTAR(1)", "CTAR(2)", "drafts/round", "wasted drafts/round", "predicted speedup"],
                    policy_rows)
    if not result["drafted_exact"]:
        lines += ["", PAST_A_REJECTION]
    return "\n".join(lines) + "\n"


PAST_A_REJECTION = ("This drafter reads the target's deep states: its drafts after a rejected one are not replayed, so "
                    "drafts/round counts them as none (a lower bound) and the predicted speedup leaves their cost out "
                    "(an upper bound); CR and CTAR are exact.")
