"""The cross-architecture table and plot: per model and exit layer, held-out agreement and simulated CR (training
reports), draft-step cost over a full forward (:mod:`kangaroo_apps.studies.exit_layer_costs`), CR and speedup on dev
questions (a ``kangaroo bench --adapters`` run)::

    python -m kangaroo_apps.studies.architecture_report --out DIR \\
        --model "SmolLM2-135M" SWEEP_DIR_PREFIX COSTS.json BENCH_DIR \\
        --model "Gemma 3 270M" SWEEP_DIR_PREFIX COSTS.json BENCH_DIR

``SWEEP_DIR_PREFIX`` + ``1..4`` are the sweep's adapter directories (each with ``training_report.json``).
Writes ``architectures.json``, ``architectures.txt`` (a Markdown table) and ``architectures.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import click


def rows_for(name: str, prefix: str, costs_file: str, bench_dir: str) -> list[dict]:
    costs = {row["exit_layer"]: row for row in json.loads(Path(costs_file).read_text())["rows"]
             if Path(row["adapter"]).name.startswith(Path(prefix).name)}
    bench = json.loads((Path(bench_dir) / "adapters.json").read_text())["adapters"]
    by_layer = {row["exit_layer"]: row for row in bench}
    rows = []
    for layer in sorted(costs):
        report = json.loads((Path(f"{prefix}{layer}") / "training_report.json").read_text())
        last = report["history"][-1]
        measured = by_layer.get(layer, {})
        rows.append({
            "model": name, "exit_layer": layer, "layers": costs[layer]["layers"],
            "train_prompts": report["data"]["train_prompts"], "train_answer_tokens": report["data"]["train_response_tokens"],
            "heldout_top1": round(last["top1_agreement"], 3), "simulated_cr": round(last["cr"], 3),
            "draft_over_forward": costs[layer]["draft_over_forward"], "forward_ms": costs[layer]["forward_ms"],
            "draft_step_ms": costs[layer]["draft_step_ms"],
            "dev_cr": measured.get("mean_accepted_tokens"), "dev_speedup": measured.get("speedup"),
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | exit layer l | held-out top-1 | simulated CR | draft step / forward | dev CR | dev speedup |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cr = "–" if r["dev_cr"] is None else f"{r['dev_cr']:.2f}"
        speed = "–" if r["dev_speedup"] is None else f"{r['dev_speedup']:.2f}×"
        lines.append(f"| {r['model']} | {r['exit_layer']} of {r['layers']} | {r['heldout_top1']:.3f} | "
                     f"{r['simulated_cr']:.2f} | {r['draft_over_forward']:.2f} ({r['draft_step_ms']:.1f} / "
                     f"{r['forward_ms']:.1f} ms) | {cr} | {speed} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        layers = [r["exit_layer"] for r in mine]
        axes[0].plot(layers, [r["heldout_top1"] for r in mine], marker="o", label=model)
        axes[1].plot(layers, [r["draft_over_forward"] for r in mine], marker="o", label=model)
        axes[2].plot(layers, [r["dev_speedup"] or 0 for r in mine], marker="o", label=model)
    for ax, title in zip(axes, ("held-out top-1 agreement", "draft step / full forward", "dev speedup vs hf_vanilla")):
        ax.set_xlabel("exit layer l")
        ax.set_title(title)
        ax.set_xticks(sorted({r["exit_layer"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[2].axhline(1.0, color="black", linewidth=0.8)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command()
@click.option("--out", "out_dir", required=True)
@click.option("--model", "models", type=(str, str, str, str), multiple=True, required=True,
              help="NAME SWEEP_DIR_PREFIX COSTS_JSON BENCH_DIR (repeatable).")
def main(out_dir, models) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [row for spec in models for row in rows_for(*spec)]
    (out / "architectures.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    (out / "architectures.txt").write_text(table(rows))
    plot(rows, out / "architectures.png")
    click.echo(table(rows))


if __name__ == "__main__":
    main()
