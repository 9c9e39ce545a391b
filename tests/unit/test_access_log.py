"""The web's access log never shows a one-time approval link's token: the request line, the
path and the referrer show `/approvals/links/<redacted>`; other paths are as they were."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

from gunicorn.config import Config

from tracon_jobs.cli.processes import RedactingLogger

TOKEN = "ODYzMjA5YzQtZGVtby10b2tlbi5TNjEw"


def atoms(path: str, referrer: str = "-") -> dict[str, object]:
    logger = RedactingLogger(Config())
    environ = {
        "REQUEST_METHOD": "GET",
        "RAW_URI": path,
        "PATH_INFO": path.partition("?")[0],
        "QUERY_STRING": path.partition("?")[2],
        "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_REFERER": referrer,
    }
    request = SimpleNamespace(headers=[("Referer", referrer)])
    response = SimpleNamespace(status="200 OK", sent=10, headers=[])
    return dict(logger.atoms(response, request, environ, datetime.timedelta(milliseconds=3)))


def test_a_links_token_is_redacted_in_the_request_line_path_and_referrer() -> None:
    shown = atoms(f"/approvals/links/{TOKEN}?x=1", referrer=f"https://h/approvals/links/{TOKEN}")
    assert shown["r"] == "GET /approvals/links/<redacted>?x=1 HTTP/1.1"
    assert shown["U"] == "/approvals/links/<redacted>"
    assert shown["f"] == shown["{referer}i"] == "https://h/approvals/links/<redacted>"
    assert shown["{raw_uri}e"] == "/approvals/links/<redacted>?x=1"
    assert TOKEN not in repr(shown)


def test_other_paths_are_logged_as_they_are() -> None:
    shown = atoms("/api/runs/5f1c?limit=5")
    assert shown["r"] == "GET /api/runs/5f1c?limit=5 HTTP/1.1"
    assert shown["U"] == "/api/runs/5f1c" and shown["s"] == "200"
