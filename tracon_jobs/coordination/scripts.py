"""Lua scripts shipped in `lua/`, loaded once per client and called by SHA."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import redis

LUA = Path(__file__).with_name("lua")


@cache
def source(name: str) -> str:
    return (LUA / f"{name}.lua").read_text()


class Scripts:
    """Registered scripts of one Redis client: one round trip per call (EVALSHA)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._scripts: dict[str, Any] = {}

    def __call__(self, name: str, keys: list[str], args: list[Any]) -> Any:
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = self.client.register_script(source(name))
        return script(keys=keys, args=args)
