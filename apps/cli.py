"""The ``kangaroo`` command line: ``generate``, ``bench``, ``serve``, ``plugins`` and the training / export commands.

User errors print one line to stderr (``kangaroo: error: ...``) and exit 1 (2 for bad usage); no traceback.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
from pathlib import Path

import attrs
import click

from kangaroo_core.config import DEFAULT_DRAFTER, DEFAULT_EXIT_LAYER
from kangaroo_apps.cli_options import (SHIPPED_CORPUS, SHIPPED_PROMPTS, SHIPPED_QUESTIONS, EngineCommand,
                                       EngineOptions, check_device, check_out_dir, check_ray_pool_options,
                                       device_option, engine_options, model_options, parse_key_values,
                                       ray_pool_options, set_threads)
from kangaroo_core.errors import KangarooError, UsageError


def _eprint(message: str) -> None:
    click.echo(message, err=True)


def format_stats(result, label: str = "kangaroo") -> str:
    ctar = " ".join(f"{c:.2f}" for c in result.ctar)
    busy = result.draft_seconds + result.verify_seconds
    split = f" · draft {100 * result.draft_seconds / busy:.0f}% / verify {100 * result.verify_seconds / busy:.0f}%" if busy else ""
    return (
        f"[{label}] {result.new_tokens} tokens in {result.seconds:.2f} s ({result.tokens_per_second:.1f} tok/s)"
        f" · {result.num_rounds} verify passes · mean accepted tokens per verify (CR) {result.mean_accepted_tokens:.2f}"
        f" · mean drafts/round {result.mean_drafted:.2f} · CTAR(1..{result.gamma}) {ctar}{split}"
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kangaroo-decoding", prog_name="kangaroo")
def cli() -> None:
    """Lossless self-speculative decoding (Kangaroo: double early exiting)."""


@cli.command(cls=EngineCommand)
@click.argument("prompt", required=False)
@engine_options
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None, metavar="FILE.jsonl",
              help='Answer every prompt of FILE.jsonl (one {"id", "prompt"} object per line) instead of PROMPT, in '
                   "input order; with --json one JSON line per answer.")
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True,
              help="--prompts: decode this many prompts together (continuous batching; each answer is what the "
                   "prompt gets alone).")
@click.option("--vanilla", is_flag=True, help="Run the target model alone (no drafting), for comparison.")
@click.option("--compare", is_flag=True, help="Run the target alone, then Kangaroo, and print both speeds side by side.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="--compare: time this many interleaved pairs (target alone, Kangaroo) and report the medians; "
                   "one short generation on a busy machine is mostly noise.")
@click.option("--no-chat", is_flag=True, help="Use the prompt as raw text (no chat template).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate(prompt, opts: EngineOptions, prompts_file, batch, vanilla, compare, repeats, no_chat, as_json) -> None:
    """Generate a continuation of PROMPT, streaming text as drafts are accepted (or answer a --prompts file)."""
    if vanilla and compare:
        raise click.UsageError("--vanilla and --compare exclude each other")
    if (prompt is None) == (prompts_file is None):
        raise click.UsageError("give a PROMPT or --prompts FILE.jsonl (one of them)")
    if prompts_file is not None:
        if compare:
            raise click.UsageError("--compare applies to a single PROMPT")
        from kangaroo_apps.prompts_file import answer_file, read_prompts

        prompts = read_prompts(prompts_file)
        totals = answer_file(opts.engine(vanilla=vanilla), prompts, batch=batch, chat=not no_chat, as_json=as_json)
        _eprint(f"[{'vanilla' if vanilla else 'kangaroo'}] {totals['answers']} answers, {totals['new_tokens']} tokens "
                f"in {totals['seconds']:.1f} s: {totals['tokens_per_second']:.1f} tok/s aggregate, "
                f"{totals['streams_per_pass']:.2f} streams per pass")
        return
    check_text(prompt, "the prompt")
    if not prompt.strip():
        raise KangarooError("the prompt is empty")
    if repeats > 1 and not compare:
        raise click.UsageError("--repeats applies to --compare")
    engine = opts.engine(vanilla=vanilla)
    chat = not no_chat
    if compare:
        _compare(engine, prompt, chat, as_json, repeats)
        return
    label = "vanilla" if vanilla else "kangaroo"
    if as_json:
        result = engine.generate(prompt, chat=chat)
        click.echo(json.dumps({"method": label, "model": engine.backend.model_name, **result.to_dict()}))
        return
    result = stream_to_stdout(engine.stream(prompt, chat=chat))
    _eprint(format_stats(result, label))


def check_text(text: str, what: str) -> None:
    """A command-line string that is not valid UTF-8 (the shell passed raw bytes) is refused in one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise KangarooError(f"{what} is not valid UTF-8") from None


def stream_to_stdout(stream):
    """Print the pieces as they come; a closed pipe (``| head``) stops the printing, not the generation, so the
    stats line and the exit status stay right."""
    writing = True
    for piece in stream:
        if not writing:
            continue
        try:
            click.echo(piece, nl=False)
            sys.stdout.flush()
        except BrokenPipeError:
            writing = False
            _silence_stdout()
    if writing:
        try:
            click.echo()
            sys.stdout.flush()
        except BrokenPipeError:
            _silence_stdout()
    return stream.result


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again on the closed pipe."""
    try:
        fileno = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (e.g. captured): nothing will be flushed
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    os.close(devnull)


def _compare(engine, prompt: str, chat: bool, as_json: bool, repeats: int = 1) -> None:
    """The target alone, then Kangaroo (streamed), on the same backend; with ``repeats`` > 1 more pairs, interleaved
    so that a drift of the machine's speed hits both sides, and the medians reported."""
    from kangaroo_core.engine import Engine

    target_alone = Engine(engine.backend, None, engine.policy, engine.verifier, engine.config)
    engine.generate("Hello", chat=chat, max_new_tokens=4)  # warm-up: first calls pay one-off allocation costs
    # both sides are timed by the engine's own clock, which stops while the consumer prints
    baselines = [target_alone.generate(prompt, chat=chat)]
    if not as_json:
        _eprint(format_stats(baselines[0], "vanilla "))
        results = [stream_to_stdout(engine.stream(prompt, chat=chat))]
    else:
        results = [engine.generate(prompt, chat=chat)]
    for _ in range(repeats - 1):
        baselines.append(target_alone.generate(prompt, chat=chat))
        results.append(engine.generate(prompt, chat=chat))
    greedy = engine.config.sampling.greedy
    identical = all(r.token_ids == b.token_ids for r, b in zip(results, baselines)) if greedy else None
    vanilla_speed = statistics.median(b.tokens_per_second for b in baselines)
    kangaroo_speed = statistics.median(r.tokens_per_second for r in results)
    speedup = kangaroo_speed / vanilla_speed if vanilla_speed else 0.0
    pairs = [r.tokens_per_second / b.tokens_per_second for r, b in zip(results, baselines) if b.tokens_per_second]
    if as_json:
        click.echo(json.dumps({"vanilla": baselines[0].to_dict(), "kangaroo": results[0].to_dict(), "speedup": speedup,
                               "repeats": repeats, "vanilla_tokens_per_second": [b.tokens_per_second for b in baselines],
                               "kangaroo_tokens_per_second": [r.tokens_per_second for r in results],
                               "identical_to_vanilla": identical}))
        return
    _eprint(format_stats(results[0], "kangaroo"))
    same = "n/a (sampling: same distribution, not the same draws)" if identical is None else "yes" if identical else "NO"
    if repeats == 1:
        _eprint(f"[compare] speedup {speedup:.2f}x vs vanilla · output identical to vanilla: {same}")
        return
    _eprint(f"[compare] median of {repeats} interleaved runs: vanilla {vanilla_speed:.1f} tok/s, kangaroo "
            f"{kangaroo_speed:.1f} tok/s · speedup {speedup:.2f}x vs vanilla (pairs {min(pairs):.2f}x-{max(pairs):.2f}x)"
            f" · output identical to vanilla{' on every run' if greedy else ''}: {same}")

_argv: list[str] = []


def _float_list(text: str | None, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()] if text else []
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated numbers, got {text!r}") from None


def _int_list(text: str | None, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()] if text else []
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers, got {text!r}") from None


def _drafting_methods(methods: list[str]) -> list[str]:
    """The drafting methods among ``methods`` (registered names), else ``kangaroo``: the columns ``--policies`` and
    ``--adapters`` vary."""
    from kangaroo_core.plugins import get_registry
    from kangaroo_plugins.bench_methods import KangarooMethod

    registry = get_registry()
    return [m for m in methods if issubclass(registry.resolve("bench_method", m), KangarooMethod)] or ["kangaroo"]


def _adapter_specs(text: str | None, methods: list[str]):
    """``--adapters`` of ``kangaroo bench``: one column per adapter for each drafting method among ``methods``."""
    from pathlib import Path

    from kangaroo_apps.bench.harness import MethodSpec
    from kangaroo_core.errors import BenchError
    from kangaroo_core.files import read_json

    specs, points = [], []
    drafting = _drafting_methods(methods)
    for raw in [x.strip() for x in (text or "").split(",") if x.strip()]:
        path = Path(raw).expanduser()
        meta_path = path / "adapter.json"
        meta = read_json(meta_path, BenchError, f"--adapters: {meta_path}")
        if not isinstance(meta, dict) or not isinstance(meta.get("exit_layer"), int):
            raise BenchError(f"--adapters: {meta_path} has no integer exit_layer")
        name = path.name or str(path)
        arch = meta.get("architecture") or {}
        for method in drafting:
            label = f"{method}[adapter={name}]"
            if any(s.label == label for s in specs):
                label = f"{method}[adapter={path}]"
            specs.append(MethodSpec(label, method, {"adapter": str(path), "exit_layer": meta["exit_layer"]}))
            points.append({"label": label, "method": method, "name": name, "path": str(path),
                           "exit_layer": meta["exit_layer"], "ffn": arch.get("ffn"),
                           "separate_head": arch.get("separate_head")})
    return specs, points


def parse_policy_list(text: str | None, flag: str = "--policies") -> list[tuple[str, str, dict]]:
    """``fixed,threshold,learned:predictor=DIR:draft_cost=0.2`` → ``(label, policy name, options)`` per item."""
    from kangaroo_core.plugins import get_registry

    items = []
    known = get_registry().names("policy")
    for raw in [x.strip() for x in (text or "").split(",") if x.strip()]:
        name, *pairs = raw.split(":")
        if name not in known:
            raise UsageError(f"{flag}: unknown policy {name!r}; known policies: {', '.join(known)}")
        items.append((raw, name, parse_key_values(pairs, f"{flag} ({name})")))
    return items


def _policy_specs(text: str | None, methods: list[str]):
    """``--policies`` of ``kangaroo bench``: one column per policy for each drafting method among ``methods`` (the
    names ``--methods`` gave), else for ``kangaroo``."""
    from kangaroo_apps.bench.harness import MethodSpec

    return [MethodSpec(f"{method}[policy={label}]", method, {"policy": name, "policy_options": options})
            for method in _drafting_methods(methods) for label, name, options in parse_policy_list(text)]


@cli.command(cls=EngineCommand)
@click.option("--questions", "questions_file", **SHIPPED_QUESTIONS,
              help="Spec-Bench-format JSONL (question_id, turns, subtask or category).")
@click.option("--out", "out_dir", default="bench-results", show_default=True, help="Output directory.")
@click.option("--methods", default=None,
              help="Comma-separated bench methods (default: every registered one; hf_vanilla is always measured).")
@click.option("--limit-per-subtask", type=int, default=None, help="Only the first K questions of each subtask.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Run every question R times.")
@click.option("--no-warmup", is_flag=True, help="Skip the uncounted warm-up generation of each method.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--sweep-eta", default=None, help="Comma-separated eta values: one kangaroo variant per (eta, gamma).")
@click.option("--sweep-gamma", default=None, help="Comma-separated gamma values for the sweep (default: --gamma).")
@click.option("--adapters", default=None,
              help="Comma-separated adapter directories to compare, each at the exit layer in its adapter.json: one "
                   "column each for every drafting method among --methods (else for kangaroo).")
@click.option("--policies", default=None,
              help="Comma-separated stopping policies to compare, one kangaroo column each; options as "
                   "NAME:KEY=VALUE[:KEY=VALUE], e.g. learned:predictor=DIR.")
@click.option("--tree-budgets", default=None,
              help="Comma-separated tree node budgets: one kangaroo_tree column each (dynamic tree; --tree-topk / "
                   "--tree-depth apply), next to the chain; one kangaroo_onnx_tree column each too when "
                   "kangaroo_onnx_tree is among --methods. The tree methods use the --tree NAME shaper (default "
                   "dynamic).")
@click.option("--baseline", default="hf_vanilla", show_default=True,
              help="Method label the speedups are relative to (identity is always checked against hf_vanilla).")
@click.option("--concurrency", default=None, metavar="N[,N...]",
              help="Instead of the method table: the target alone and Kangaroo (one per --policies item, if given) "
                   "with N streams decoding together (e.g. 1,2,4,8): aggregate tok/s, per-token latency, CR, "
                   "identity per stream (concurrency.json, concurrency.md).")
@engine_options
def bench(questions_file, out_dir, methods, limit_per_subtask, repeats, no_warmup, no_progress, sweep_eta, sweep_gamma,
          adapters, policies, tree_budgets, baseline, concurrency, opts: EngineOptions) -> None:
    """Benchmark every method on Spec-Bench questions: results.json, results.md, plots in --out."""
    import datetime

    from kangaroo_apps.bench.questions import load_questions
    from kangaroo_core.machine import cpu_description, cpu_line

    out = check_out_dir(out_dir)
    questions = load_questions(questions_file, limit_per_subtask)  # a bad file: refused before anything loads
    if concurrency is not None:
        levels = _int_list(concurrency, "--concurrency")
        if not levels or min(levels) < 1:
            raise UsageError("--concurrency takes stream counts >= 1, e.g. 1,2,4,8")
        _bench_concurrency(opts, questions, levels, out, not no_progress, policies)
        return

    import torch

    from kangaroo_core.bench_context import BenchContext
    from kangaroo_apps.bench.harness import MethodSpec, build_methods, parse_methods, run_bench, summarize
    from kangaroo_apps.bench.report import write_adapters, write_outputs, write_sweep

    config = opts.config()
    eta, gamma, max_new_tokens = opts.eta, opts.gamma, opts.max_new_tokens
    etas, gammas = _float_list(sweep_eta, "--sweep-eta"), _int_list(sweep_gamma, "--sweep-gamma")
    sweeping = bool(etas or gammas)
    only_variants = methods is None and (sweeping or adapters or policies or tree_budgets)
    specs = parse_methods("hf_vanilla" if only_variants else methods)
    measured = [] if only_variants else [s.name for s in specs]
    adapter_specs, adapter_points = _adapter_specs(adapters, measured)
    policy_specs = _policy_specs(policies, measured)
    sweep_points = []
    if sweeping:
        for g in gammas or [gamma]:
            for e in etas or [eta]:
                config.replace(eta=e, gamma=g)  # validates
                label = f"kangaroo[eta={e:g},gamma={g}]"
                specs.append(MethodSpec(label, "kangaroo", {"eta": e, "gamma": g}))
                sweep_points.append({"label": label, "eta": e, "gamma": g})
    onnx_trees = "kangaroo_onnx_tree" in [s.name for s in specs]
    for budget in _int_list(tree_budgets, "--tree-budgets"):
        for name in ("kangaroo_tree", *(("kangaroo_onnx_tree",) if onnx_trees else ())):
            specs.append(MethodSpec(f"{name}[budget={budget}]", name, {"budget": budget}))
    specs += adapter_specs + policy_specs
    if baseline not in [s.label for s in specs]:
        raise UsageError(f"--baseline {baseline!r} is not one of the measured methods: {', '.join(s.label for s in specs)}")
    backend_obj = opts.backend()  # at the shipped adapter's layer unless --exit-layer says otherwise
    context = BenchContext(backend_obj, opts.spec())
    methods = build_methods(specs, context)
    run = run_bench(context, methods, questions, max_new_tokens=max_new_tokens, repeats=repeats,
                    warmup=not no_warmup, progress=not no_progress)
    summary = summarize(run, baseline)
    counts = {s: sum(q.subtask == s for q in questions) for s in run.subtasks}
    info = {
        "command": "kangaroo " + shlex.join(_argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": backend_obj.model_name,
        "questions": str(questions_file),
        "questions_per_subtask": counts,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "config": opts.summary(),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_line(),
        "cpu_details": cpu_description(),
    }
    builds = {label: method.build() for label, method in methods if label not in run.errors}
    if any(builds.values()):
        info["builds"] = {label: line for label, line in builds.items() if line}
    files = write_outputs(out, summary, run.subtasks, info)
    if sweep_points:
        files += write_sweep(out, summary, sweep_points)
    if adapter_points:
        files += write_adapters(out, summary, adapter_points)
    for label, entry in summary["methods"].items():
        if entry["error"]:
            _eprint(f"kangaroo: bench: {label} failed: {entry['error']}")
            continue
        o, speed = entry["overall"], summary["speedup"][label]["overall"]
        cr = "–" if o["mean_accepted_tokens"] is None else f"{o['mean_accepted_tokens']:.2f}"
        same = {None: "n/a", True: "yes", False: "NO"}[o["identical_to_vanilla"]]
        speed = "–" if speed is None else f"{speed:.2f}x"
        _eprint(f"[{label}] {o['tokens_per_second']:.1f} tok/s · speedup {speed} vs {baseline} · CR {cr} · identical {same}")
    click.echo(f"wrote {', '.join(str(f) for f in files)}")


def _bench_concurrency(opts: EngineOptions, questions, levels, out, progress: bool, policies: str | None) -> None:
    import datetime

    from kangaroo_core.machine import cpu_description, cpu_line

    import torch

    from kangaroo_apps.studies.concurrency import concurrency_table, markdown
    from kangaroo_core.engine import assemble

    variants = {f"kangaroo[policy={label}]": attrs.evolve(opts, policy=name, policy_options=tuple(label.split(":")[1:]))
                for label, name, _ in parse_policy_list(policies)} or {"kangaroo": opts}
    backend = opts.backend()
    engines = {"vanilla": assemble(opts.spec(vanilla=True), backend=backend),
               **{label: assemble(o.spec(), backend=backend) for label, o in variants.items()}}
    prompts = [engines["vanilla"].encode(q.turns[0]) for q in questions]
    rows = concurrency_table(engines, prompts, levels, opts.max_new_tokens, progress=progress)
    info = {"command": "kangaroo " + shlex.join(_argv), "model": backend.model_name, "questions": len(prompts),
            "max_new_tokens": opts.max_new_tokens, "threads": torch.get_num_threads(), "config": opts.summary(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_line(), "cpu_details": cpu_description()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrency.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1, default=str) + "\n")
    table = markdown(rows, info)
    (out / "concurrency.md").write_text(table)
    click.echo(table)
    click.echo(f"wrote {out / 'concurrency.json'}, {out / 'concurrency.md'}")


@cli.command(cls=EngineCommand)
@click.option("--questions", "questions_file", **SHIPPED_QUESTIONS,
              help="Spec-Bench-format questions: the first of each kind is asked (first turn).")
@click.option("--prompt", default=None, help="Ask this instead of the dev questions.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@engine_options
def demo(questions_file, prompt, no_progress, opts: EngineOptions) -> None:
    """Kangaroo next to transformers' greedy generate and the same engine's target alone, on one question of
    each kind: tokens/s, speedups, CR and the identity check, in about a minute."""
    from kangaroo_apps.bench.questions import demo_questions

    if prompt is not None:
        check_text(prompt, "the prompt")
        if not prompt.strip():
            raise KangarooError("the prompt is empty")
    questions = demo_questions(questions_file, prompt)  # a bad file: refused before anything loads

    from kangaroo_apps.demo import demo_failure, demo_table, run_demo

    summary = run_demo(opts, questions, progress=not no_progress)
    _eprint(f"kangaroo demo: {summary['model']}, {opts.max_new_tokens} new tokens per answer, greedy unless "
            "--temperature; speedups are tokens/s ratios measured side by side in this run")
    click.echo(demo_table(summary))
    failure = demo_failure(summary)
    if failure:
        _eprint(f"kangaroo demo: {failure}")
        raise SystemExit(1)


@cli.command("gpu-check")
@click.option("--device", default="cuda", show_default=True, metavar="cpu|cuda|cuda:N",
              help="Where to run; without CUDA, --device cuda fails at once (cpu: the same table on the CPU).")
@click.option("--dtypes", default="float32,bfloat16", show_default=True,
              help="Comma-separated model dtypes, one run each (the model loaded once per dtype).")
@click.option("--graphs", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="The torch backend's graphs option for our engine: on = static KV cache + passes captured as CUDA "
                   "graphs (run eagerly on the CPU); auto = on for CUDA, off on the CPU.")
@model_options
@click.option("--adapter", default=None,
              help="Adapter directory or shipped adapter name (default: the shipped adapter for this model, as for generate).")
@click.option("--questions", "questions_file", **SHIPPED_QUESTIONS,
              help="Spec-Bench-format JSONL questions (Spec-Bench's own data/spec_bench/question.jsonl works too).")
@click.option("--limit-per-subtask", type=int, default=2, show_default=True, help="The first K questions of each subtask.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="New tokens per turn (greedy).")
@click.option("--out", "out_dir", default="gpu-check", show_default=True,
              help="Directory for gpu_check.json and gpu_check.md.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def gpu_check(device, dtypes, graphs, model, exit_layer, threads, adapter, questions_file, limit_per_subtask,
              max_new_tokens, out_dir, no_progress) -> None:
    """Identity and speed on one GPU in a few minutes: transformers eager and static cache + compile, our target
    alone, Kangaroo and Kangaroo with a dynamic tree, per dtype; a table, gpu_check.json and gpu_check.md in --out.

    Exits 1 when a method fails or a drafting method differs from our target alone on some turn."""
    from kangaroo_apps.bench.questions import load_questions
    from kangaroo_apps.studies.gpu_check import (backend_options, check_table, parse_dtypes, problems, run_check,
                                                 run_info, write_outputs)
    from kangaroo_backends.devices import resolve_device

    resolve_device(device)  # no CUDA: one line, before anything loads
    names = parse_dtypes(dtypes)
    out = check_out_dir(out_dir)
    questions = load_questions(questions_file, limit_per_subtask)
    opts = EngineOptions(model=model, exit_layer=exit_layer, threads=threads, adapter=adapter, device=device,
                         max_new_tokens=max_new_tokens, backend_options=backend_options(graphs))
    opts.config()  # a bad --max-new-tokens is refused before the model loads
    result = run_check(opts, names, questions, progress=not no_progress)
    info = run_info("kangaroo " + shlex.join(_argv), questions_file, questions, max_new_tokens, graphs)
    files = write_outputs(out, result, info)
    click.echo(check_table(result))
    click.echo(f"wrote {', '.join(str(f) for f in files)}")
    found = problems(result)
    for problem in found[1:]:
        _eprint(f"kangaroo: gpu-check: {problem}")
    if found:
        raise KangarooError(f"gpu-check: {found[0]}" + (f" (and {len(found) - 1} more above)" if len(found) > 1 else ""))


@cli.command("train-adapter")
@click.option("--out", "out_dir", required=True, help="Output adapter directory (+ training_report.json, training_curves.png).")
@model_options
@device_option(help="Where the target answers, the features are computed and the adapter trains: cpu (the default), "
                    "cuda or cuda:N. Weights and optimizer stay float32 (faster steps: --train-matmuls bfloat16).")
@click.option("--prompts", "prompts_file", **SHIPPED_PROMPTS,
              help="JSONL prompts ({id, prompt, category}) or ShareGPT-style conversations. Never Spec-Bench.")
@click.option("--corpus", "corpus_dir", default=None,
              help="Train on a committed self-distilled corpus (`kangaroo corpus build`) instead of generating answers; "
                   "features are recomputed from it into the work directory.")
@click.option("--work-dir", default=None, help="Resumable work directory (default: under the kangaroo cache).")
@click.option("--num-prompts", type=int, default=640, show_default=True)
@click.option("--heldout-prompts", type=int, default=64, show_default=True, help="Prompts held out for evaluation.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Answer length for self-distillation.")
@click.option("--generation-batch-size", type=int, default=16, show_default=True)
@click.option("--top-k", type=int, default=32, show_default=True, help="Soft-label entries kept per token.")
@click.option("--epochs", type=int, default=4, show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--ffn", is_flag=True, help="Ablation: add an FFN block to the adapter.")
@click.option("--separate-head", is_flag=True, help="Ablation: own LM head instead of the shared one.")
@click.option("--draft-vocab", type=int, default=0, show_default=True,
              help="Draft only among the K tokens the target emits most in its answers (0: whole vocabulary); "
                   "a K-row head is far cheaper per draft step. Output stays lossless.")
@click.option("--adapter-type", type=click.Choice(["attention", "deep-context"]), default="attention", show_default=True,
              help="attention: the paper's adapter; deep-context: also reads the target's deep states of verified "
                   "positions (handed over by verification, no extra target work).")
@click.option("--draft-head", is_flag=True, help="A trainable head over the draft vocabulary (needs --draft-vocab).")
@click.option("--loss", type=click.Choice(["soft-ce", "accept"]), default="soft-ce", show_default=True,
              help="soft-ce: the paper's soft cross-entropy; accept: plus 1 − Σ min(p, q) (the draft's rejection probability).")
@click.option("--train-depths", type=int, default=4, show_default=True,
              help="deep-context: train at draft depths 0..N-1 (each with the keys it sees when drafting).")
@click.option("--fusion-lr-scale", type=click.FloatRange(0.0, 1.0), default=0.1, show_default=True,
              help="deep-context: the zero-initialised deep-state fusions train at --lr times this.")
@click.option("--feature-loss", "feature_weight", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="Weight of EAGLE's regression (smooth L1) of the adapter's output to the target's deep state "
                   "(0: off).")
@click.option("--prompt-queries", is_flag=True,
              help="Also train on the prompt's positions (more rows per answer; evaluation stays on answers).")
@click.option("--feature-matmuls", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="--corpus: the training features' matrix products (bfloat16: a faster, slightly perturbed pass; "
                   "held-out features always exact).")
@click.option("--train-matmuls", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="The training steps' matrix products (bfloat16 autocast: faster; weights, optimizer and "
                   "evaluation stay float32).")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False), default=None,
              help="Start from this trained adapter directory (the same network): a longer schedule, or a larger "
                   "--draft-vocab whose head keeps the trained rows (new tokens start from the shared head).")
@click.option("--record-layers", default="", help="Also record these layers' states (e.g. 1,3,4) for an exit-layer sweep on the same data.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--skip-generation", is_flag=True, help="Train on the answers recorded so far in the work directory (no new generation).")
@ray_pool_options("--corpus: compute the missing features")
def train_adapter_command(out_dir, model, exit_layer, threads, device, prompts_file, corpus_dir, work_dir, num_prompts,
                          heldout_prompts, max_new_tokens, generation_batch_size, top_k, epochs, batch_size, lr, ffn,
                          separate_head, draft_vocab, adapter_type, draft_head, loss, train_depths, fusion_lr_scale,
                          feature_weight, prompt_queries, feature_matmuls, train_matmuls, init_from, record_layers, seed,
                          skip_generation, ray_address, workers, threads_per_worker) -> None:
    """Train a Kangaroo adapter by self-distillation (resumable; progress bars with ETA)."""
    from kangaroo_core.paths import cache_dir
    from kangaroo_tools.adapter_training import TrainConfig, train_adapter

    check_device(device)
    try:
        layers = tuple(int(x) for x in record_layers.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"--record-layers must be comma-separated integers, got {record_layers!r}") from None
    exit_layer = DEFAULT_EXIT_LAYER if exit_layer is None else exit_layer
    config = TrainConfig(exit_layer=exit_layer, num_prompts=num_prompts, heldout_prompts=heldout_prompts,
                         max_new_tokens=max_new_tokens, generation_batch_size=generation_batch_size, top_k=top_k,
                         epochs=epochs, batch_size=batch_size, lr=lr, ffn=ffn, separate_head=separate_head,
                         record_layers=layers, seed=seed, draft_vocab=draft_vocab, adapter_type=adapter_type,
                         draft_head=draft_head, loss=loss, train_depths=train_depths,
                         fusion_lr_scale=fusion_lr_scale, feature_weight=feature_weight,
                         prompt_queries=prompt_queries, feature_matmuls=feature_matmuls,
                         train_matmuls=train_matmuls, init_from=init_from or "")
    if draft_head and not draft_vocab:
        raise UsageError("--draft-head needs --draft-vocab K (the head's rows are the draft vocabulary)")
    if feature_matmuls != "float32" and corpus_dir is None:
        raise UsageError("--feature-matmuls applies to features recomputed from a corpus (--corpus)")
    if ray_address is not None and corpus_dir is None:
        raise UsageError("--ray computes the features of a corpus (--corpus)")
    check_ray_pool_options(ray_address, workers, threads_per_worker, None)
    check_out_dir(out_dir)
    if work_dir is not None:
        check_out_dir(work_dir, "--work-dir")
    corpus = None
    if corpus_dir is not None:
        from kangaroo_tools.corpus import Corpus

        corpus = Corpus(corpus_dir)
        corpus.manifest()  # not a corpus: refused before the model loads
    else:
        check_training_prompts(prompts_file)
    backend = EngineOptions(model=model, exit_layer=exit_layer, threads=threads, device=device).backend(vanilla=True)
    work = work_dir or cache_dir() / "train" / backend.fingerprint
    _eprint(f"kangaroo: work directory {work} (re-run the same command to resume)")
    feature_pool = None
    if ray_address is not None:  # started only if a feature shard is missing, stopped before training
        from kangaroo_apps.ray_launch import pool_on_ray

        feature_pool = pool_on_ray(ray_address, EngineOptions(model=model, exit_layer=exit_layer, device=device),
                                   workers=workers, threads=threads_per_worker or 1, log=_eprint)
    report = train_adapter(backend, prompts_file, work, out_dir, config, command_line=command_line(), log=_eprint,
                           generate=not skip_generation, corpus=corpus, feature_pool=feature_pool)
    final = report["final"]
    _eprint(f"kangaroo: adapter written to {out_dir}: held-out top-1 agreement {final['top1_agreement']:.3f}, "
            f"CR {final['cr']:.2f} (eta={config.eta}, gamma={config.gamma})")


def check_training_prompts(prompts_file: str, verb: str = "train on") -> None:
    """A training prompts file is refused in one line before the model loads: missing, without usable prompts, or
    named like Spec-Bench (evaluation only)."""
    from kangaroo_tools.prompts import read_prompts

    if "specbench" in os.path.basename(prompts_file).lower().replace("-", "").replace("_", ""):
        raise KangarooError(f"refusing to {verb} {prompts_file}: Spec-Bench is for evaluation only")
    read_prompts(prompts_file, warn=lambda _m: None)


def command_line() -> str:
    """The command as the user typed it (for reports), quoted so it can be pasted back."""
    return "kangaroo " + shlex.join(_argv)


@cli.command("train-policy")
@click.option("--out", "out_dir", required=True, help="Output directory (predictor.safetensors + predictor.json).")
@model_options
@device_option
@click.option("--dtype", default=None, help="Model dtype: float32 (the default), bfloat16, float16.")
@click.option("--adapter", default=None, help="Adapter directory (default: the shipped adapter for this model, as for generate).")
@click.option("--prompts", "prompts_file", **SHIPPED_PROMPTS,
              help="JSONL training prompts ({id, prompt, category} or ShareGPT-style). Never Spec-Bench.")
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--gamma", type=int, default=6, show_default=True, help="Drafts per round of the fixed-gamma runs.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--steps", type=int, default=300, show_default=True, help="Gradient-descent steps of the fit.")
@click.option("--lr", type=float, default=0.1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def train_policy_command(out_dir, model, exit_layer, threads, device, dtype, adapter, prompts_file, num_prompts, gamma,
                         max_new_tokens, steps, lr, seed) -> None:
    """Fit the learned policy's acceptance predictor on fixed-gamma greedy runs over training prompts."""
    if num_prompts < 1 or steps < 1:
        raise UsageError("--num-prompts and --steps must be >= 1")
    check_training_prompts(prompts_file)
    check_out_dir(out_dir)
    opts = EngineOptions(model=model, exit_layer=exit_layer, threads=threads, device=device, dtype=dtype, gamma=gamma,
                         max_new_tokens=max_new_tokens, adapter=adapter, drafter="kangaroo", policy="fixed")
    opts.check()
    check_device(device)

    from kangaroo_core.assembly import build_pieces
    from kangaroo_tools.policy_training import train_predictor

    set_threads(threads)
    pieces = build_pieces(opts.spec())  # at the adapter's exit layer unless --exit-layer is given
    report = train_predictor(pieces.backend, pieces.drafter, prompts_file, out_dir, num_prompts=num_prompts, gamma=gamma,
                             max_new_tokens=max_new_tokens, steps=steps, lr=lr, seed=seed,
                             command_line=command_line(), log=_eprint)
    _eprint(f"kangaroo: predictor written to {out_dir}: {report['samples']} samples, accept rate "
            f"{report['accept_rate']:.3f}, log loss {report['train_log_loss']:.3f} (constant {report['constant_log_loss']:.3f})")
    click.echo(out_dir)


@cli.command("analyze-policies", cls=EngineCommand)
@click.option("--questions", "questions_file", **SHIPPED_QUESTIONS,
              help="Spec-Bench-format JSONL (evaluation questions; nothing is trained on them).")
@click.option("--out", "out_dir", default="policy-analysis", show_default=True, help="Output directory.")
@click.option("--policies", default="fixed,threshold,adaptive,oracle", show_default=True,
              help="Comma-separated policies to replay; options as NAME:KEY=VALUE[:KEY=VALUE], e.g. learned:predictor=DIR.")
@click.option("--limit-per-subtask", type=int, default=None, help="Only the first K questions of each subtask.")
@click.option("--adapters", default=None,
              help="Comma-separated adapter directories: each drafter replayed on the same target answers, side by "
                   "side in drafters.md / drafters.json (each one's full analysis in OUT/<directory name>/).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@engine_options
def analyze_policies_command(questions_file, out_dir, policies, limit_per_subtask, adapters, no_progress,
                             opts: EngineOptions) -> None:
    """Calibration of the draft confidence, the optimal eta per subtask, and every policy replayed exactly (greedy).

    The replay models drafters whose drafts depend only on the prefix: with the default --drafter it replays the
    adapter alone (kangaroo), not the hybrid's lookups."""
    from pathlib import Path

    import torch

    from kangaroo_apps.bench.questions import load_questions
    from kangaroo_apps.bench.report import write_json
    from kangaroo_tools.policy_analysis import (analysis_markdown, drafters_markdown, plot_calibration, plot_eta_curves,
                                                run_analysis, target_answers)

    out = check_out_dir(out_dir)
    specs = parse_policy_list(policies)
    questions = load_questions(questions_file, limit_per_subtask)
    paths = [Path(x.strip()).expanduser() for x in (adapters or "").split(",") if x.strip()]
    names = [p.name or str(p) for p in paths]
    if len(set(names)) != len(names):
        raise UsageError(f"--adapters: two directories share a name ({', '.join(names)})")
    for path in paths:
        if not (path / "adapter.json").is_file():
            raise UsageError(f"--adapters: {path} is not an adapter directory (no adapter.json)")
    if opts.drafter == DEFAULT_DRAFTER:  # the hybrid's drafts depend on earlier acceptances: not replayable
        _eprint("kangaroo: analyze-policies replays the adapter alone (--drafter kangaroo)")
        opts = attrs.evolve(opts, drafter="kangaroo")
    runs = [(out, opts)] if not paths else [(out / name, attrs.evolve(opts, adapter=str(path)))
                                            for name, path in zip(names, paths)]
    answers, results, files = None, {}, []
    for where, run_opts in runs:
        engine = attrs.evolve(run_opts, policy="fixed", policy_options=()).engine()
        if answers is None:  # the target's answers once: every drafter is replayed on the same tokens
            answers = target_answers(engine, questions, max_new_tokens=opts.max_new_tokens, progress=not no_progress)
        result = run_analysis(engine, questions, specs, max_new_tokens=opts.max_new_tokens, progress=not no_progress,
                              answers=answers)
        info = {"command": command_line(), "model": engine.backend.model_name,
                "questions": str(questions_file), "max_new_tokens": opts.max_new_tokens,
                "exit_layer": engine.config.exit_layer, "adapter": run_opts.adapter, "drafter": opts.drafter,
                "backend": opts.backend_name, "torch_threads": torch.get_num_threads()}
        results[where.name] = result
        where.mkdir(parents=True, exist_ok=True)
        files += [write_json(where / "calibration.json", {"run": info, "calibration": result["calibration"]}),
                  write_json(where / "optimal_eta.json", {"run": info, "costs": result["costs"], "eta": result["eta"]}),
                  write_json(where / "policies.json", {"run": info, "costs": result["costs"],
                                                       "policies": result["policies"],
                                                       "drafted_exact": result["drafted_exact"]})]
        plot_calibration(result["calibration"], where / "calibration.png")
        plot_eta_curves(result["eta"], where / "eta_curves.png")
        (where / "analysis.md").write_text(analysis_markdown(result, info))
        files += [where / "calibration.png", where / "eta_curves.png", where / "analysis.md"]
        label = f"[{where.name}] " if paths else ""
        for scope, entry in result["eta"].items():
            _eprint(f"{label}[{scope}] optimal eta {entry['optimal_eta']:g} (predicted speedup "
                    f"{entry['optimal_predicted_speedup']:.3f}), "
                    f"ECE {result['calibration'][scope]['expected_calibration_error']:.3f}")
    if paths:
        run = {"command": command_line(), "questions": str(questions_file), "max_new_tokens": opts.max_new_tokens,
               "adapters": [str(p) for p in paths]}
        files.append(write_json(out / "drafters.json", {
            "run": run, "drafters": {name: {"costs": r["costs"], "policies": r["policies"], "drafted_exact": r["drafted_exact"]}
                             for name, r in results.items()}}))
        (out / "drafters.md").write_text(drafters_markdown(results, run))
        files.append(out / "drafters.md")
    click.echo(f"wrote {', '.join(str(f) for f in files)}")


@cli.command("export-onnx")
@click.option("--out", "out", required=True, help="Directory to write (must not exist or be empty).")
@model_options
@device_option(help="cpu only: the export traces on the CPU in float32 and an ONNX graph runs on any device; run the "
                    "bundle on CUDA with `kangaroo generate --backend onnx --device cuda`.")
@click.option("--adapter", default=None,
              help="Also export this adapter's graph into the bundle (default: the shipped adapter for this model, "
                   "as for generate; 'none': the split target only).")
@click.option("--opset", type=int, default=17, show_default=True, help="ONNX opset.")
@click.option("--tolerance", type=float, default=1e-4, show_default=True,
              help="Refuse the export if a graph differs from eager by more than this times max(1, max |eager output|).")
@click.option("--weights", type=click.Choice(["float32", "gguf"]), default="float32", show_default=True,
              help="gguf: linear layers as MatMulNBits over the GGUF file's own blocks (--model must be a GGUF file).")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=1, show_default=True,
              help="With --weights gguf: MatMulNBits accuracy level; 1 float32 activations, 4 int8 activations (lossy).")
def export_onnx_command(out, model, exit_layer, threads, device, adapter, opset, tolerance, weights,
                        accuracy_level) -> None:
    """Export shallow M[:l], deep M[l:] and the head to ONNX (+ the Kangaroo adapter's graph), validated against eager."""
    from kangaroo_backends.onnx_export import export_onnx
    from kangaroo_backends.onnx_toolkit import import_onnxruntime

    if device is not None and device.strip().lower() != "cpu":
        raise UsageError(f"--device {device}: export-onnx traces on the CPU in float32 (an ONNX graph runs on any "
                         f"device); export without --device, then run the bundle on CUDA with --backend onnx "
                         f"--device cuda")
    import_onnxruntime()
    check_out_dir(out)
    # torch: the weights to export, split at the adapter's exit layer unless --exit-layer is given
    backend = EngineOptions(model=model, exit_layer=exit_layer, threads=threads,
                            adapter=None if adapter == "none" else adapter).backend()
    exit_layer = backend.exit_layer
    gguf_path = None
    if weights == "gguf":
        from kangaroo_backends.loading import gguf_source

        gguf_path = gguf_source(backend.base_model())
        if gguf_path is None:
            raise UsageError("--weights gguf needs --model to be a GGUF file (or the default SmolLM2 GGUF)")
    manifest = export_onnx(backend.base_model(), out, exit_layer=exit_layer, fingerprint=backend.fingerprint,
                           model_name=backend.model_name, opset=opset, tolerance=tolerance, weights=weights,
                           gguf_path=gguf_path, accuracy_level=accuracy_level)
    for graph, entry in manifest["graphs"].items():
        check = entry["validation"]
        _eprint(f"[{graph}] {entry['file']}: max |onnx - eager| {check['max_abs_diff']:.2e} (tolerance {check['tolerance']:.2e})")
    if adapter != "none":  # the drafter exports its own graph into the bundle, as it does on first use
        opts = EngineOptions(model=model, exit_layer=exit_layer, threads=threads, backend_name="onnx",
                             backend_options=(f"bundle={out}",),
                             adapter=adapter, drafter="kangaroo",  # the adapter's graph (every drafter's adapter)
                             drafter_options=(f"onnx_opset={opset}", f"onnx_tolerance={tolerance}"))
        engine = opts.engine(backend=_resolve_onnx(opts, backend))
        _eprint(f"[adapter] {engine.drafter.resolved_adapter or 'untrained'} exported into {out}/drafters")
    click.echo(out)


def _resolve_onnx(opts: EngineOptions, torch_backend):
    """An onnx backend over the already loaded model (no second load)."""
    from kangaroo_core.plugins import get_registry

    return get_registry().resolve("backend", "onnx")(torch_backend.base_model(), torch_backend.tokenizer, opts.exit_layer, torch_backend.model_name,
                       bundle=opts.parsed_backend_options().get("bundle"), threads=opts.threads)


@cli.group()
def corpus() -> None:
    """The self-distilled corpus: the target's own greedy answers to training prompts, committed in the repo."""


@corpus.command("build")
@click.option("--out", "out_dir", **SHIPPED_CORPUS,
              help="Corpus directory (created, or extended when it exists: same model and settings only).")
@model_options
@device_option(help="Where the target answers: cpu (the default), cuda or cuda:N (float32 either way; each shard "
                    "records its device).")
@click.option("--prompts", "prompts_file", **SHIPPED_PROMPTS,
              help="JSONL prompts ({id, prompt, category}) or ShareGPT-style conversations. Never Spec-Bench.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Answer length (token budget).")
@click.option("--heldout-prompts", type=int, default=64, show_default=True, help="Prompts held out for evaluation.")
@click.option("--shard-size", type=int, default=64, show_default=True, help="Prompts per shard (one atomic file).")
@click.option("--batch-size", type=int, default=8, show_default=True,
              help="Batched generation of training shards (8 measured fastest on 2 CPU cores).")
@click.option("--max-shards", type=int, default=None, help="Stop after this many new training shards.")
@click.option("--minutes", type=float, default=None, help="Stop starting new shards after this many minutes.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@ray_pool_options("Answer the shards")
def corpus_build(out_dir, model, exit_layer, threads, device, prompts_file, max_new_tokens, heldout_prompts, shard_size,
                 batch_size, max_shards, minutes, no_progress, ray_address, workers, threads_per_worker) -> None:
    """Answer the prompts with the target (held-out split first), extending the corpus shard by shard (resumable)."""
    import time

    check_ray_pool_options(ray_address, workers, threads_per_worker, threads)
    check_training_prompts(prompts_file, "distil")
    out = check_out_dir(out_dir)
    if ray_address is None:
        check_device(device)  # with --ray the workers' nodes hold the devices, not this one

    from kangaroo_tools.corpus import Corpus, CorpusSettings, build

    settings = CorpusSettings(max_new_tokens=max_new_tokens, heldout_prompts=heldout_prompts, shard_size=shard_size)
    deadline = None if minutes is None else time.time() + 60 * minutes
    options = EngineOptions(model=model, exit_layer=exit_layer, threads=threads, device=device)
    if ray_address is not None:
        from kangaroo_apps.ray_launch import corpus_on_ray

        summary = corpus_on_ray(ray_address, options, Corpus(out), prompts_file, settings, workers=workers,
                                threads=threads_per_worker or 1, max_train_shards=max_shards, batch_size=batch_size,
                                deadline=deadline, progress=not no_progress, log=_eprint)
    else:
        summary = build(Corpus(out), options.engine(vanilla=True), prompts_file, settings,
                        max_train_shards=max_shards, batch_size=batch_size, deadline=deadline,
                        progress=not no_progress, log=_eprint)
    _print_corpus(summary)


@corpus.command("info")
@click.argument("directory", default=SHIPPED_CORPUS["default"])
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def corpus_info(directory, as_json) -> None:
    """What a corpus holds: prompts, tokens and generation throughput per split."""
    from kangaroo_tools.corpus import Corpus

    summary = Corpus(directory).summary()
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    _print_corpus(summary)


def _print_corpus(summary: dict) -> None:
    click.echo(f"corpus {summary['directory']} (base model {summary['base_model_fingerprint']})")
    for split in ("heldout", "train"):
        e = summary[split]
        rate = e["answer_tokens"] / e["generation_seconds"] if e["generation_seconds"] else 0.0
        click.echo(f"  {split:<8} {e['shards']:>4} shards {e['prompts']:>6} prompts {e['answer_tokens']:>9} answer "
                   f"tokens ({rate:.1f} answer tokens/s while generating)")
    if "ray" in summary:  # this sitting's pool: where the time went
        r = summary["ray"]
        start = f"Ray start/join {r['start_seconds']:.1f} s, " if "start_seconds" in r else ""
        click.echo(f"  on Ray: {r['workers']} workers x {r['threads_per_worker']} thread(s), {r['shards_answered']} shards "
                   f"answered ({start}model loads {r['load_seconds']:.1f} s, answering {r['answer_seconds']:.1f} s), "
                   f"{r['shards_redone']} redone after a worker died")


@cli.command(cls=EngineCommand)
@engine_options
@click.option("--context", type=int, default=300, show_default=True, help="Tokens already in the cache.")
@click.option("--positions", default="1,2,3,4,5,6,7,8,12,16,24,32,48,64", show_default=True,
              help="Comma-separated numbers of new positions per pass.")
@click.option("--repeats", type=int, default=15, show_default=True, help="Timings per size (the median is shown).")
@click.option("--compare-plain", is_flag=True,
              help="Also measure the plain kernels on the same model, for the before/after curve: torch --kernels "
                   "plain; onnx with gguf weights, --onnx-kernel matmulnbits.")
@click.option("--out", "out_file", default=None, help="Also write the curve(s) as JSON here.")
@click.option("--plot", "plot_file", default=None, help="Also plot the curve(s) to this PNG.")
def profile(opts: EngineOptions, context, positions, repeats, compare_plain, out_file, plot_file) -> None:
    """The backend's measured cost model: a pass over n new positions vs one, and one draft step.

    With a drafter it also times whole rounds drafting 0..gamma tokens; with the pass sizes the cost-aware policy
    reads among --positions (1, 2, 4, 8, 16, 32, 64 up to half the context: the default has them) the curve then
    replaces the one that policy cached for this machine, backend, kernels, threads, model and drafter."""
    from tqdm import tqdm

    from kangaroo_apps.bench.report import plot_curves
    from kangaroo_policies.cost_model import (cost_key, covers, measure_costs, save_costs, with_batch_passes,
                                              with_round_contexts)

    sizes = _int_list(positions, "--positions")
    if not sizes or min(sizes) < 1:
        raise UsageError("--positions must be positive integers")
    if repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {repeats}")
    engine = opts.engine()
    backends = [engine.backend]
    if compare_plain:
        b = engine.backend
        if b.name == "torch":
            from kangaroo_backends.torch_backend import TorchBackend

            backends.append(TorchBackend(b.model, b.tokenizer, b.exit_layer, b.model_name, kernels="plain"))
        elif b.name == "onnx" and getattr(b, "kernel", None) == "blocks" and b.bundle is None:
            import attrs

            backends.append(type(b)(b.model, b.tokenizer, b.exit_layer, b.model_name, gguf_path=b.gguf_path,
                                    options=attrs.evolve(b.options, kernel="matmulnbits")))
        else:
            raise UsageError("--compare-plain applies to the torch backend and to the onnx backend's block kernel "
                             "(--onnx-weights gguf, no --onnx-dir)")
    curves = []
    for backend in backends:
        with tqdm(total=repeats, desc=f"profile {backend.name}:{getattr(backend, 'kernels', '')}", unit="repeat",
                  file=sys.stderr, leave=False) as bar:
            drafter = engine.drafter if backend is engine.backend else None
            curves.append(measure_costs(backend, drafter, context=context, positions=sizes, repeats=repeats,
                                        progress=bar.update, rounds=opts.gamma if drafter is not None else 0))
    if engine.drafter is not None:  # a batch's merged draft steps and verify passes
        curves[0] = with_batch_passes(curves[0], engine.backend, engine.drafter, repeats=repeats)
        curves[0] = with_round_contexts(curves[0], engine.backend, engine.drafter, repeats=repeats)
    for curve in curves:
        click.echo(curve.table() + "\n")
    if engine.drafter is not None and covers(curves[0], opts.gamma, engine.backend.max_context):
        # what the cost-aware policy reads on this machine from now on
        saved = save_costs(curves[0], cost_key(engine.backend, engine.drafter))
        click.echo(f"cached for the cost-aware policy: {saved}", err=True)
    if out_file:
        Path(out_file).write_text(json.dumps([c.as_dict() for c in curves], indent=2) + "\n")
    if plot_file:
        plot_curves(curves, plot_file)


@cli.command(cls=EngineCommand)
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--queue-size", type=int, default=16, show_default=True,
              help="Requests that may wait behind the running ones; more are answered 429 at once.")
@click.option("--max-batch", type=int, default=4, show_default=True,
              help="Requests decoded together (continuous batching, each answer as if decoded alone); 1: one at a "
                   "time.")
@click.option("--served-model-name", default=None, help="The model id clients send (default: the model's file name).")
@click.option("--max-request-bytes", type=int, default=4 * 1024 * 1024, show_default=True,
              help="Larger request bodies are answered 413.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--replicas", default=None, metavar="N|MIN-MAX",
              help="Serve from N engine replicas on Ray Serve (extra [ray]), each of --threads threads; MIN-MAX: "
                   "autoscaled between the bounds. The API, streaming, /metrics and the live page stay here.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="--replicas: where they run: 'local' (the default) starts a local Ray instance; 'auto', "
                   "ray://HOST:10001 or HOST:6379 joins a cluster (docs/scaling.md).")
def serve(opts: EngineOptions, host, port, queue_size, max_batch, served_model_name, max_request_bytes,
          log_level, replicas, ray_address) -> None:
    """An OpenAI-compatible server (chat, completions, streaming) with /metrics and a live page at /.

    One engine, loaded once from the same flags as `generate`; requests are taken in arrival order and up to
    --max-batch of them decoded together (with --replicas: N engines on Ray, each as one such server's).
    The sampling flags are the defaults for requests that set none (greedy unless --temperature says otherwise).
    """
    try:
        import uvicorn

        from kangaroo_apps.serve.app import create_app
    except ImportError as exc:
        from kangaroo_core.errors import MissingDependencyError

        raise MissingDependencyError(f"kangaroo serve needs the [serve] extra ({exc.name} is missing): "
                                     "pip install fastapi uvicorn prometheus-client (kangaroo's [serve] extra)") from None
    if queue_size < 1:
        raise UsageError(f"--queue-size must be >= 1, got {queue_size}")
    if max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1, got {max_batch}")
    if replicas is not None or ray_address is not None:
        from kangaroo_apps.ray_launch import serve_on_ray
        from kangaroo_apps.serve.dispatch import parse_replicas

        from kangaroo_core.assembly import check_spec

        check_spec(opts.spec())  # plugin names and options checked here, before Ray starts
        serve_on_ray(ray_address, opts, replicas=parse_replicas(replicas or "1"), host=host, port=port,
                     queue_size=queue_size, max_batch=max_batch, served_model_name=served_model_name,
                     max_request_bytes=max_request_bytes, log_level=log_level, log=_eprint)
        return
    engine = opts.engine()
    engine.generate("Hello", max_new_tokens=4)  # warm-up before the first client: one-off allocations, kernel build
    app = create_app(engine, model_id=served_model_name, queue_size=queue_size, max_request_bytes=max_request_bytes,
                     max_batch=max_batch)
    _eprint(f"kangaroo: serving {app.state.model_id} on http://{host}:{port}/ (OpenAI API under /v1, live page at /)")
    uvicorn.run(app, host=host, port=port, log_level=log_level)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def plugins(as_json: bool) -> None:
    """List installed plugins: name, distribution, version, what each registers, errors."""
    from kangaroo_apps.plugin_index import refresh
    from kangaroo_core.plugins import get_registry

    refresh()  # the command line's copy of the plugins' facts, made anew from what is installed now
    report = get_registry().report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    rows = [(p["name"], f"{p['distribution']} {p['version']}" if p["distribution"] else "(registered at run time)",
             "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(p["registers"].items())) or "-",
             p["errors"]) for p in report]
    name_w = max([len("PLUGIN"), *(len(r[0]) for r in rows)])
    source_w = max([len("DISTRIBUTION"), *(len(r[1]) for r in rows)])
    click.echo(f"{'PLUGIN':<{name_w}}  {'DISTRIBUTION':<{source_w}}  REGISTERS")
    for name, source, registers, errors in rows:
        click.echo(f"{name:<{name_w}}  {source:<{source_w}}  {registers}")
        for error in errors:
            click.echo(f"{'':<{name_w}}  error: {error}")


def main(argv: list[str] | None = None) -> int:
    _argv[:] = list(sys.argv[1:] if argv is None else argv)
    try:
        cli.main(args=argv, prog_name="kangaroo", standalone_mode=False)
    except click.exceptions.Abort:
        _eprint("kangaroo: aborted")
        return 130
    except click.exceptions.NoArgsIsHelpError as exc:  # bare `kangaroo`: the help, not an error
        click.echo(exc.ctx.get_help() if exc.ctx else cli.get_help(click.Context(cli)))
        return 0
    except (click.ClickException, KangarooError) as exc:  # bad usage: 2; any other user error: 1
        text = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        _eprint(f"kangaroo: error: {text}")
        return 2 if isinstance(exc, (click.UsageError, UsageError)) else 1
    except KeyboardInterrupt:
        _eprint("kangaroo: interrupted")
        return 130
    except BrokenPipeError:
        return 0
    return 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
