"""Draw one drafted token tree and the path the target accepted (docs/images/tree-round.png).

    python -m kangaroo_apps.studies.tree_picture --out docs/images/tree-round.png -- --threads 2

Runs the engine with ``--tree dynamic`` (engine flags after ``--``) on a prompt, records every round's verify tree
and verdict, and draws the round with the most branching among those that accepted at least two drafts: nodes are
the drafted tokens (row 0 is x_n), green ones form the accepted path, the dashed box the target's own next token.
"""

from __future__ import annotations

import click


def draw(view, verdict, tokenizer, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    children = view.children
    depth = {0: 0}
    for r in range(1, len(view.tokens)):
        depth[r] = depth[view.parents[r]] + 1
    # leaves get consecutive slots; a parent sits above the middle of its children
    y: dict[int, float] = {}
    counter = [0]

    def place(r):
        if not children[r]:
            y[r] = counter[0]
            counter[0] += 1
        else:
            for c in children[r]:
                place(c)
            y[r] = sum(y[c] for c in children[r]) / len(children[r])

    place(0)
    accepted = {0, *[p + 1 for p in verdict.path]}
    fig, ax = plt.subplots(figsize=(2.2 * (max(depth.values()) + 2), 0.75 * max(counter[0], 2) + 1))
    label = lambda r: repr(tokenizer.decode([view.tokens[r]]))  # noqa: E731
    for r in range(1, len(view.tokens)):
        p = view.parents[r]
        ax.plot([depth[p], depth[r]], [y[p], y[r]], color="#3c8d2f" if r in accepted and p in accepted else "#bbb",
                lw=2.5 if r in accepted else 1, zorder=1)
    for r in range(len(view.tokens)):
        face = "#d9f2d0" if r in accepted else "#f2f2f2"
        ax.text(depth[r], y[r], label(r) if r else f"x_n = {label(r)}", ha="center", va="center", fontsize=10,
                bbox=dict(boxstyle="round,pad=0.35", fc=face, ec="#3c8d2f" if r in accepted else "#999"), zorder=2)
    last = max(accepted, key=lambda r: depth[r])
    ax.plot([depth[last], depth[last] + 1], [y[last], y[last]], color="#2f5bd3", lw=1.5, ls="--", zorder=1)
    ax.text(depth[last] + 1, y[last], f"target: {tokenizer.decode([verdict.next_token])!r}", ha="center", va="center",
            fontsize=10, bbox=dict(boxstyle="round,pad=0.35", fc="white", ec="#2f5bd3", ls="--"), zorder=2)
    ax.set_xlim(-0.7, max(depth.values()) + 1.7)
    ax.set_ylim(counter[0] - 0.3, -0.7)
    ax.set_xticks(range(max(depth.values()) + 1))
    ax.set_xticklabels(["root"] + [f"depth {d}" for d in range(1, max(depth.values()) + 1)])
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--prompt", default="Explain in three sentences why the sky is blue.", show_default=True)
@click.option("--max-new-tokens", type=int, default=96, show_default=True)
@click.option("--out", default="docs/images/tree-round.png", show_default=True)
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
def main(prompt, max_new_tokens, out, engine_args) -> None:
    from kangaroo_apps.cli_options import EngineOptions

    engine = EngineOptions.from_args(["--tree", "dynamic", "--max-new-tokens", str(max_new_tokens),
                                      *engine_args]).engine()
    rounds = []
    verify_tree = engine.verifier.verify_tree

    def recording(view, logits):
        verdict = verify_tree(view, logits)
        rounds.append((view, verdict))
        return verdict

    engine.verifier.verify_tree = recording
    result = engine.generate(prompt)
    good = [(v, d) for v, d in rounds if d.accepted >= 2] or rounds
    view, verdict = max(good, key=lambda vd: (sum(len(c) > 1 for c in vd[0].children), len(vd[0].tokens)))
    title = (f"one round of --tree dynamic (budget {engine.tree.budget}, topk {engine.tree.topk}): "
             f"{len(view.tokens) - 1} drafted nodes, {verdict.accepted} accepted + the target's token")
    draw(view, verdict, engine.backend.tokenizer, out, title)
    click.echo(f"wrote {out} (generation CR {result.mean_accepted_tokens:.2f})")


if __name__ == "__main__":
    main()
