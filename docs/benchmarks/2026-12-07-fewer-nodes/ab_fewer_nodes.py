"""Before/after in one process (docs/backends.md, "Fewer nodes and bindings per pass"): the cache bound by tensor views
and no rotary op (before) against bound by address with kangaroo.Rotary (after); the 4-bit int8 target alone and
Kangaroo, alternating per question. Usage: PER_SUB=2 python ab_fewer_nodes.py mt_bench,translation,summarization,qa,math_reasoning,rag"""
import sys, os, torch
from kangaroo_core.assembly import EngineSpec
from kangaroo_core.engine import assemble
from kangaroo_backends import onnx_backend as ob
from kangaroo_backends.ort_rotary import fuse_rotary
from kangaroo_apps.bench.questions import load_questions
from kangaroo_data import dev_questions
T = int(os.environ.get("THREADS", "2")); torch.set_num_threads(T)
spec = EngineSpec(backend="onnx", backend_options=dict(weights="gguf", accuracy_level=4, threads=T))
new_bind_cache = ob.Binder.bind_cache
CURRENT = [None]
def old_bind_cache(self, binding, past, new, past_shape, new_shape):
    r = CURRENT[0]; start, n = past_shape[1], new_shape[1]
    for name, buffer in zip(r.past_names, r.cache):
        self.bind(binding, name, buffer[:, :start])
    for name, buffer in zip(r.new_names, r.cache):
        self.bind(binding, name, buffer[:, start:start + n], output=True)
orig_run = ob.GraphRunner.run
def run(self, *a, **k):
    CURRENT[0] = self; return orig_run(self, *a, **k)
ob.GraphRunner.run = run
def engines(after):
    ob.fuse_rotary = fuse_rotary if after else (lambda p: 0)
    k = assemble(spec); k.backend._ensure(); k.generate("Hello there", max_new_tokens=16)
    a = assemble(spec.target_alone(), backend=k.backend); a.generate("Hello there", max_new_tokens=16)
    return {"alone": a, "kangaroo": k}
E = {"after": engines(True), "before": engines(False)}
subs = sys.argv[1].split(","); per_sub = int(os.environ.get("PER_SUB", "99"))
qs = [q for q in load_questions(str(dev_questions())) if q.subtask in subs]
seen = {}; qs = [q for q in qs if seen.setdefault(q.subtask, []).append(1) or len(seen[q.subtask]) <= per_sub]
tot, sub = {}, {}
for i, q in enumerate(qs):
    ids = E["after"]["alone"].encode(q.turns[0]); ref = None
    for v in (["after", "before"] if i % 2 == 0 else ["before", "after"]):
        ob.Binder.bind_cache = new_bind_cache if v == "after" else old_bind_cache
        for k, e in E[v].items():
            r = e.generate_ids(ids, 128)
            ref = ref or r.token_ids; assert r.token_ids == ref, (v, k)
            tot[(v, k)] = tot.get((v, k), 0.0) + r.seconds
            sub.setdefault(q.subtask, {}); sub[q.subtask][(v, k)] = sub[q.subtask].get((v, k), 0.0) + r.seconds
    print(q.subtask, q.question_id, {f"{a}/{b}": round(t, 2) for (a, b), t in tot.items()}, flush=True)
print(f"| subtask | target alone after × before | Kangaroo after × before | Kangaroo × alone, before | after |")
for s, t in list(sub.items()) + [("overall", tot)]:
    print(f"| {s} | {t[('before','alone')]/t[('after','alone')]:.3f} | {t[('before','kangaroo')]/t[('after','kangaroo')]:.3f} | "
          f"{t[('before','alone')]/t[('before','kangaroo')]:.3f} | {t[('after','alone')]/t[('after','kangaroo')]:.3f} |")
