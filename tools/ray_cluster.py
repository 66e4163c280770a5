"""Reaching Ray: a local instance started for one command, or a running cluster joined by its address.

Ray is an optional extra (kangaroo's ``[ray]`` extra, ``pip install 'ray[serve]'``): nothing below the applications imports it at
module level, so the core, the CLI's help and every command without ``--ray`` run without it.

Addresses (``--ray ADDRESS``): ``local`` (or the flag alone) starts a private instance on this machine with the CPUs
asked for and stops it when the command ends; ``auto`` joins the cluster this machine belongs to (``ray start``);
``ray://HOST:10001`` joins a cluster through its Ray Client port; ``HOST:6379`` joins as a driver on a cluster node.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import attrs

from kangaroo_core.errors import KangarooError, MissingDependencyError

LOCAL = "local"
INSTALL_HINT = "pip install 'ray[serve]' (kangaroo's [ray] extra)"


def import_ray():
    """The ``ray`` module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(f"--ray and --replicas need the [ray] extra ({exc.name} is missing): "
                                     f"{INSTALL_HINT}") from None
    return ray


@attrs.frozen
class RaySession:
    """Where the work runs: ``started`` is False when the command joined a cluster (or a test's instance)."""

    address: str
    started: bool
    seconds: float  # wall time to start or join
    cpus: float  # CPUs the cluster offers


@contextmanager
def ray_session(address: str | None, *, num_cpus: int | None = None, log=None) -> Iterator[RaySession]:
    """Start a local Ray instance (``address`` None or ``local``; ``num_cpus`` logical CPUs, default all) or join
    ``address``; shut down on exit only what this call started or joined. An instance this process already runs
    (a test's) is used as it is."""
    ray = import_ray()
    if ray.is_initialized():
        yield RaySession("existing", False, 0.0, ray.cluster_resources().get("CPU", 0.0))
        return
    local = address in (None, "", LOCAL)
    began = time.perf_counter()
    try:
        if local:
            # no dashboard (an HTTP server nobody asked for); a small object store: results are token ids, or
            # feature shards of tens of MB (Ray spills to disk past it)
            ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=256 * 1024 * 1024,
                     logging_level=logging.WARNING)
        else:
            ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
        where = "start a local Ray instance" if local else f"reach the Ray cluster at {address}"
        raise KangarooError(f"could not {where}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    session = RaySession(LOCAL if local else address, True, time.perf_counter() - began,
                         ray.cluster_resources().get("CPU", 0.0))
    if log is not None:
        what = "started a local Ray instance" if local else f"joined the Ray cluster at {address}"
        log(f"kangaroo: {what} in {session.seconds:.1f} s ({session.cpus:g} CPUs)")
    try:
        yield session
    finally:
        ray.shutdown()


def failure_reason(exc: BaseException) -> str:
    """One line saying why a remote call failed: the worker's own exception when Ray carried it back (a method's
    error, or the constructor's: the model that could not load), else Ray's first line (a process that died)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):  # a RayTaskError: the method raised this
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if "creation task" in lines[0]:  # the constructor raised: Ray's text ends with "module.Error: message"
        name, _, message = lines[-1].partition(": ")
        return f"{name.rsplit('.', 1)[-1]}: {message}" if message else lines[-1]
    return lines[0]

