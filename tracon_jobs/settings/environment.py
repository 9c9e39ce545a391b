"""The `TRACON_*` environment variables that are not settings, and the warning for one that
configures nothing: `TRACON_CIRCUITBREAKER__FAILURETHRESHOLD=0` (one underscore after the
prefix) overrides no setting, and used to be ignored without a word.

A setting is `TRACON__` and its path (`TRACON__CIRCUITBREAKER__FAILURETHRESHOLD`); a path that
names no setting already fails validation, so only the single-underscore names are checked
here: each must be one the project reads (`OTHER_VARIABLES`), a store URL shortcut, or a
variable a setting names (`ApiKeyEnv`, `SecretEnv`, ...). Any other is reported once per
process, at settings load, with the variable it probably means.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Iterator, Mapping

from tracon_jobs.settings.keys import normalize_key
from tracon_jobs.settings.sections import Settings

log = logging.getLogger("tracon_jobs.settings")

PREFIX = "TRACON_"
"""What every variable of the project's starts with."""

OTHER_VARIABLES: Mapping[str, str] = {
    "TRACON_CONFIG": "the configuration file",
    "TRACON_FAST_PATHS": "the fast paths' switch (tracon_jobs.fast_paths)",
    "TRACON_LOG_LEVEL": "the log level of every process",
    "TRACON_LOG_FORMAT": "text or json log lines (tracon_jobs.logs)",
    "TRACON_DRAIN_FILE": "the web node's drain flag (tracon_jobs.drain_file)",
    "TRACON_WEB_BIND": "the default of tracon-jobs web --bind",
    "TRACON_WEB_WORKERS": "the default of tracon-jobs web --workers",
    "TRACON_WEB_THREADS": "the default of tracon-jobs web --threads",
    "TRACON_WORKER_METRICS_PORT": "a worker's metrics port (tracon_jobs.metrics)",
    "TRACON_SECRET_KEY": "the console's session secret (web.console.session)",
    "TRACON_API_KEY": "a client's key in the docs' curl examples",
    "TRACON_TEST_POSTGRES_URL": "the test suite's PostgreSQL (tests/conftest.py)",
    "TRACON_TEST_REDIS_URL": "the test suite's Redis (tests/conftest.py)",
    "TRACON_TEST_BROKER": "the test suite's Celery broker, redis or amqp (tests/conftest.py)",
    "TRACON_TEST_PGBOUNCER": "the test suite's PostgreSQL through PgBouncer (tests/conftest.py)",
    "TRACON_TEST_FLAGS": "the test tools' and workflows' flag folder (tests/)",
    "TRACON_TEST_DEV_REVISION": "the revision the dev e2e test checks out (tests/e2e)",
    "TRACON_BENCH_POSTGRES": "the benchmarks' PostgreSQL (bench/)",
}
"""Every `TRACON_*` variable read by the project that is no setting, and what reads it (the
store URL shortcuts are `loading.ENV_SHORTCUTS`). A test holds this list to the names the
code, the tests and the docs spell."""

_warned: set[str] = set()
"""The variables this process has warned about: each once, however often settings load."""


def warn_of_unused_variables(
    environ: Mapping[str, str], settings: Settings, shortcuts: Iterable[str]
) -> None:
    """Log a warning (once per process and variable) for each `TRACON_*` variable of
    `environ` that configures nothing."""
    for name, meant in unused_variables(environ, settings, shortcuts):
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"did you mean {meant}?" if meant else NOTHING_READS_IT
        log.warning("environment variable %s configures nothing; %s", name, hint)


NOTHING_READS_IT = (
    "no process reads it, and it is no setting (a setting is TRACON__ and its keys joined by "
    "__: TRACON__DRAIN__ENABLED)"
)


def unused_variables(
    environ: Mapping[str, str], settings: Settings, shortcuts: Iterable[str]
) -> Iterator[tuple[str, str | None]]:
    """(variable, the variable it probably means or None) for each `TRACON_*` variable that
    overrides no setting and is read by nothing."""
    known = {*OTHER_VARIABLES, *shortcuts, *settings.named_variables()}
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(PREFIX) or upper.startswith(PREFIX + "_") or name in known:
            continue
        yield name, probably_meant(name, known)


def probably_meant(name: str, known: Iterable[str]) -> str | None:
    """The setting's variable when `name` lacks the second underscore before a section
    (`TRACON_DRAIN__ENABLED`), else the closest variable of `known` (`TRACON_LOGLEVEL`)."""
    rest = name[len(PREFIX) :]
    sections = {normalize_key(field.alias or key) for key, field in Settings.model_fields.items()}
    first = rest.split("__", 1)[0]
    if "__" in rest and normalize_key(first) in sections:
        return f"{PREFIX}_{rest}"
    candidates = {*known, *(f"{PREFIX}_{section.upper()}" for section in sections)}
    close = difflib.get_close_matches(name.upper(), sorted(candidates), n=1, cutoff=0.75)
    return close[0] if close else None
