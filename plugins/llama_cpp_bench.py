"""``llama_cpp``: the peer, llama.cpp (llama-cpp-python) decoding the same GGUF file, measured in the same bench run.

An optional extra (kangaroo's ``[llama-cpp]`` extra, ``pip install llama-cpp-python``, which builds llama.cpp from source: minutes); not
installed by ``make test``. It runs greedy decoding on the GGUF file the bench's model was loaded from, with the same
prompt token ids as every other method and as many threads as torch uses, and reports whether its tokens equal
``hf_vanilla``'s like every method (llama.cpp computes with its own activation quantization: a near-tie can differ).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from kangaroo_core.bench_context import BenchContext, BenchMethod, Messages, MethodResult
from kangaroo_core.errors import KangarooError, MissingDependencyError
from kangaroo_core.hookspecs import hookimpl


class LlamaCpp(BenchMethod):
    """Greedy llama.cpp on the GGUF file (batch 1, one token per forward pass)."""

    name = "llama_cpp"
    rank = 20

    def __init__(self, n_ctx: int = 4096, threads: int | None = None):
        self.n_ctx, self.threads = int(n_ctx), threads

    def prepare(self, context: BenchContext) -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise MissingDependencyError("llama_cpp needs llama-cpp-python: pip install llama-cpp-python (kangaroo's [llama-cpp] extra)") from None
        from kangaroo_backends.loading import gguf_source

        if not context.config.sampling.greedy:
            raise KangarooError("llama_cpp is measured greedy only")
        path = gguf_source(context.model) if context.model is not None else None
        if path is None or not path.is_file():
            raise KangarooError("llama_cpp needs the bench's model to be a GGUF file (--model FILE.gguf or the default)")
        threads = self.threads or torch.get_num_threads()
        self.llm = Llama(model_path=str(path), n_ctx=self.n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False, logits_all=False)
        self.context = context
        self.eos = context.eos_token_ids | {self.llm.token_eos()}

    def run(self, messages: Messages, max_new_tokens: int) -> MethodResult:
        prompt = self.context.encode(messages)
        self.llm.reset()
        out: list[int] = []
        start = time.perf_counter()
        for token in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in self.eos or len(out) >= max_new_tokens:
                break
        seconds = time.perf_counter() - start
        return MethodResult(token_ids=out, seconds=seconds)  # one token per pass: not a drafting method (CR: –)

    def build(self) -> str:
        """llama-cpp-python's version and the instruction sets its llama.cpp was built with (``make llama-cpp-avx2``
        builds one without AVX-512, for the forced-AVX2 runs); flagged when kangaroo's paths are capped at AVX2 and
        this build is not."""
        import llama_cpp

        from kangaroo_core.machine import forced_paths

        features = llama_cpp.llama_print_system_info().decode(errors="replace").strip().strip("|").strip()
        line = f"llama-cpp-python {llama_cpp.__version__} ({Path(llama_cpp.__file__).parent}): {features}"
        if "avx2" in forced_paths().lower() and "AVX512 = 1" in features:
            line += " · NOT capped at AVX2 (make llama-cpp-avx2, then PYTHONPATH=.llama-cpp-avx2)"
        return line


@hookimpl
def register_bench_methods(register: Any) -> None:
    register("llama_cpp", LlamaCpp)
