"""The one switch of every fast path: code that reads or replaces another project's internals
for speed alone.

`TRACON_FAST_PATHS=off` turns every one of them off at once, in every process that reads it
(web, worker, beat, the command line): each place then takes the library's own public path,
which does the same thing, slower. `off:<name>,<name>` turns off only those (to measure one
against the rest). CI runs the real-process suite with every fast path off, so the two paths
are proven equivalent by the same tests. What each one replaces, the library versions it was
written against, the test that proves it and what it gains: `docs/internals.md`.

What reads other projects' internals for correctness (an abortable socket, problem+json
answers to gunicorn's own errors, a drain's stop) is not behind this switch: without it the
behaviour would be wrong, not slower. Those places are listed in the same table.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from tracon_jobs.errors import ConfigurationError

ENV_VAR = "TRACON_FAST_PATHS"

NAMES = {
    "broker": "kombu's Redis channel: one client per channel, acks and batched takes in Lua",
    "envelope": "a run's Celery message built once and pushed with one LPUSH (not send_task)",
    "sqlite": "the run store's hot statements straight on the SQLite driver (not SQLAlchemy)",
    "redis": "scripts and pushes on a connection the thread keeps (not redis-py's client path)",
}
"""Each fast path, by the name `off:` takes."""


def read(environ: Mapping[str, str]) -> frozenset[str]:
    """The fast paths `environ` turns off (none unless the variable says so)."""
    value = environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "on"):
        return frozenset()
    if value == "off":
        return frozenset(NAMES)
    names = value.removeprefix("off:").split(",") if value.startswith("off:") else None
    if names is None or not all(name.strip() in NAMES for name in names):
        raise ConfigurationError(
            ENV_VAR,
            f"must be 'on', 'off' or 'off:' and a comma-separated list of "
            f"{', '.join(NAMES)}; not {value!r}",
        )
    return frozenset(name.strip() for name in names)


@functools.cache
def _off() -> frozenset[str]:
    return read(os.environ)


def enabled(name: str) -> bool:
    """Whether this process takes the fast path `name`: its environment, read once (a forked
    child has the same environment); startup (`load_settings`) refuses a value it cannot read."""
    assert name in NAMES, name
    return name not in _off()
