"""Bearer API-key authentication: every request of a protected blueprint has a tenant."""

from __future__ import annotations

from flask import Blueprint, g, request

from web.extensions import runtime
from web.problems import Problem


def unauthorized(detail: str) -> Problem:
    return Problem(401, "Unauthorized", detail, headers={"WWW-Authenticate": "Bearer"})


def require_tenant(blueprint: Blueprint) -> None:
    @blueprint.before_request
    def _authenticate() -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise unauthorized("an API key is required: Authorization: Bearer <key>")
        found = runtime().tenants.authenticate_tenant(key.strip())
        if found is None:
            raise unauthorized("the API key is not valid")
        g.tenant_id = found.tenant_id
        g.own_quota = found.own_quota  # read with the key: the quota check needs no read
        g.key_id = key.strip().split("_", 2)[1]  # the key's public id, never its secret


def tenant_id() -> str:
    value: str = g.tenant_id
    return value


def key_prefix() -> str:
    """Who acted, for the record: the public id of the API key that authenticated."""
    value: str = g.key_id
    return f"key:{value}"
