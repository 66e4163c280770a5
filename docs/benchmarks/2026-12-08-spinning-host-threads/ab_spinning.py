"""Before/after in one process (docs/benchmarks.md, "Threads that wait for the next op"; docs/backends.md, "Every session
spinning during its runs, torch on one thread beside them"): every onnxruntime session's
threads sleeping between ops and torch's loop work on the caller's threads (before: spinning=none, host_threads
None) against every session spinning during its runs with torch held to one thread in the loop (after: the
defaults); the 4-bit int8 target alone and Kangaroo, alternating per question.
Usage: PER_SUB=2 THREADS=2 python ab_spinning.py mt_bench,translation,summarization,qa,math_reasoning,rag"""
import os, sys, torch
from kangaroo_core.assembly import EngineSpec
from kangaroo_core.engine import assemble
from kangaroo_apps.bench.questions import load_questions
from kangaroo_data import dev_questions
T = int(os.environ.get("THREADS", "2")); torch.set_num_threads(T)
def engines(after):
    spec = EngineSpec(backend="onnx", backend_options=dict(weights="gguf", accuracy_level=4, threads=T,
                                                           spinning="all" if after else "none"))
    a = assemble(spec.target_alone())
    if not after:  # the loop's torch work (and the cost policy's measuring, when Kangaroo binds) on the caller's threads
        a.backend.host_threads = None
    k = assemble(spec, backend=a.backend)
    k.generate("Hello there", max_new_tokens=16); a.generate("Hello there", max_new_tokens=16)
    return {"alone": a, "kangaroo": k}
E = {"after": engines(True), "before": engines(False)}
subs = sys.argv[1].split(","); per_sub = int(os.environ.get("PER_SUB", "99"))
qs = [q for q in load_questions(str(dev_questions())) if q.subtask in subs]
seen = {}; qs = [q for q in qs if seen.setdefault(q.subtask, []).append(1) or len(seen[q.subtask]) <= per_sub]
tot, sub, toks = {}, {}, {}
for i, q in enumerate(qs):
    ids = E["after"]["alone"].encode(q.turns[0]); ref = None
    for v in (["after", "before"] if i % 2 == 0 else ["before", "after"]):
        for k, e in E[v].items():
            r = e.generate_ids(ids, 128)
            ref = ref or r.token_ids; assert r.token_ids == ref, (v, k)
            tot[(v, k)] = tot.get((v, k), 0.0) + r.seconds
            toks[(v, k)] = toks.get((v, k), 0) + len(r.token_ids)
            sub.setdefault(q.subtask, {}); sub[q.subtask][(v, k)] = sub[q.subtask].get((v, k), 0.0) + r.seconds
    print(q.subtask, q.question_id, {f"{a}/{b}": round(t, 2) for (a, b), t in tot.items()}, flush=True)
print(f"threads {T}, questions {len(qs)}, every output identical; tokens/s:",
      {f"{a}/{b}": round(toks[a, b] / t, 1) for (a, b), t in tot.items()})
print(f"| subtask | target alone after × before | Kangaroo after × before | Kangaroo × alone, before | after |")
for s, t in list(sub.items()) + [("overall", tot)]:
    print(f"| {s} | {t[('before','alone')]/t[('after','alone')]:.3f} | {t[('before','kangaroo')]/t[('after','kangaroo')]:.3f} | "
          f"{t[('before','alone')]/t[('before','kangaroo')]:.3f} | {t[('after','alone')]/t[('after','kangaroo')]:.3f} |")
