"""``kangaroo gpu-check``: identity and speed on one GPU, in a few minutes.

For each dtype (default float32 and bfloat16) on one device, one bench run (:mod:`kangaroo_apps.bench.harness`: the
model loaded once per dtype, an uncounted warm-up per method, the methods interleaved turn by turn) of five methods:

* ``hf_vanilla`` — transformers' eager ``generate`` (dynamic cache): the reference of "identical to transformers";
* ``hf_static`` — transformers' ``generate`` with a static cache, which transformers compiles itself on CUDA;
* ``vanilla`` — our engine's target alone (the torch backend; ``--graphs``: static KV cache + CUDA graphs);
* ``kangaroo`` — our engine drafting chains (the default drafter, adapter and stopping policy);
* ``kangaroo_tree`` — our engine drafting a dynamic token tree per round.

The result is printed as one table and written to ``--out`` as ``gpu_check.json`` and ``gpu_check.md``. The check
fails (exit status 1) when a method fails or when a drafting method's output differs from our target alone on some
turn (the losslessness claim); a difference from transformers is reported, not failed (in bfloat16 two correct
implementations may round differently).
"""

from __future__ import annotations

import gc
import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kangaroo_apps.bench.harness import MethodSpec, build_methods, run_bench, summarize
from kangaroo_apps.bench.questions import Question
from kangaroo_core.bench_context import BenchContext
from kangaroo_core.errors import UsageError

#: (bench method, what it is), in table order
METHODS = (("hf_vanilla", "transformers eager"), ("hf_static", "transformers static cache + compile"),
           ("vanilla", "our target alone"), ("kangaroo", "Kangaroo"), ("kangaroo_tree", "Kangaroo, dynamic tree"))
DTYPES = ("float32", "bfloat16")
#: the torch backend's ``graphs`` option (auto: on for CUDA, off on the CPU)
GRAPHS = ("auto", "on", "off")
#: the methods whose target alone is ``vanilla`` (their identity to it is the losslessness check)
DRAFTING = ("kangaroo", "kangaroo_tree")
COLUMNS = ("device", "dtype", "method", "tok/s", "× transformers eager", "× our target alone", "CR",
           "identical to target alone", "identical to transformers")


def parse_dtypes(text: str) -> list[str]:
    """``--dtypes float32,bfloat16``: the names, checked, duplicates dropped."""
    from kangaroo_backends.devices import resolve_dtype
    from kangaroo_core.config import ConfigError

    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise UsageError("--dtypes is empty")
    for name in names:
        try:
            resolve_dtype(name)
        except ConfigError as exc:
            raise UsageError(f"--dtypes: {exc}") from None
    return names


def backend_options(graphs: str) -> tuple[str, ...]:
    """``--graphs`` as a torch backend option (auto is the backend's own default: nothing to pass)."""
    if graphs not in GRAPHS:
        raise UsageError(f"--graphs must be one of {', '.join(GRAPHS)}, got {graphs!r}")
    return () if graphs == "auto" else (f"graphs={graphs}",)


def device_name(device: Any) -> str:
    """The GPU's name (``torch.cuda.get_device_name``), or the CPU's model and torch's thread count."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"CPU {name} ({threads} thread{'s' if threads != 1 else ''})"


def graphs_in_use(backend: Any) -> str | None:
    """Whether the torch backend runs its passes as graphs (on / off); None for a backend without the option."""
    if hasattr(backend, "use_graphs"):
        return "on" if backend.use_graphs else "off"
    graphs = getattr(backend, "graphs", None)
    return None if graphs is None else str(graphs)


def run_check(opts, dtypes: Sequence[str], questions: Sequence[Question], *, progress: bool = True) -> dict[str, Any]:
    """One bench run of :data:`METHODS` per dtype on ``opts.device`` (``opts``: an
    :class:`~kangaroo_apps.cli_options.EngineOptions`; its dtype is replaced by each of ``dtypes``)."""
    import torch

    from kangaroo_backends.devices import resolve_device

    device = resolve_device(opts.device)
    result: dict[str, Any] = {"device": str(device), "device_name": None, "model": None, "dtypes": {}}
    for dtype in dtypes:
        dtype_opts = attrs.evolve(opts, dtype=dtype)
        backend = dtype_opts.backend()
        context = BenchContext(backend, dtype_opts.spec())
        specs = [MethodSpec(name, name) for name, _ in METHODS]
        run = run_bench(context, build_methods(specs, context), questions, max_new_tokens=opts.max_new_tokens,
                        progress=progress, desc=f"gpu-check {dtype}")
        summary = summarize(run)
        result["model"], result["device_name"] = backend.model_name, device_name(device)  # after --threads is set
        result["dtypes"][dtype] = {"graphs": graphs_in_use(backend), "kernels": getattr(backend, "kernels", None),
                                   "subtasks": run.subtasks, "rows": rows(summary), "summary": summary}
        del backend, context, run, summary
        gc.collect()  # one model at a time on the device
        if device.type == "cuda":
            torch._dynamo.reset()  # transformers' compiled forward of the model just dropped
            torch.cuda.empty_cache()
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method of a bench summary: tok/s, the two speedups, CR, turns identical to the target alone (the
    drafting methods) and to transformers' eager generate (every method but that one)."""
    methods = summary["methods"]

    def speed(label: str) -> float | None:
        entry = methods.get(label)
        return None if entry is None or entry["error"] else entry["overall"]["tokens_per_second"]

    eager, alone = speed("hf_vanilla"), speed("vanilla")
    out = []
    for label, title in METHODS:
        entry = methods[label]
        overall = entry["overall"]
        tps = speed(label)
        out.append({"method": label, "title": title, "error": entry["error"], "runs": overall["runs"],
                    "new_tokens": overall["new_tokens"], "seconds": overall["seconds"], "tokens_per_second": tps,
                    "x_transformers_eager": _ratio(tps, eager), "x_target_alone": _ratio(tps, alone),
                    "cr": overall["mean_accepted_tokens"],
                    "identical_to_target_alone_turns": overall["identical_to_target_alone_turns"] if label in DRAFTING else None,
                    "identical_to_transformers_turns": overall["identical_turns"] if label != "hf_vanilla" else None})
    return out


def _number(value: float | None, form: str) -> str:
    return "–" if value is None else format(value, form)


def _turns(count: int | None, runs: int) -> str:
    return "–" if count is None else f"{count}/{runs}"


def check_table(result: dict[str, Any]) -> str:
    """The Markdown table of a :func:`run_check` result: one row per dtype and method."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for dtype, entry in result["dtypes"].items():
        for row in entry["rows"]:
            if row["error"]:
                cells = ["failed", "–", "–", "–", "–", "–"]
            else:
                cells = [_number(row["tokens_per_second"], ".1f"), _number(row["x_transformers_eager"], ".2f") + "×",
                         _number(row["x_target_alone"], ".2f") + "×", _number(row["cr"], ".2f"),
                         _turns(row["identical_to_target_alone_turns"], row["runs"]),
                         _turns(row["identical_to_transformers_turns"], row["runs"])]
            lines.append(f"| {result['device_name']} | {dtype} | {row['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def problems(result: dict[str, Any]) -> list[str]:
    """What fails the check: a method that failed, a drafting method that differs from our target alone."""
    found = []
    for dtype, entry in result["dtypes"].items():
        for row in entry["rows"]:
            if row["error"]:
                found.append(f"{dtype} {row['method']} failed: {row['error']}")
            elif row["method"] in DRAFTING and row["identical_to_target_alone_turns"] is not None \
                    and row["identical_to_target_alone_turns"] != row["runs"]:
                found.append(f"{dtype} {row['method']}: {row['identical_to_target_alone_turns']}/{row['runs']} turns "
                             "identical to our target alone")
    return found


LEGEND = """\
Columns: **tok/s** new tokens per second of generation (all tokens / all seconds, the device synchronised before
each clock reading; warm-up and compilation not counted); **× transformers eager** tok/s over `hf_vanilla`'s, same
dtype; **× our target alone** tok/s over `vanilla`'s, same dtype; **CR** new tokens per full-depth target pass;
**identical to target alone** turns whose tokens equal our target alone's (the losslessness check of the drafting
methods; – for the methods that draft nothing); **identical to transformers** turns whose tokens equal
`hf_vanilla`'s (in bfloat16 two correct implementations may round differently).

Methods: `hf_vanilla` transformers' eager `generate`; `hf_static` its static cache (`cache_implementation="static"`,
compiled by transformers on CUDA); `vanilla` our engine without a drafter; `kangaroo` our engine drafting chains;
`kangaroo_tree` drafting a dynamic token tree per round."""


def markdown(result: dict[str, Any], info: dict[str, Any]) -> str:
    """``gpu_check.md``: the run's description, the table, the legend and any problem."""
    head = [f"# kangaroo gpu-check: {result['device_name']}", "",
            f"`{info['command']}` — {info['date']}", "",
            f"- device: {result['device']} ({result['device_name']})",
            f"- model: {result['model']}",
            f"- questions: {info['questions']} ({info['turns']} turns: "
            + ", ".join(f"{n} {s}" for s, n in info["questions_per_subtask"].items()) + ")",
            f"- {info['max_new_tokens']} new tokens per turn, greedy",
            f"- graphs: {info['graphs']} ("
            + ", ".join(f"{d}: {e['graphs'] if e['graphs'] is not None else 'n/a'}" for d, e in result["dtypes"].items())
            + ")",
            f"- torch {info['torch']}, CUDA {info['cuda'] or 'none'}, transformers {info['transformers']}, "
            f"kangaroo-decoding {info['kangaroo']}", ""]
    found = problems(result)
    tail = ["", LEGEND, ""]
    if found:
        tail += ["Problems:", "", *[f"- {p}" for p in found], ""]
    return "\n".join(head + [check_table(result)] + tail)


def write_outputs(out: Path, result: dict[str, Any], info: dict[str, Any]) -> list[Path]:
    """``gpu_check.json`` (the run, the rows and every method's full bench summary) and ``gpu_check.md``."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "gpu_check.json", out / "gpu_check.md"]
    files[0].write_text(json.dumps({"run": info, **result, "problems": problems(result)}, indent=2) + "\n")
    files[1].write_text(markdown(result, info))
    return files


def run_info(command: str, questions_file: str, questions: Sequence[Question], max_new_tokens: int,
             graphs: str) -> dict[str, Any]:
    """What the run was: command, date, questions, versions."""
    import datetime
    import importlib.metadata

    import torch
    import transformers

    counts: dict[str, int] = {}
    for q in questions:
        counts[q.subtask] = counts.get(q.subtask, 0) + 1
    try:
        version = importlib.metadata.version("kangaroo-decoding")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "questions": str(questions_file), "questions_per_subtask": counts,
            "turns": sum(len(q.turns) for q in questions), "max_new_tokens": max_new_tokens, "graphs": graphs,
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "kangaroo": version, "torch_threads": torch.get_num_threads()}
