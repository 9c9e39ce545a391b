"""Translating a pydantic `ValidationError` into the project's `ConfigurationError`, so an operator
reads the setting as they wrote it and the rule it broke, never pydantic's wording or a secret.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings.keys import ROOT_KEY, normalize_key
from tracon_jobs.settings.types import RULE_ERROR_TYPE

_PHRASES = {
    "missing": "is required",
    "extra_forbidden": "is not a known setting",
    "bool": "must be true or false",
    "int": "must be a whole number",
    "float": "must be a number",
    "decimal": "must be a number",
    "finite": "must be a finite number",
    "string": "must be a string",
    "dict": "must be an object",
    "model": "must be an object",
    "list": "must be a list",
}


def configuration_error(
    exc: ValidationError, sources: Mapping[tuple[str, ...], str] | None = None
) -> ConfigurationError:
    """The first problem pydantic found, named the way the operator wrote the setting, and the
    environment variable it came from when `sources` (normalized path -> variable) has one."""
    error = exc.errors(include_url=False)[0]
    setting = _setting_path(error)
    rule = _rule_of(error, setting)
    variable = _variable_of(setting, sources or {})
    if variable is not None:
        rule += f" (from environment variable {variable})"
    return ConfigurationError(setting or ROOT_KEY, rule)


def _variable_of(setting: str, sources: Mapping[tuple[str, ...], str]) -> str | None:
    """The variable that set `setting` or the nearest section above it."""
    parts = tuple(normalize_key(part) for part in re.split(r"[.\[\]]+", setting) if part)
    for length in range(len(parts), 0, -1):
        variable = sources.get(parts[:length])
        if variable is not None:
            return variable
    return None


def _setting_path(error: ErrorDetails) -> str:
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    suffix = error.get("ctx", {}).get("setting") if error["type"] == RULE_ERROR_TYPE else None
    if suffix:
        path += f".{suffix}"
    return path.lstrip(".")


def _rule_of(error: ErrorDetails, setting: str) -> str:
    context = error.get("ctx", {})
    if error["type"] == RULE_ERROR_TYPE:
        return str(context["rule"])
    if error["type"] == "literal_error":
        return f"must be one of {context['expected']}{_got(error, setting)}"
    if error["type"] in ("missing", "extra_forbidden"):
        return _PHRASES[error["type"]]
    family = error["type"].split("_")[0]
    return f"{_PHRASES.get(family, error['msg'])}{_got(error, setting)}"


def _got(error: ErrorDetails, setting: str) -> str:
    """The offending value, quoted as JSON, unless the setting holds a secret."""
    if normalize_key(setting.rsplit(".", 1)[-1]) == "apikey":
        return ""
    shown = json.dumps(error["input"], default=str)
    return f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
