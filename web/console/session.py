"""Who is signed in to the console: a signed session cookie that names a tenant and the public
id of the API key that signed in, never the key itself, plus a per-session CSRF token.

Every request re-checks that the key still exists, belongs to the tenant and is not revoked,
so revoking a key signs its console sessions out. The cookie is HttpOnly, SameSite=Lax, and
Secure whenever the request came over https.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets

from flask import Flask, Request, g, request, session
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface

from web.extensions import runtime

COOKIE_NAME = "tracon_console"
SECRET_ENV = "TRACON_SECRET_KEY"

log = logging.getLogger(__name__)


class ConsoleSessionInterface(SecureCookieSessionInterface):
    """Flask's signed cookie, marked Secure per request rather than once per app.

    A request without the cookie (every API call) gets a new, empty session at once, as
    Flask's interface gives it, without first building the signing serializer it would not
    use: about a tenth of the web's own work for a `GET /healthz`."""

    def get_cookie_secure(self, app: Flask) -> bool:
        return request.is_secure or super().get_cookie_secure(app)

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        if app.secret_key and not request.cookies.get(self.get_cookie_name(app)):
            return self.session_class()
        return super().open_session(app, request)


def init_session(app: Flask) -> None:
    """The signing secret: `SECRET_KEY`, else `TRACON_SECRET_KEY`, else one per process."""
    secret = app.config.get("SECRET_KEY") or os.environ.get(SECRET_ENV)
    if not secret:
        log.warning("no %s: console sessions end when this process stops", SECRET_ENV)
        secret = secrets.token_hex(32)
    app.config.update(
        SECRET_KEY=secret,
        SESSION_COOKIE_NAME=COOKIE_NAME,
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
    )
    app.session_interface = ConsoleSessionInterface()


def sign_in(key: str) -> bool:
    """Check an API key; on success the session names its tenant and its public id."""
    tenant_id = runtime().tenants.authenticate(key)
    if tenant_id is None:
        return False
    session.clear()  # a new session on sign-in: nothing from before carries over
    session.update(tenant=tenant_id, key=key.split("_", 2)[1], csrf=secrets.token_urlsafe(32))
    return True


def sign_out() -> None:
    session.clear()


def signed_in_tenant() -> str | None:
    """The session's tenant while its key is still valid; a stale session is cleared."""
    tenant_id, key_id = session.get("tenant"), session.get("key")
    if not isinstance(tenant_id, str) or not isinstance(key_id, str):
        return None
    if not _key_is_valid(key_id, tenant_id):
        session.clear()
        return None
    g.console_tenant = tenant_id
    return tenant_id


def _key_is_valid(key_id: str, tenant_id: str) -> bool:
    return runtime().tenants.key_active(key_id, tenant_id)


def current_tenant() -> str:
    value: str = g.console_tenant
    return value


def decided_by() -> str:
    """Who acted, for the record, as the API records it: the key's public id."""
    return f"key:{session['key']}"


def csrf_token() -> str:
    """The session's CSRF token, made on first use (the sign-in form needs one too)."""
    token = session.get("csrf")
    if not isinstance(token, str):
        token = secrets.token_urlsafe(32)
        session["csrf"] = token
    return token


def csrf_ok() -> bool:
    sent = request.form.get("csrf_token", "")
    expected = session.get("csrf")
    return isinstance(expected, str) and hmac.compare_digest(sent.encode(), expected.encode())
