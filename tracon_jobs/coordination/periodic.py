"""Periodic task bodies under singleton leases, without losing passes.

Beat sends each tick to whichever worker takes it from the control queue. With
`SingletonExecution` on, only the lease owner may run the body; a worker that is not the
owner forwards the tick to the owner's own queue (Celery's `worker_direct`), named by a
route the owner advertises next to its lease, so every tick runs once, in the owner. A
tick is forwarded at most once; with no known owner it is skipped (the next tick elects
one). With `SingletonExecution` off, every worker that receives a tick runs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from celery import Task
from celery.utils.nodenames import worker_direct

if TYPE_CHECKING:
    from tracon_jobs.runtime import Runtime

log = logging.getLogger(__name__)

T = TypeVar("T")


def route_key(name: str) -> str:
    return f"tracon:lease-route:{{{name}}}"


def run_periodic(
    runtime: Runtime, task: Task, name: str, forwarded: bool, body: Callable[[], T]
) -> T | dict[str, Any] | None:
    leases = runtime.leases
    if leases.is_owner(name):
        _advertise(runtime, name, task.request.hostname, leases.ttl_ms)
        return body()
    owner = None if forwarded else _route(runtime, name)
    if owner is None:
        log.debug("%s: not the owner and no owner to forward to; pass skipped", name)
        return None
    task.apply_async(
        kwargs={"forwarded": True}, queue=worker_direct(owner), expires=leases.ttl_ms / 1000
    )
    return {"forwardedTo": owner}


def _advertise(runtime: Runtime, name: str, hostname: str | None, ttl_ms: int) -> None:
    if not hostname or not runtime.settings.singleton_execution.enabled:
        return
    try:
        runtime.redis.set(route_key(name), hostname, px=ttl_ms)
    except redis.RedisError as exc:
        log.warning("lease route of %s not advertised: %s", name, exc)


def _route(runtime: Runtime, name: str) -> str | None:
    try:
        value = runtime.redis.get(route_key(name))
    except redis.RedisError:
        return None
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)
