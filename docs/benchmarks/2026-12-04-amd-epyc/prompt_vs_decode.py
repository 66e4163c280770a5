"""Prompt pass vs decode, ort_vanilla (optimum fp32) and the int8 4-bit target alone, 1 thread, 30 dev first turns:
time(max_new_tokens=1) is the prompt pass + 1 token; the rest of time(128) is decoding. Run from the repository root
after a `kangaroo bench` that ran ort_vanilla (its optimum export is cached)."""
import json, time, sys
from pathlib import Path
import torch, onnxruntime as ort
from optimum.onnxruntime import ORTModelForCausalLM
from kangaroo_backends.loading import load_model
from kangaroo_backends.onnx_backend import OnnxBackend
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_policies.threshold import ThresholdPolicy

torch.set_num_threads(1)
model, tok, name = load_model(None)
b = OnnxBackend(model, tok, 2, name, provider="cpu", weights="gguf", accuracy_level=4, threads=1, quiet=True)
o = ort.SessionOptions(); o.intra_op_num_threads = 1; o.inter_op_num_threads = 1; o.log_severity_level = 3
ortm = ORTModelForCausalLM.from_pretrained(next((Path.home() / ".cache/kangaroo/ort").iterdir()), provider="CPUExecutionProvider",
                                           session_options=o, local_files_only=True)
def run_int8(ids, n):
    e = Engine(b, None, ThresholdPolicy(), GreedyVerifier(), DecodeConfig(exit_layer=2, max_new_tokens=n))
    t = time.perf_counter(); r = e.generate_ids(ids); return time.perf_counter() - t, len(r.token_ids)
def run_ort(ids, n):
    t = time.perf_counter(); g = ortm.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return time.perf_counter() - t, g.shape[1] - len(ids)
qs = [json.loads(l) for l in open("kangaroo_data/specbench_dev.jsonl")]
tot = {k: [0.0, 0.0, 0] for k in ("ort_vanilla", "int8")}
for q in qs:
    ids = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    line = f"{q['category']:15s} {len(ids):5d}"
    for label, fn in (("ort_vanilla", run_ort), ("int8", run_int8)):
        p1 = min(fn(ids, 1)[0] for _ in range(2)); full, k = fn(ids, 128)
        tot[label][0] += p1; tot[label][1] += full - p1; tot[label][2] += k - 1
        line += f" | {label} prompt {1e3*p1:7.1f} ms decode {1e3*(full-p1)/max(1,k-1):5.1f} ms/tok ({k})"
    print(line, flush=True)
for label, (p, d, k) in tot.items():
    print(f"{label}: prompt passes {p:.1f} s, decoding {d:.1f} s for {k} tokens = {1e3*d/k:.1f} ms/token")
(po, do_, ko), (pi, di, ki) = tot["ort_vanilla"], tot["int8"]
print(f"decode-only ratio {(do_/ko)/(di/ki):.2f}x; prompt-pass ratio {po/pi:.2f}x")
