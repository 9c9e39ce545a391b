"""Turning the configuration file and the environment into one validated `Settings`, so every
process (web, worker, beat, CLI) reads its configuration the same way and fails at startup alike.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tracon_jobs import fast_paths, tracing
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings import defaults
from tracon_jobs.settings.environment import warn_of_unused_variables
from tracon_jobs.settings.keys import ROOT_KEY, normalize_key
from tracon_jobs.settings.sections import Settings
from tracon_jobs.settings.types import EnvText

CONFIG_ENV_VAR = "TRACON_CONFIG"
"""Names the configuration file; also the setting a file problem is reported under."""

ENV_PREFIX = "TRACON__"
"""Environment variables with this prefix override the file; `__` separates sections."""

ENV_SHORTCUTS: Mapping[str, tuple[str, ...]] = {
    "TRACON_DATABASE_URL": ("Database", "Url"),
    "TRACON_REDIS_URL": ("Redis", "Url"),
    "TRACON_REDIS_SENTINEL_MASTER": ("Redis", "SentinelMaster"),
    "TRACON_REDIS_CLUSTER_URL": ("Redis", "ClusterUrl"),
    "TRACON_BROKER_URL": ("Broker", "Url"),
}
"""Conventional single-variable names for the two store URLs, the Sentinel master's name, the
Redis Cluster's URL and the broker's URL (the `__` form wins)."""


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Read the file (if any), lay the environment over it, and validate the result.

    The file is `config_path`, else `$TRACON_CONFIG`, else `tracon.json` in the working
    directory when it exists; with none of them the defaults apply. A `TRACON_*` variable
    that configures nothing is warned of (`environment`).
    """
    environ = os.environ if environ is None else environ
    fast_paths.read(environ)  # a switch that says neither on nor off fails here, named
    tracing.check_environment(environ)  # an OTEL_* value the exporter would ignore, too
    data = _read_root(_config_file(config_path, environ))
    settings = Settings.from_mapping(apply_environment(data, environ), environment_sources(environ))
    for setting, variable in settings.missing_key_variables(environ):
        # A client built without its key would send a placeholder and fail on every call.
        if setting.endswith(".ApiKeyEnv"):
            remedy = "set it, empty for a server that needs no key, or remove ApiKeyEnv"
        elif setting.startswith("Redis."):  # a password Redis asks for: no section to remove
            remedy = f"set it, or remove {setting.removeprefix('Redis.')}"
        else:
            remedy = "set it, or remove the section that needs it"
        raise ConfigurationError(
            setting, f"names the environment variable {variable}, which is not set ({remedy})"
        )
    warn_of_unused_variables(environ, settings, ENV_SHORTCUTS)
    return settings


def environment_sources(environ: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """The variable behind each setting path the environment overrides (keys normalized), so
    an invalid value is reported with the variable that holds it."""
    return {tuple(normalize_key(part) for part in path): name for name, path in _overrides(environ)}


def _config_file(
    config_path: str | os.PathLike[str] | None, environ: Mapping[str, str]
) -> Path | None:
    named = config_path if config_path is not None else environ.get(CONFIG_ENV_VAR) or None
    if named is None:
        default = Path(defaults.CONFIG_FILE)
        return default if default.is_file() else None
    if not Path(named).is_file():
        raise ConfigurationError(CONFIG_ENV_VAR, f"no configuration file at {os.fspath(named)}")
    return Path(named)


def _read_root(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8-sig"))  # .NET tools write a BOM
    except OSError as exc:
        raise ConfigurationError(CONFIG_ENV_VAR, f"cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        rule = f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        raise ConfigurationError(CONFIG_ENV_VAR, rule) from None
    return _tracon_root(document, path)


def _tracon_root(document: Any, path: Path) -> dict[str, Any]:
    """The `Tracon` object; the root's name is matched case-insensitively like every key."""
    roots = document.items() if isinstance(document, dict) else []
    for key, value in roots:
        if normalize_key(key) == normalize_key(ROOT_KEY):
            if not isinstance(value, dict):
                raise ConfigurationError(ROOT_KEY, f"must be a JSON object in {path}")
            return value
    raise ConfigurationError(ROOT_KEY, f'{path} has no "{ROOT_KEY}" root object')


def apply_environment(data: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Lay `TRACON__...` variables (and the URL shortcuts) over the file's `Tracon` object."""
    merged = copy.deepcopy(dict(data))
    for name, path in _overrides(environ):
        _set_path(merged, path, _env_value(name, environ[name]))
    return merged


def _overrides(environ: Mapping[str, str]) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Shortcuts first, so the explicit `TRACON__DATABASE__URL` form is applied last and wins."""
    for name, path in ENV_SHORTCUTS.items():
        if name in environ:
            yield name, path
    for name in sorted(environ):
        if name.upper().startswith(ENV_PREFIX):
            yield name, _env_path(name)


def _env_path(name: str) -> tuple[str, ...]:
    path = tuple(name[len(ENV_PREFIX) :].split("__"))
    if not all(path):
        raise ConfigurationError(name, "has an empty section name between '__' separators")
    return path


def _env_value(name: str, text: str) -> Any:
    """JSON for objects, arrays and null; everything else stays text for pydantic to convert,
    marked as coming from the environment (where a boolean may be the text `true`)."""
    stripped = text.strip()
    if stripped.lower() == "null":
        return None
    if not stripped.startswith(("[", "{")):
        return EnvText(text)
    try:
        return json.loads(stripped)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(name, f"looks like JSON but does not parse: {exc.msg}") from None


def _set_path(node: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for segment in path[:-1]:
        key = _existing_key(node, segment)
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    key = _existing_key(node, path[-1])
    if isinstance(value, dict) and isinstance(node.get(key), dict):
        _deep_merge(node[key], value)
    else:
        node[key] = value


def _deep_merge(target: dict[str, Any], source: Mapping[str, Any]) -> None:
    for segment, value in source.items():
        _set_path(target, (segment,), value)


def _existing_key(node: Mapping[str, Any], segment: str) -> str:
    """The key already present under another spelling, so an override replaces it rather
    than adding a twin; a new key (an agent's name) keeps the case it was given."""
    wanted = normalize_key(segment)
    return next((key for key in node if normalize_key(key) == wanted), segment)
