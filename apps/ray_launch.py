"""``--ray`` for the commands: ``kangaroo corpus build --ray`` and ``kangaroo serve --replicas N [--ray ADDRESS]``.

The command's flags become a picklable recipe (:func:`engine_of` over :class:`EngineOptions`) that every worker or
replica builds its engine from on its own node; a local instance is sized to the workers asked for, a cluster is
joined as it is (docs/scaling.md).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import attrs

from kangaroo_apps.cli_options import EngineOptions
from kangaroo_tools.ray_cluster import LOCAL, ray_session


def engine_of(options: EngineOptions, vanilla: bool = False):
    """The engine ``options`` describe (run on a worker or replica: the flags, loaded there)."""
    return options.engine(vanilla=vanilla)


def portable(options: EngineOptions, threads: int) -> EngineOptions:
    """``options`` for a worker: ``threads`` torch threads, and local model/adapter paths made absolute (a worker's
    working directory is not the command's)."""

    def absolute(path: str | None) -> str | None:
        return str(Path(path).expanduser().resolve()) if path and Path(path).expanduser().exists() else path

    return attrs.evolve(options, threads=threads, model=absolute(options.model), adapter=absolute(options.adapter))


def _is_local(address: str | None) -> bool:
    return address in (None, "", LOCAL)


def _gpus(options: EngineOptions) -> float:
    return 1 if (options.device or "cpu").strip().lower().startswith("cuda") else 0


def corpus_on_ray(address: str, options: EngineOptions, corpus, prompts_file, settings, *, workers: int | None,
                  threads: int, log, **build_kwargs) -> dict:
    """``kangaroo corpus build --ray``: :func:`kangaroo_tools.corpus_ray.build_on_ray` on a local instance of
    ``workers`` x ``threads`` CPUs (default: this machine's CPUs) or on the cluster at ``address``."""
    from kangaroo_tools.corpus_ray import build_on_ray

    if _is_local(address) and workers is None:
        workers = max(1, (os.cpu_count() or 1) // threads)
    with ray_session(address, num_cpus=(workers * threads if _is_local(address) else None), log=log) as session:
        if workers is None:
            workers = max(1, int(session.cpus // threads))
        if workers * threads > session.cpus and not _gpus(options):
            log(f"kangaroo: {workers} workers x {threads} threads reserve {workers * threads} CPUs but the Ray "
                f"cluster offers {session.cpus:g}: the others wait for CPUs")
        make_engine = functools.partial(engine_of, portable(options, threads), True)
        summary = build_on_ray(corpus, make_engine, prompts_file, settings, workers=workers, threads=threads, log=log,
                               num_gpus=_gpus(options), **build_kwargs)
        summary["ray"]["start_seconds"] = round(session.seconds, 2)
        return summary


def pool_on_ray(address: str, options: EngineOptions, *, workers: int | None, threads: int, log):
    """A :class:`~kangaroo_tools.ray_pool.LazyPool` of ``workers`` x ``threads`` target-alone workers: the Ray
    session and the workers start on first use and stop when it closes (``train-adapter --corpus DIR --ray``)."""
    from kangaroo_tools.ray_pool import LazyPool, WorkerPool

    def start(stack):
        count = workers
        if count is None and _is_local(address):
            count = max(1, (os.cpu_count() or 1) // threads)
        session = stack.enter_context(ray_session(address, num_cpus=(count * threads if _is_local(address) else None),
                                                  log=log))
        count = count or max(1, int(session.cpus // threads))
        make_engine = functools.partial(engine_of, portable(options, threads), True)
        pool = stack.enter_context(WorkerPool(make_engine, workers=count, threads=threads, num_gpus=_gpus(options)))
        pool.check(nothing="no feature was computed")
        log(f"kangaroo: {count} Ray workers x {threads} thread(s) compute the features")
        return pool

    return LazyPool(start)


def serve_on_ray(address: str | None, options: EngineOptions, *, replicas: tuple[int, int], host: str, port: int,
                 queue_size: int, max_batch: int, served_model_name: str | None, max_request_bytes: int,
                 log_level: str, log) -> None:
    """``kangaroo serve --replicas``: deploy the replicas, then run the OpenAI-compatible front here until stopped."""
    import uvicorn

    from kangaroo_apps.serve.dispatch import deploy_replicas, replica_app, shutdown_replicas

    threads = options.threads or 1
    low, high = replicas
    with ray_session(address, num_cpus=(high * threads if _is_local(address) else None), log=log):
        make_engine = functools.partial(engine_of, portable(options, threads), False)
        log(f"kangaroo: starting {low if low == high else f'{low} to {high}'} engine replicas of {threads} thread{'s' if threads > 1 else ''} each")
        handle = deploy_replicas(make_engine, replicas=replicas, threads=threads, queue_size=queue_size,
                                 max_batch=max_batch, num_gpus=_gpus(options))
        try:
            app = replica_app(handle, replicas=high, model_id=served_model_name, queue_size=queue_size,
                              max_batch=max_batch, max_request_bytes=max_request_bytes)
            log(f"kangaroo: serving {app.state.model_id} on http://{host}:{port}/ from {high if low == high else f'{low}-{high}'} "
                "replicas (OpenAI API under /v1, live page at /)")
            uvicorn.run(app, host=host, port=port, log_level=log_level)
        finally:
            shutdown_replicas()

