"""``kangaroo bench --concurrency 1,2,4,8``: the target alone and Kangaroo with N streams decoding together.

For each method and each N, every question's first turn is submitted to one :class:`~kangaroo_core.batching.Batch`
of N streams (continuous batching: a stream that ends makes room for the next question). Measured: aggregate
tokens/s (all new tokens / wall time, prefills included), each stream's per-token latency (its decode time / its
tokens: the median over streams), CR, streams per merged pass, and identity: every stream's tokens against the same
method decoding that question alone, and against the target alone. The methods run back to back at each N (the
target alone, then Kangaroo, then the next N), so "× target alone (same streams)" compares runs minutes apart at
most, not the two ends of the study.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

METHODS = ("vanilla", "kangaroo")


def run_level(engine, prompts: Sequence[list[int]], streams: int, max_new_tokens: int) -> dict[str, Any]:
    """Decode ``prompts`` with ``streams`` at once; the measurements and every stream's result."""
    batch = engine.batch(streams)
    start = time.perf_counter()
    handles = [batch.submit(ids, max_new_tokens=max_new_tokens) for ids in prompts]
    results = [h.wait() for h in handles]
    wall = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    passes = sum(r.num_rounds for r in results)
    return {
        "streams": streams,
        "seconds": wall,
        "new_tokens": tokens,
        "tokens_per_second": tokens / wall,
        "latency_ms_per_token": 1000 * statistics.median(r.seconds / max(1, len(r.token_ids)) for r in results),
        "cr": (sum(len(r.token_ids) - 1 for r in results) / passes) if passes else None,
        "streams_per_pass": batch.streams_per_pass / max(1, batch.passes),
        "token_ids": [r.token_ids for r in results],
    }


def concurrency_table(engines: dict[str, Any], prompts: Sequence[list[int]], levels: Sequence[int],
                      max_new_tokens: int, progress: bool = True) -> list[dict[str, Any]]:
    """One row per (method, streams). ``engines``: method name → engine (``vanilla`` is the target alone)."""
    from tqdm import tqdm

    rows = []
    alone: dict[str, list[list[int]]] = {}
    with tqdm(total=len(engines) * (len(levels) + 1), desc="concurrency", unit="run", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        for method, engine in engines.items():
            engine.generate_ids(prompts[0], 8)  # warm-up (kernels, caches), not measured
            alone[method] = [engine.generate_ids(ids, max_new_tokens).token_ids for ids in prompts]
            bar.update()
        # every method at one level back to back, so that their ratio holds however the machine drifts over the run
        for n in levels:
            for method, engine in engines.items():
                row = run_level(engine, prompts, n, max_new_tokens)
                row["method"] = method
                row["identical_to_alone"] = sum(a == b for a, b in zip(row["token_ids"], alone[method]))
                if "vanilla" in alone:
                    row["identical_to_target_alone"] = sum(a == b for a, b in zip(row["token_ids"], alone["vanilla"]))
                row["questions"] = len(prompts)
                del row["token_ids"]  # compared above; the results file keeps the counts, not every stream's ids
                rows.append(row)
                bar.update()
    for row in rows:
        base = next(r for r in rows if r["method"] == row["method"])  # its first level
        row["speedup_vs_one_stream"] = row["tokens_per_second"] / base["tokens_per_second"]
        row["latency_vs_one_stream"] = row["latency_ms_per_token"] / base["latency_ms_per_token"]
    rows.sort(key=lambda r: list(engines).index(r["method"]))  # by method, levels in order
    for row in rows:
        same = next((r for r in rows if r["method"] == "vanilla" and r["streams"] == row["streams"]), None)
        row["vs_target_alone_same_streams"] = row["tokens_per_second"] / same["tokens_per_second"] if same else None
    return rows


def markdown(rows: Sequence[dict[str, Any]], info: dict[str, Any]) -> str:
    lines = [f"# Concurrency: {info['model']}, {info['questions']} questions, {info['max_new_tokens']} new tokens, "
             f"{info['threads']} threads", "", *([f"CPU: {info['cpu']}", ""] if info.get("cpu") else []),
             "| method | streams | aggregate tok/s | × 1 stream | latency ms/token (median) | × 1 stream | CR | "
             "streams per pass | × target alone (same streams) | identical to alone |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cr = "–" if r["cr"] is None else f"{r['cr']:.2f}"
        vs = "–" if r["vs_target_alone_same_streams"] is None else f"{r['vs_target_alone_same_streams']:.2f}×"
        lines.append(f"| {r['method']} | {r['streams']} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup_vs_one_stream']:.2f}× | {r['latency_ms_per_token']:.1f} | "
                     f"{r['latency_vs_one_stream']:.2f}× | {cr} | {r['streams_per_pass']:.2f} | {vs} | "
                     f"{r['identical_to_alone']}/{r['questions']} |")
    return "\n".join(lines) + "\n"
