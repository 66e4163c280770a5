"""A pool of model-holding Ray workers for the offline passes over the corpus: answering its shards
(:mod:`kangaroo_tools.corpus_ray`) and recomputing features from it (:func:`kangaroo_tools.features.corpus_feature_shards`).

Each worker is a Ray actor that loads the model once and takes one job at a time; the driver (the command's process)
hands out the jobs, receives the results and does all the writing, so workers never share a directory and no result
is written twice. A worker that dies mid-job (killed, out of memory, its node lost) loses only that job: Ray restarts
the actor (reloading the model, up to ``max_restarts`` times) and the driver hands the job out again. A worker that
cannot load the model, or loads another model than the others, stops the pass in one line before any job starts.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator

from kangaroo_core.errors import KangarooError
from kangaroo_tools.ray_cluster import failure_reason, import_ray

#: times one job is handed out before the pass gives up on it (a job that kills every worker it meets)
MAX_ATTEMPTS = 3


class ModelWorker:
    """One Ray actor: the model loaded once. ``make_engine`` builds the engine (a picklable callable: the command's
    flags, built again on the worker's node) with ``threads`` torch threads."""

    def __init__(self, make_engine: Callable, threads: int):
        import torch

        from kangaroo_tools.corpus import ModelFacts

        torch.set_num_threads(threads)  # before the model loads: one worker's share of the node's cores
        self.engine = make_engine()  # several workers converting one GGUF at once: loading.py takes the first
        self.model = ModelFacts.of(self.engine.backend)

    def facts(self):
        return self.model, os.getpid()

    def answer(self, job, settings, batch_size: int):
        """One corpus shard: :func:`kangaroo_tools.corpus.answer_shard`, the in-process build's own function."""
        from kangaroo_tools.corpus import answer_shard

        return answer_shard(self.engine, job, settings, batch_size)

    def features(self, sequences, prompt_lengths, layers, top_k, matmul_dtype):
        """One feature shard: :func:`kangaroo_tools.features.extract_features` on this worker's model."""
        from kangaroo_tools.features import extract_features

        return extract_features(self.engine.backend.base_model(), sequences, prompt_lengths, layers, top_k,
                                matmul_dtype)


class WorkerPool:
    """``workers`` :class:`ModelWorker` actors of ``threads`` threads, each reserving ``num_cpus`` (default
    ``threads``) CPUs and ``num_gpus`` GPUs, on the Ray instance this process is connected to. Use as a context
    manager: the actors (and their models) go when it ends."""

    def __init__(self, make_engine: Callable, *, workers: int, threads: int, max_restarts: int = 2,
                 num_cpus: float | None = None, num_gpus: float = 0):
        if workers < 1 or threads < 1:
            raise KangarooError(f"need at least one worker of at least one thread, got {workers} x {threads}")
        ray = import_ray()
        self.workers, self.threads, self.max_restarts = workers, threads, max_restarts
        actor = ray.remote(ModelWorker).options(num_cpus=threads if num_cpus is None else num_cpus,
                                                num_gpus=num_gpus, max_restarts=max_restarts, max_task_retries=0)
        self.began = time.perf_counter()
        self.actors = [actor.remote(make_engine, threads) for _ in range(workers)]
        self.model = None
        self.load_seconds = None
        self.redone = 0  # jobs handed out again after their worker died

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        ray = import_ray()
        for actor in self.actors:
            ray.kill(actor)  # the models go with them; a job still running is dropped (its result was not taken)
        self.actors = []

    def check(self, error: type[KangarooError] = KangarooError, nothing: str = "nothing was written"):
        """Wait for every worker to load its model; the model they all hold (a
        :class:`~kangaroo_tools.corpus.ModelFacts`), or ``error`` in one line saying why not."""
        ray = import_ray()
        facts = []
        for ref in [a.facts.remote() for a in self.actors]:
            try:
                facts.append(ray.get(ref)[0])
            except ray.exceptions.RayError as exc:
                raise error(f"a Ray worker could not load the model: {failure_reason(exc)} ({nothing})") from None
        if len({f.fingerprint for f in facts}) > 1:
            held = ", ".join(sorted({f"{f.model_name} ({f.fingerprint})" for f in facts}))
            raise error(f"the Ray workers loaded different models: {held} ({nothing}); give every node the same model")
        self.model, self.load_seconds = facts[0], time.perf_counter() - self.began
        return self.model

    def run(self, jobs: Iterable, call: Callable, *, name: Callable = str, error: type[KangarooError] = KangarooError,
            stop: Callable[[], bool] = lambda: False, on_dispatch: Callable | None = None, log=print) -> Iterator:
        """Hand out ``jobs`` (``call(actor, job)`` submits one and returns its object ref), one at a time per idle
        worker; yield ``(job, result)`` as each finishes, in finishing order. A job whose worker died goes back to
        the front of the queue. ``stop()`` true: no more jobs are handed out, those running finish."""
        ray = import_ray()
        queue = collections.deque(jobs)
        attempts: collections.Counter = collections.Counter()
        deaths: collections.Counter = collections.Counter()
        idle, running = list(self.actors), {}  # running: object ref -> (actor, job)
        while queue or running:
            while idle and queue and not stop():
                actor, job = idle.pop(0), queue.popleft()
                attempts[name(job)] += 1
                running[call(actor, job)] = (actor, job)
                if on_dispatch is not None:
                    on_dispatch(job, actor)
            if not running:
                return
            [ref], _ = ray.wait(list(running), num_returns=1)
            actor, job = running.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as exc:  # the worker died: Ray restarts it, the job goes back
                deaths[actor] += 1
                reason = failure_reason(exc)
                if attempts[name(job)] >= MAX_ATTEMPTS:
                    raise error(f"{name(job)}: {MAX_ATTEMPTS} Ray workers died on it (last: {reason}); every "
                                "finished result is kept") from None
                log(f"kangaroo: a Ray worker died on {name(job)} ({reason}); it is redone")
                self.redone += 1
                queue.appendleft(job)
                if deaths[actor] <= self.max_restarts:  # restarted by Ray (reloading the model); calls wait for it
                    idle.append(actor)
                elif not idle and not running:
                    raise error(f"every Ray worker died; {len(queue)} jobs left (rerun to resume)") from None
                continue
            except ray.exceptions.RayTaskError as exc:  # the job itself failed: not a worker's death
                raise error(f"{name(job)} failed on a Ray worker: {failure_reason(exc)}") from None
            idle.append(actor)
            yield job, result


def stop_after(deadline: float | None, log=print) -> Callable[[], bool]:
    """A ``stop`` for :meth:`WorkerPool.run`: true once ``deadline`` (a ``time.time()`` value) has passed (said once)."""
    said = []

    def stop() -> bool:
        if deadline is None or time.time() <= deadline:
            return False
        if not said:
            said.append(log("deadline reached; the jobs in progress finish, every finished result is kept"))
        return True

    return stop



class LazyPool:
    """A pool started on first use: ``opener(stack)`` starts it (and whatever it needs, e.g. a Ray session) on an
    ``ExitStack`` that :meth:`close` unwinds. A pass whose results are all on disk already starts no worker."""

    def __init__(self, opener: Callable[[contextlib.ExitStack], WorkerPool]):
        self.opener, self.pool, self.stack = opener, None, contextlib.ExitStack()

    def get(self) -> WorkerPool:
        if self.pool is None:
            self.pool = self.opener(self.stack)
        return self.pool

    def close(self) -> None:
        self.pool = None
        self.stack.close()
