"""Bench outputs: ``results.json``, ``results.md`` (a Spec-Bench-leaderboard-like table), PNG plots, sweep files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kangaroo_apps.bench.harness import CTAR_WINDOWS, REFERENCE

SUBTASK_TITLES = {"mt_bench": "MT-bench", "translation": "Translation", "summarization": "Summarization", "qa": "QA",
                  "math_reasoning": "Math", "rag": "RAG"}


def _title(subtask: str) -> str:
    return SUBTASK_TITLES.get(subtask, subtask)


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _yes(value: bool | None) -> str:
    return "n/a" if value is None else "yes" if value else "**NO**"


def _identical(overall: dict[str, Any]) -> str:
    """"yes" / "**NO** (k of n turns)" / "n/a": identical to the reference, and how often where not always."""
    if overall["identical_to_vanilla"] is False and overall.get("identical_turns") is not None:
        return f"**NO** ({overall['identical_turns']} of {overall['runs']} turns)"
    return _yes(overall["identical_to_vanilla"])


def _baseline(summary: dict[str, Any]) -> str:
    """The method the speedups are relative to."""
    return summary.get("baseline", REFERENCE)


def write_json(path: Path, payload: Any) -> Path:
    """Write atomically (temp file + rename): an interrupted save never leaves half a results file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def results_markdown(summary: dict[str, Any], subtasks: list[str], info: dict[str, Any]) -> str:
    methods, speedup = summary["methods"], summary["speedup"]
    lines = ["# kangaroo bench results", ""]
    lines.append(f"- command: `{info.get('command', '')}`")
    for key in ("date", "model", "questions", "questions_per_subtask", "max_new_tokens", "repeats", "config",
                "torch_threads", "cpu"):
        if key in info:
            lines.append(f"- {key.replace('_', ' ')}: {info[key]}")
    for label, line in info.get("builds", {}).items():
        lines.append(f"- {label} build: {line}")
    lines += ["", f"## Speedup vs `{_baseline(summary)}` (Spec-Bench leaderboard layout)", ""]
    header = ["Method", *(_title(s) for s in subtasks), "#Mean accepted tokens", "Overall", "Identical to vanilla"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 2) + ["---"]) + "|")
    for label, entry in methods.items():
        if entry["error"]:
            lines.append(f"| {label} | " + " | ".join(["error"] * (len(header) - 1)) + " |")
            continue
        cells = [_fmt(speedup[label][s], ".2f", "×") for s in subtasks]
        overall = entry["overall"]
        cells += [_fmt(overall["mean_accepted_tokens"]), f"**{_fmt(speedup[label]['overall'], '.2f', '×')}**",
                  _yes(overall["identical_to_vanilla"])]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## Details (overall)", ""]
    header = ["Method", "new tokens", "seconds", "tokens/s", "CR", f"CTAR(1..{CTAR_WINDOWS})", "drafts/round",
              "ms / draft", "draft / verify time", "identical", "= its target alone"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 2) + ["---"]) + "|")
    for label, entry in methods.items():
        o = entry["overall"]
        ctar = " ".join(f"{c:.2f}" for c in o["ctar"]) if o["ctar"] else "–"
        split = (f"{100 * o['draft_share']:.0f}% / {100 * o['verify_share']:.0f}%" if o["draft_share"] is not None
                 else "–")
        lines.append(f"| {label} | {o['new_tokens']} | {_fmt(o['seconds'])} | {_fmt(o['tokens_per_second'], '.1f')} | "
                     f"{_fmt(o['mean_accepted_tokens'])} | {ctar} | {_fmt(o['mean_drafted'])} | "
                     f"{_fmt(o.get('draft_ms'))} | {split} | "
                     f"{_identical(o)} | {_yes(o.get('identical_to_target_alone'))} |")
    lines += ["", "CR: mean tokens emitted per full target (verification) pass; for the transformers methods, new tokens "
              "per full-depth forward pass (prefill included). CTAR(w): share of verify rounds whose first w drafts "
              "were all accepted. ms / draft: the drafter's time in the loop per drafted token (M[:l], the "
              "adapter and its head; catch-up steps included). Draft / verify time: share of the decode loop spent drafting vs verifying. "
              "= its target alone: every turn equals the same backend's target alone (a method whose `target_alone` "
              "ran too; lossless by construction even where that backend differs from transformers by design)."]
    errors = {label: e["error"] for label, e in methods.items() if e["error"]}
    if errors:
        lines += ["", "## Errors", ""] + [f"- `{label}`: {error}" for label, error in errors.items()]
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ctar(summary: dict[str, Any], subtasks: list[str], path: Path) -> Path:
    plt = _pyplot()
    scopes = [*subtasks, "overall"]
    cols = min(4, len(scopes))
    rows = (len(scopes) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False, sharey=True)
    windows = list(range(1, CTAR_WINDOWS + 1))
    for ax, scope in zip(axes.flat, scopes):
        for label, entry in summary["methods"].items():
            m = entry["overall"] if scope == "overall" else entry["per_subtask"].get(scope, {})
            if m and m.get("ctar") and (m.get("mean_drafted") or 0) > 0:
                ax.plot(windows, m["ctar"], marker="o", label=label)
        ax.set_title(_title(scope))
        ax.set_xlabel("window w")
        ax.set_ylim(0, 1.02)
        ax.set_xticks(windows)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(scopes):]:
        ax.axis("off")
    axes[0][0].set_ylabel("CTAR(w)")
    handles, labels = axes.flat[len(scopes) - 1].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize="small")
    fig.suptitle("Consistent token acceptance rate per subtask")
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speedup(summary: dict[str, Any], subtasks: list[str], path: Path) -> Path:
    plt = _pyplot()
    scopes = [*subtasks, "overall"]
    labels = [label for label, e in summary["methods"].items() if not e["error"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(scopes) + 2) + 2.2, 4.0))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        values = [summary["speedup"][label].get(s) or 0.0 for s in scopes]
        color = plt.get_cmap("tab20")(i % 20) if len(labels) > 10 else None  # the default cycle repeats after 10
        ax.bar([x + i * width - 0.4 + width / 2 for x in range(len(scopes))], values, width, label=label, color=color)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(scopes)))
    ax.set_xticklabels([_title(s) for s in scopes])
    ax.set_ylabel(f"speedup vs {_baseline(summary)} (tokens/s ratio)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_sweep(out: Path, summary: dict[str, Any], points: list[dict[str, Any]]) -> list[Path]:
    """eta × gamma sweep (paper Fig. 3b): ``sweep.json`` + ``sweep_eta_gamma.png`` (CR and speedup vs eta per gamma)."""
    rows = []
    for p in points:
        overall = summary["methods"][p["label"]]
        rows.append({**p, "mean_accepted_tokens": overall["overall"]["mean_accepted_tokens"],
                     "tokens_per_second": overall["overall"]["tokens_per_second"],
                     "ctar": overall["overall"]["ctar"], "speedup": summary["speedup"][p["label"]]["overall"],
                     "error": overall["error"]})
    json_path = write_json(out / "sweep.json", {"points": rows})
    plt = _pyplot()
    fig, (ax_cr, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    for gamma in sorted({r["gamma"] for r in rows}):
        mine = sorted((r for r in rows if r["gamma"] == gamma), key=lambda r: r["eta"])
        etas = [r["eta"] for r in mine]
        ax_cr.plot(etas, [r["mean_accepted_tokens"] or 0 for r in mine], marker="o", label=f"γ={gamma}")
        ax_speed.plot(etas, [r["speedup"] or 0 for r in mine], marker="o", label=f"γ={gamma}")
    ax_cr.set(xlabel="eta (second early exit threshold)", ylabel="CR (mean accepted tokens per verify)")
    ax_speed.set(xlabel="eta (second early exit threshold)", ylabel=f"speedup vs {_baseline(summary)}")
    for ax in (ax_cr, ax_speed):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    png = out / "sweep_eta_gamma.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [json_path, png]


def write_adapters(out: Path, summary: dict[str, Any], points: list[dict[str, Any]]) -> list[Path]:
    """Adapter comparison (paper Fig. 3a exit layers, Table 2 variants): ``adapters.json`` + ``adapters.png``."""
    rows = []
    for p in points:
        entry = summary["methods"][p["label"]]
        rows.append({**p, "mean_accepted_tokens": entry["overall"]["mean_accepted_tokens"],
                     "tokens_per_second": entry["overall"]["tokens_per_second"], "ctar": entry["overall"]["ctar"],
                     "speedup": summary["speedup"][p["label"]]["overall"], "error": entry["error"]})
    json_path = write_json(out / "adapters.json", {"adapters": rows})
    plt = _pyplot()
    fig, (ax_cr, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    several = len({r.get("method") for r in rows}) > 1
    names = [(f"{r['method']}\n" if several else "") + f"{r['name']}\nl={r['exit_layer']}" for r in rows]
    ax_cr.bar(names, [r["mean_accepted_tokens"] or 0 for r in rows])
    ax_speed.bar(names, [r["speedup"] or 0 for r in rows])
    ax_cr.set_ylabel("CR (mean accepted tokens per verify)")
    ax_speed.set_ylabel(f"speedup vs {_baseline(summary)}")
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    fig.tight_layout()
    png = out / "adapters.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [json_path, png]


def write_outputs(out: Path, summary: dict[str, Any], subtasks: list[str], info: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    payload = {**summary, "subtasks": subtasks, "reference": REFERENCE, "run": info}
    files = [write_json(out / "results.json", payload)]
    md = out / "results.md"
    md.write_text(results_markdown(summary, subtasks, info))
    files.append(md)
    files.append(plot_ctar(summary, subtasks, out / "ctar.png"))
    files.append(plot_speedup(summary, subtasks, out / "speedup.png"))
    return files


def plot_curves(curves, path) -> None:
    """One line per curve: t(n) / t(1) against n, with the 1.0 and 1.2 lines a verify pass should stay near."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for curve in curves:
        rel = curve.relative
        ax.plot(list(rel), list(rel.values()), marker="o",
                label=f"{curve.backend} ({curve.kernels}), t(1) = {curve.verify_ms[0]:.1f} ms")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.2, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("new positions per pass")
    ax.set_ylabel("time / one-position pass")
    ax.set_title(f"verify cost, {curves[0].threads} thread(s), {curves[0].context}-token context")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
