"""Database URLs as tracon-jobs reads them: PostgreSQL always through psycopg 3, several
hosts for a failover, and psycopg's `prepare_threshold` for a pooler in transaction mode.

SQLAlchemy passes a PostgreSQL URL's hosts to psycopg, which tries them in order; with
`target_session_attrs=read-write` it skips a server that is a standby, so after a failover
the next connection finds the promoted one. SQLAlchemy reads two spellings of several hosts:

    postgresql+psycopg://user@/tracon?host=db1:5432&host=db2:5432&target_session_attrs=read-write
    postgresql+psycopg://user@/tracon?host=db1,db2&port=5432,5432&target_session_attrs=read-write

Two more are rewritten to the first: `?host=db1:5432,db2:5432` (SQLAlchemy would hand libpq
one host named `db1:5432`) and libpq's own URI, `postgresql://user@db1:5432,db2:5432/tracon`
(SQLAlchemy cannot parse its port). `check_url` refuses what would still connect somewhere
else than the operator meant: hosts and ports that do not pair up, a port that is no number,
an unknown `target_session_attrs`.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from sqlalchemy.engine import URL, make_url

POSTGRES_PREFIXES = ("postgresql://", "postgres://", "postgresql+psycopg2://")
"""Driver spellings of PostgreSQL that are read as `postgresql+psycopg://`."""

SESSION_ATTRS = ("any", "read-write", "read-only", "primary", "standby", "prefer-standby")
"""The values libpq takes for `target_session_attrs`."""

PREPARE_THRESHOLD = "prepare_threshold"
"""psycopg's option, which a URL may carry: `none` turns prepared statements off."""

_PREPARE_OFF = ("none", "null", "")


class UrlError(ValueError):
    """A database URL that would not connect where its operator meant it to."""


def normalize_url(url: str) -> str:
    """psycopg 3 for PostgreSQL whatever driver the URL names (or omits), and its hosts in
    a spelling SQLAlchemy passes on whole."""
    for prefix in POSTGRES_PREFIXES:
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix) :]
            break
    if not url.startswith("postgresql+psycopg://"):
        return url
    return _hosts_to_query(url)


def _hosts_to_query(url: str) -> str:
    """`user@h1:p1,h2:p2/db` and `?host=h1:p1,h2:p2` as `?host=h1:p1&host=h2:p2`, and
    `user@h1,h2/db` as `?host=h1,h2`; any other URL exactly as written."""
    parts = urlsplit(url)
    user, at, hosts = parts.netloc.rpartition("@")
    query = parse_qsl(parts.query, keep_blank_values=True)
    given = [value for key, value in query if key == "host"]
    if "," in hosts:
        netloc, listed = user + at, hosts
    elif len(given) == 1 and "," in given[0] and ":" in given[0]:
        netloc, listed = parts.netloc, given[0]
        query = [(key, value) for key, value in query if key != "host"]
    else:
        return url
    moved = listed.split(",") if ":" in listed else [listed]
    query = [("host", host) for host in moved] + query
    encoded = urlencode(query, safe=":,/")
    return urlunsplit((parts.scheme, netloc, parts.path, encoded, parts.fragment))


def check_url(url: str) -> str:
    """`url` when SQLAlchemy and psycopg will read it as written, else `UrlError` saying
    what is wrong (never quoting the URL: it may hold a password)."""
    try:
        parsed = make_url(normalize_url(url))
        port = parsed.port
    except Exception as exc:  # ArgumentError, ValueError (a port that is no number)
        raise UrlError(f"must be a SQLAlchemy database URL ({type(exc).__name__})") from exc
    if port is not None and not 0 < port < 65536:
        raise UrlError(f"has a port that is not a number from 1 to 65535: {port}")
    if parsed.get_backend_name() == "postgresql":
        _check_hosts(parsed)
        _check_options(parsed)
    return url


def _check_hosts(url: URL) -> None:
    """Several hosts as SQLAlchemy pairs them with their ports: `host=h:port` once per host,
    or `host=h1,h2` with `port=p1,p2`, never both."""
    hosts, ports = _values(url, "host"), _values(url, "port")
    if len(hosts) > 1 or (hosts and ":" in hosts[0]):  # host=h1:p1&host=h2:p2
        if ports:
            raise UrlError("gives ports both in `host=h:port` and in `port=`: keep one")
        ports = [host.partition(":")[2] for host in hosts]
    elif hosts:  # host=h1,h2&port=p1,p2
        listed = hosts[0].split(",")
        ports = ",".join(ports).split(",") if ports else []
        if ports and len(ports) != len(listed) and max(len(ports), len(listed)) > 1:
            raise UrlError(f"names {len(listed)} hosts and {len(ports)} ports: one port per host")
    for port in ports:
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise UrlError(f"has a port that is not a number from 1 to 65535: {port!r}")


def _check_options(url: URL) -> None:
    attrs = _values(url, "target_session_attrs")
    if attrs and attrs[-1] not in SESSION_ATTRS:
        raise UrlError(f"target_session_attrs must be one of {', '.join(SESSION_ATTRS)}")
    prepare = _values(url, PREPARE_THRESHOLD)
    if prepare and not (prepare[-1].lower() in _PREPARE_OFF or prepare[-1].isdigit()):
        raise UrlError(f"{PREPARE_THRESHOLD} must be a whole number or none")


def _values(url: URL, key: str) -> list[str]:
    value = url.query.get(key)
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def prepare_threshold(url: str) -> tuple[str, int | None, bool]:
    """`url` without psycopg's `prepare_threshold`, the threshold it gave, and whether it
    gave one (SQLAlchemy would pass the text to psycopg, which compares it with a count)."""
    parsed = make_url(url)
    given = _values(parsed, PREPARE_THRESHOLD)
    if not given:
        return url, None, False
    rest = parsed.difference_update_query([PREPARE_THRESHOLD])
    value = given[-1].lower()
    threshold = None if value in _PREPARE_OFF else int(value)
    return rest.render_as_string(hide_password=False), threshold, True
