"""The web console through Flask's test client: a tenant signed in, the session's CSRF token,
and a page's text without its markup."""

from __future__ import annotations

import html
import re

from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from tracon_jobs.runtime import Runtime
from web import create_app


def signed_in(runtime: Runtime, tenant: str) -> FlaskClient:
    """A client of the console signed in with a new key of `tenant`."""
    client = create_app(runtime, {"TESTING": True, "SECRET_KEY": "s"}).test_client()
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant(tenant)).secret
    answer = client.post("/signin", data={"key": key, "csrf_token": token_of(client, "/signin")})
    assert answer.status_code in (302, 303)
    return client


def token_of(client: FlaskClient, path: str) -> str:
    """The CSRF token of the session, from a form of the page at `path`."""
    found = re.search(r'name="csrf_token" value="([^"]+)"', client.get(path).get_data(as_text=True))
    assert found is not None
    return found.group(1)


def text(response: TestResponse) -> str:
    """The page's text, its tags dropped and its whitespace collapsed."""
    page = response.get_data(as_text=True)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())
