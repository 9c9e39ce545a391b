"""The RFC 7240 `Prefer` header: whether a client asked for an answer before the run ends."""

from __future__ import annotations

from flask import request


def prefers_async() -> bool:
    prefer = request.headers.get("Prefer", "")
    return "respond-async" in [part.strip().lower() for part in prefer.split(",")]
