"""The self-distilled corpus on Ray: the same shards as :func:`kangaroo_tools.corpus.build`, answered by a pool of
model-holding Ray workers (``kangaroo corpus build --ray``, :class:`~kangaroo_tools.ray_pool.WorkerPool`).

Each worker answers whole shards with :func:`~kangaroo_tools.corpus.answer_shard`, the very function of the
in-process build, so a shard's answers do not depend on where it ran. The driver (the command's process) owns the
corpus directory: it reads the prompts, plans the shards, and writes every finished shard atomically and records it
in the manifest. Workers never touch the directory (on a cluster they could not), so no shard is written twice, and
a rerun resumes from the manifest exactly as the in-process build does. A worker that cannot load the model stops the
build before anything is written; one that dies mid-shard costs that shard only (it is answered again).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kangaroo_tools.corpus import SPLITS, Corpus, CorpusError, CorpusSettings, pending, save_shard
from kangaroo_tools.ray_pool import WorkerPool, stop_after


def build_on_ray(corpus: Corpus, make_engine: Callable, prompts_file: str | Path,
                 settings: CorpusSettings = CorpusSettings(), *, workers: int = 2, threads: int = 1,
                 max_train_shards: int | None = None, batch_size: int = 8, deadline: float | None = None,
                 progress: bool = True, log=print, splits: Sequence[str] = SPLITS, max_restarts: int = 2,
                 num_cpus: float | None = None, num_gpus: float = 0, on_dispatch: Callable | None = None) -> dict:
    """:func:`kangaroo_tools.corpus.build` on ``workers`` Ray workers of ``threads`` torch threads each, on the Ray
    instance this process is connected to (:func:`kangaroo_tools.ray_cluster.ray_session`); ``make_engine`` builds
    the target-alone engine on each worker. ``on_dispatch(job, actor)`` is called as each shard is handed out.
    Returns :meth:`Corpus.summary` with a ``ray`` entry: workers, shards answered and redone, load and answer times."""
    from tqdm.auto import tqdm

    with WorkerPool(make_engine, workers=workers, threads=threads, max_restarts=max_restarts, num_cpus=num_cpus,
                    num_gpus=num_gpus) as pool:
        facts = pool.check(CorpusError)
        manifest, todo = pending(corpus, prompts_file, settings, facts, max_train_shards=max_train_shards,
                                 splits=splits, log=log)
        loaded = time.perf_counter()
        bar = tqdm(total=len(todo), desc=f"corpus shards ({workers} Ray workers)", unit="shard", disable=not progress)
        finished = pool.run(todo, lambda actor, job: actor.answer.remote(job, settings, batch_size),
                            name=lambda job: job.name, error=CorpusError, stop=stop_after(deadline, log),
                            on_dispatch=on_dispatch, log=log)
        for job, (records, entry) in finished:
            save_shard(corpus, manifest, job, records, {**entry, "worker": "ray"}, facts.vocab_size)
            bar.update(1)
            bar.set_postfix(tok_s=f"{entry['answer_tokens_per_second']:.1f}")
        bar.close()
        answered = time.perf_counter()
    # load: workers started until every model is loaded; answer: from there until the last shard was written
    return {**corpus.summary(), "ray": {"workers": workers, "threads_per_worker": threads,
                                        "shards_answered": len(todo), "shards_redone": pool.redone,
                                        "load_seconds": round(pool.load_seconds, 2),
                                        "answer_seconds": round(answered - loaded, 2)}}
