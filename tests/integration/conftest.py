"""Fixtures the HTTP tests share: each module gives its own `runtime` and `app`."""

from __future__ import annotations

import pytest
from flask import Flask
from flask.testing import FlaskClient

from tracon_jobs.runtime import Runtime


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def key(runtime: Runtime) -> str:
    """An API key of tenant `acme`."""
    return runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
