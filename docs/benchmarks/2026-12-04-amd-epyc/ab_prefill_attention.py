"""A/B in one process: the prompt pass (shallow + deep, nothing cached) of the int8 4-bit SmolLM2 export with its
prefill graphs running the in-place attention op (before) or their exported attention (after), interleaved, best of
two, on every dev question's first turn. Run from the repository root: python THIS THREADS."""
import json, sys, time, statistics
from kangaroo_backends.loading import load_model
from kangaroo_backends.onnx_backend import OnnxBackend
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_policies.threshold import ThresholdPolicy

threads = int(sys.argv[1])
model, tok, name = load_model(None)
after = OnnxBackend(model, tok, 2, name, provider="cpu", weights="gguf", accuracy_level=4, threads=threads, quiet=True)
before = OnnxBackend(model, tok, 2, name, provider="cpu", weights="gguf", accuracy_level=4, threads=threads, quiet=True)
orig = before.session
before.session = lambda path, spin=False, swap=True: orig(path, spin=spin, swap=True)  # old rule: every graph swapped
before.reset(); after.reset()
print("before swapped:", sorted(p.name for p in before.swapped), " after:", sorted(p.name for p in after.swapped))
qs = [json.loads(l) for l in open("kangaroo_data/specbench_dev.jsonl")]
tot = {"before": 0.0, "after": 0.0}
for q in qs:
    ids = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    row = {}
    for label, b in (("before", before), ("after", after), ("after", after), ("before", before)):
        b.reset(); t = time.perf_counter(); b.deep(b.shallow(ids, 0), 0); dt = time.perf_counter() - t
        row.setdefault(label, []).append(dt)
    b_, a_ = min(row["before"]), min(row["after"])
    tot["before"] += b_; tot["after"] += a_
    print(f"{q['category']:15s} prompt {len(ids):4d}  prompt pass before {1e3*b_:7.1f} ms  after {1e3*a_:7.1f} ms  ({b_/a_:5.3f}x)", flush=True)
print(f"prompt passes, total: before {tot['before']:.1f} s after {tot['after']:.1f} s: {tot['before']/tot['after']:.3f}x")
