"""Draft-step cost against a full forward, per exit layer: the cost side of an exit-layer sweep.

For each adapter (one per exit layer, e.g. the sweep's), the model is split at the adapter's layer (weights shared),
the Kangaroo drafter binds it, and :func:`~kangaroo_policies.cost_model.measure_costs` times, after a 300-token
context, one full forward of one position (M[:l] + M[l:] + the head) and one draft step (M[:l] + adapter + draft
head), interleaved over repeats, medians::

    python -m kangaroo_apps.studies.exit_layer_costs --model gemma3-270m --threads 2 --out costs.json ADAPTER_DIR...
"""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("adapters", nargs=-1, required=True)
@click.option("--model", default=None, help="Model (short name, GGUF file or HF directory; default SmolLM2).")
@click.option("--threads", type=int, default=None, help="torch threads.")
@click.option("--repeats", type=int, default=15, show_default=True)
@click.option("--context", type=int, default=300, show_default=True, help="Positions in the cache before the timed pass.")
@click.option("--out", "out_file", default=None, help="Write the rows as JSON here.")
def main(adapters, model, threads, repeats, context, out_file) -> None:
    from kangaroo_policies.cost_model import measure_costs
    from kangaroo_apps.cli_options import EngineOptions
    from kangaroo_plugins.kangaroo.drafter import KangarooDrafter, adapter_exit_layer

    backend = EngineOptions(model=model, threads=threads).backend(vanilla=True)
    rows = []
    for path in adapters:
        layer = adapter_exit_layer(path)
        if layer is None:
            raise click.BadParameter(f"{path} is not an adapter directory")
        split = backend.resplit(layer) if layer != backend.exit_layer else backend
        drafter = KangarooDrafter(adapter=path)
        drafter.bind(split)
        curve = measure_costs(split, drafter, context=context, positions=(1,), repeats=repeats)
        row = {"adapter": str(path), "exit_layer": layer, "layers": split.num_layers,
               "forward_ms": round(curve.verify_ms[0], 2), "draft_step_ms": round(curve.draft_step_ms, 2),
               "draft_over_forward": round(curve.draft_step_ms / curve.verify_ms[0], 3), "threads": curve.threads,
               "context": context}
        rows.append(row)
        click.echo(f"l={layer}: forward {row['forward_ms']:.1f} ms, draft step {row['draft_step_ms']:.1f} ms "
                   f"({row['draft_over_forward']:.2f} of a forward)")
    if out_file:
        Path(out_file).write_text(json.dumps({"model": backend.model_name, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
