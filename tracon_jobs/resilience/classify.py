"""Which provider failures count against a circuit, and which move to the next fallback link.

    failure                              counts for the breaker   falls back
    no connection, timeout               yes                      yes
    5xx, 408, 429                        yes                      yes
    401, 403                             yes                      no  (a bad key fails everyone)
    any other 4xx (400, 404, 422, ...)   no                       no  (the request is wrong)
    circuit already open                 no                       yes
    caller cancellation                  no                       no
    content blocked by the provider      no                       no
    configuration (unknown provider)     no                       no
    unreadable (no status, not ours)     yes (as a connection)    yes

The status comes from `ProviderError.status`, or from an `HTTP nnn` in the message of an
exception we did not map; a registered classifier may override the fallback decision for a
specific SDK exception type without replacing these rules.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tracon_jobs.errors import ProviderError

_HTTP_STATUS = re.compile(r"\bHTTP (\d{3})\b")

Classifier = Callable[[BaseException], bool | None]
"""Returns True (fall back), False (do not), or None (let the built-in rules decide)."""


@dataclass(frozen=True)
class Verdict:
    counts: bool  # a failure that shows the provider is unhealthy
    transient: bool  # worth trying the next fallback link


_classifiers: dict[type[BaseException], Classifier] = {}
_lock = threading.Lock()


def register_classifier(exception_type: type[BaseException], classifier: Classifier) -> None:
    """Override the fallback decision for one SDK exception type (and its subclasses)."""
    with _lock:
        _classifiers[exception_type] = classifier


def unregister_classifier(exception_type: type[BaseException]) -> None:
    with _lock:
        _classifiers.pop(exception_type, None)


def status_of(exc: BaseException) -> int | None:
    if isinstance(exc, ProviderError) and exc.status is not None:
        return exc.status
    match = _HTTP_STATUS.search(str(exc))
    return int(match.group(1)) if match else None


def classify(exc: BaseException) -> Verdict:
    verdict = _built_in(exc)
    override = _override(exc)
    return verdict if override is None else Verdict(verdict.counts, override)


def _built_in(exc: BaseException) -> Verdict:
    kind = exc.kind if isinstance(exc, ProviderError) else None
    if kind in ("cancelled", "content_blocked", "configuration"):
        return Verdict(counts=False, transient=False)
    if kind == "unavailable":
        return Verdict(counts=False, transient=True)
    status = status_of(exc)
    if status is None:  # connection, timeout, or a failure we cannot read
        return Verdict(counts=True, transient=True)
    return by_status(status)


def by_status(status: int) -> Verdict:
    if status >= 500 or status in (408, 429):
        return Verdict(counts=True, transient=True)
    if status in (401, 403):
        return Verdict(counts=True, transient=False)
    return Verdict(counts=False, transient=False)


def _override(exc: BaseException) -> bool | None:
    """Consult classifiers for the exception and the SDK exception it wraps."""
    with _lock:
        classifiers = list(_classifiers.items())
    for candidate in (exc, exc.__cause__):
        if candidate is None:
            continue
        for exception_type, classifier in classifiers:
            if isinstance(candidate, exception_type):
                decision = classifier(candidate)
                if decision is not None:
                    return decision
    return None
