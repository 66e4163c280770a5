"""The 4-bit int8 target alone (SmolLM2 GGUF, accuracy level 4) with each layer's attention as exported and with
kangaroo's in-place op, on the same export, engines alternating question by question in one process: every dev
question's first turn, 128 new tokens; tokens/s overall and per category, and on how many turns the two emit the same
tokens.

    python docs/benchmarks/2026-12-04-attention-in-place/ab_attention.py THREADS OUT.json
"""
import collections
import json
import sys
import time

import torch

from kangaroo_backends.loading import load_model
from kangaroo_backends.onnx_backend import OnnxBackend
from kangaroo_core.config import DecodeConfig
from kangaroo_core.engine import Engine, encode_prompt
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_policies.threshold import ThresholdPolicy

threads, out = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(threads)
model, tok, name = load_model(None)
config = DecodeConfig(exit_layer=2, max_new_tokens=128)
engines = {}
for label, attention in (("exported attention", "exported"), ("in-place attention", "auto")):
    backend = OnnxBackend(model, tok, 2, name, provider="cpu", weights="gguf", accuracy_level=4, attention=attention,
                          threads=threads, spinning="deep" if threads > 1 else "none", quiet=True)
    engines[label] = Engine(backend, None, ThresholdPolicy(), GreedyVerifier(), config)
questions = [json.loads(line) for line in open("kangaroo_data/specbench_dev.jsonl")]
stats = {k: collections.defaultdict(lambda: [0, 0.0]) for k in engines}
same = 0
for engine in engines.values():
    engine.generate_ids(encode_prompt(tok, "Hello there, how are you?"))  # export once, warm up
for i, q in enumerate(questions):
    ids = encode_prompt(tok, q["turns"][0])
    tokens = {}
    for label in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
        start = time.perf_counter()
        result = engines[label].generate_ids(ids)
        seconds = time.perf_counter() - start
        tokens[label] = result.token_ids
        for key in (q["category"], "all"):
            stats[label][key][0] += len(result.token_ids)
            stats[label][key][1] += seconds
    same += len(set(map(tuple, tokens.values()))) == 1
    print(i, q["category"], len(ids), {k: round(stats[k]["all"][0] / stats[k]["all"][1], 1) for k in engines})
results = {k: {c: {"tokens": v[0], "seconds": v[1], "tok_s": v[0] / v[1]} for c, v in s.items()}
           for k, s in stats.items()}
a, b = list(engines)
print("overall", {k: round(results[k]["all"]["tok_s"], 1) for k in results},
      "ratio", round(results[b]["all"]["tok_s"] / results[a]["all"]["tok_s"], 3), "same tokens", same, "/", len(questions))
json.dump({"threads": threads, "questions": len(questions), "turn": "first", "max_new_tokens": 128,
           "same_tokens": same, "results": results}, open(out, "w"), indent=1)
