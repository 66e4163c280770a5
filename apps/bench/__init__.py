"""``kangaroo bench``: Spec-Bench-style measurements of every bench method on the same questions, in one run.

* :mod:`kangaroo_core.bench_context` — the :class:`BenchMethod` extension point, :class:`MethodResult`, :class:`BenchContext`;
* :mod:`kangaroo_apps.bench.questions` — loading Spec-Bench JSONL;
* :mod:`kangaroo_apps.bench.harness` — the interleaved run and the metrics;
* :mod:`kangaroo_apps.bench.report` — ``results.json``, ``results.md``, plots, sweep outputs.

Built-in methods (``hf_vanilla``, ``hf_prompt_lookup``, ``hf_early_exit``, ``vanilla``, ``kangaroo``) are a plugin,
:mod:`kangaroo_plugins.bench_methods`; others register through the ``register_bench_methods`` hook.
"""
