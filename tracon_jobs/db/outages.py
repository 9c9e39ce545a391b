"""Riding out a database that stops answering for a while (a restart, a failover).

The executor's reads and writes are wrapped in `rides_out_outages`: a transaction that
fails because the connection dropped or the server refused it is tried again, with backoff,
until `Database.OutageRetry` has passed. The run keeps its claim all along (every write is
still fenced), so when the database is back the run goes on where it stopped: a tool whose
body finished has its outcome written then, never reported "in flight".
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
FIRST_WAIT = 0.05
LONGEST_WAIT = 2.0


class HasOutageRetry(Protocol):
    outage_retry_seconds: float


def transient(error: BaseException) -> bool:
    """A dropped connection or a server that does not answer, not a broken statement."""
    if isinstance(error, DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, OperationalError | InterfaceError)


def retry_outages(
    db: HasOutageRetry,
    call: Callable[[], Any],
    what: str,
    landed: Callable[[], Any] | None = None,
) -> Any:
    """`call()`, tried again on a transient database error until the outage budget is spent.

    A try that failed on the connection may have committed all the same (a primary that fails
    over as it commits: the promoted replica has the write, the client only the error).
    `landed()`, asked before each try after such a failure, finds what an earlier try wrote:
    when it answers (not None), that is the outcome, and the write is not made again."""
    deadline = time.monotonic() + db.outage_retry_seconds
    wait = FIRST_WAIT
    lost = False
    while True:
        try:
            if lost and landed is not None:
                found = landed()
                if found is not None:
                    log.warning("%s had committed before the database failed; it stands", what)
                    return found
            return call()
        except (OperationalError, InterfaceError, DBAPIError) as exc:
            if not transient(exc) or time.monotonic() + wait > deadline:
                raise
            lost = True
            log.warning("database unavailable during %s; retrying in %.2fs: %s", what, wait, exc)
            time.sleep(wait)
            wait = min(wait * 2, LONGEST_WAIT)


def rides_out_outages(method: F) -> F:
    """For a method of an object with a `db`: retry the whole method (one transaction) on a
    transient database error, for as long as `db.outage_retry_seconds`."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return retry_outages(self.db, lambda: method(self, *args, **kwargs), method.__name__)

    return cast(F, wrapper)
