"""Rendering docs/configuration.md, the reference of every setting, from the section models and
defaults.py, so the documented paths, types, defaults and rules cannot drift from the code.

Regenerate it with `python -m tracon_jobs.settings.reference > docs/configuration.md`.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import textwrap
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings import defaults, sections
from tracon_jobs.settings.durations import format_duration
from tracon_jobs.settings.keys import ROOT_KEY
from tracon_jobs.settings.loading import (
    CONFIG_ENV_VAR,
    ENV_PREFIX,
    ENV_SHORTCUTS,
    apply_environment,
    environment_sources,
)
from tracon_jobs.settings.sections import Settings
from tracon_jobs.settings.types import Rule

REGENERATE = "python -m tracon_jobs.settings.reference > docs/configuration.md"
"""The command that writes docs/configuration.md."""

_EXAMPLE_OVERRIDE = (f"{ENV_PREFIX}CIRCUITBREAKER__FAILURETHRESHOLD", "0")

_INTRO = """\
# Configuration reference

<!-- Generated from tracon_jobs/settings/sections.py and defaults.py by
`{regenerate}`.
Edit those (field descriptions, default docstrings), not this file. -->

tracon-jobs reads one JSON file with a `"{root}"` root object: the file named by `{config_env}`,
else `{config_file}` in the working directory if there is one; with neither, every setting keeps
its default. Other roots in the file (e.g. `"Logging"`) are ignored. Keys match
case-insensitively and `snake_case` works too (`"FailureThreshold"`, `"failureThreshold"` and
`"failure_threshold"` are the same key); an unknown key is an error, which suggests the known key
when one is close (`did you mean "FailureThreshold"?`).

**Environment variables** override the file: `{env_prefix}` followed by the setting's path with
`__` between sections, case-insensitive, e.g. `{env_prefix}CIRCUITBREAKER__FAILURETHRESHOLD=3` or
`{env_prefix}RUNS__REQUEUEAFTER=00:00:30`. A value that starts with `{{` or `[` is read as JSON
(`{env_prefix}TOOLMODULES='["myapp.tools"]'`), and `null` as null. Shortcuts:
{shortcuts};
the `{env_prefix}…` form wins when both are set. Any other `TRACON_…` variable that no process
reads ([the others](operations.md#process-settings)) configures nothing: each process warns of it
once, at startup, with the variable it probably means (`TRACON_CIRCUITBREAKER__FAILURETHRESHOLD`:
`did you mean {env_prefix}CIRCUITBREAKER__FAILURETHRESHOLD?`).

**Booleans** are JSON `true` or `false` only: `"yes"`, `0` or `"true"` in the file are errors.
An environment variable, whose value is always text, writes them `true` or `false` (any case).

**Durations** are `"hh:mm:ss"`, `"hh:mm:ss.fff"`, `"d.hh:mm:ss.fff"` (.NET TimeSpan text) or a
number of seconds (`30`, `0.5`, `"90"`).

**Invalid values fail at startup**, naming the setting and the rule it breaks, with exit code 78
(`EX_CONFIG`), never later in the middle of a run; a value that came from an environment variable
is reported with the variable's name:

```text
$ {example_env}={example_value} tracon-jobs migrate
tracon-jobs: {example_error}
```

**Reading the tables.** A setting is named by its path in the file, so
`{root}:CircuitBreaker:FailureThreshold` is
`{{"{root}": {{"CircuitBreaker": {{"FailureThreshold": …}}}}}}`. `<provider>`, `<agent>` and
`<model>` stand for names you choose, `<n>` for a position in a list.
The default is the JSON value a missing setting takes; *required* means it has none. The rule is
what a value must satisfy beyond its type, or what a special value means.
"""


@dataclass(frozen=True)
class ReferenceRow:
    """One setting as the reference shows it."""

    path: tuple[str, ...]
    type: str
    default: str
    rule: str
    description: str


def render_reference() -> str:
    """docs/configuration.md: the introduction, then one table per section of `Settings`."""
    docs = _DefaultDocs()
    parts = [_intro(), _contents()]
    for name, field in Settings.model_fields.items():
        key = field.alias or name
        parts.append(f"## {key}\n")
        summary = _section_summary(field)
        if summary:
            parts.append(f"{summary}\n")
        rows = list(_field_rows(Settings, name, field, (ROOT_KEY, key), docs))
        parts.append(_table(rows))
    return "\n".join(parts)


def reference_rows() -> list[ReferenceRow]:
    """Every row of the reference, for tests that check each row says something."""
    docs = _DefaultDocs()
    return list(_model_rows(Settings, (ROOT_KEY,), docs))


def _intro() -> str:
    example_env, example_value = _EXAMPLE_OVERRIDE
    shortcuts = " and ".join(
        f"`{name}` (`{':'.join((ROOT_KEY, *path))}`)" for name, path in ENV_SHORTCUTS.items()
    )
    return _INTRO.format(
        regenerate=REGENERATE,
        root=ROOT_KEY,
        config_env=CONFIG_ENV_VAR,
        config_file=defaults.CONFIG_FILE,
        env_prefix=ENV_PREFIX,
        shortcuts=shortcuts,
        example_env=example_env,
        example_value=example_value,
        example_error=_example_error(),
    )


def _example_error() -> str:
    """The message the intro's example really produces, so the example cannot go stale."""
    example_env, example_value = _EXAMPLE_OVERRIDE
    try:
        environ = {example_env: example_value}
        Settings.from_mapping(apply_environment({}, environ), environment_sources(environ))
    except ConfigurationError as exc:
        return str(exc)
    raise AssertionError(f"{_EXAMPLE_OVERRIDE} should be an invalid configuration")


def _contents() -> str:
    keys = [field.alias or name for name, field in Settings.model_fields.items()]
    links = " · ".join(f"[{key}](#{key.lower()})" for key in keys)
    return textwrap.fill(f"Sections: {links}.", width=100, break_on_hyphens=False) + "\n"


def _section_summary(field: FieldInfo) -> str:
    """The docstring of the section's model (or of one entry of a named collection)."""
    model = _model_of(field.annotation) or _item_model(field.annotation)
    return _first_paragraph(model.__doc__) if model is not None else ""


# --- rows ---------------------------------------------------------------------------------


def _model_rows(
    model: type[BaseModel], path: tuple[str, ...], docs: _DefaultDocs
) -> Iterator[ReferenceRow]:
    for name, field in model.model_fields.items():
        yield from _field_rows(model, name, field, (*path, field.alias or name), docs)


def _field_rows(
    owner: type[BaseModel],
    name: str,
    field: FieldInfo,
    path: tuple[str, ...],
    docs: _DefaultDocs,
) -> Iterator[ReferenceRow]:
    """A nested section is its fields; any other setting is a row, followed by the rows of its
    entries when it holds named or listed objects (providers, agents, fallback links)."""
    section = _model_of(field.annotation)
    if section is not None:
        yield from _model_rows(section, path, docs)
        return
    type_text, rules = _describe(field.annotation)
    rules += [item.text for item in field.metadata if isinstance(item, Rule)]
    yield ReferenceRow(
        path=path,
        type=type_text,
        default=_default_text(field),
        rule=", ".join(dict.fromkeys(rules)),
        description=field.description or docs.for_field(owner, name),
    )
    entry = _item_model(field.annotation)
    if entry is not None:
        yield from _model_rows(entry, (*path, _placeholder(field.annotation, path[-1])), docs)


def _table(rows: list[ReferenceRow]) -> str:
    lines = ["| setting | type | default | rule | description |", "|---|---|---|---|---|"]
    for row in rows:
        cells = [f"`{':'.join(row.path)}`", row.type, row.default, row.rule, row.description]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "*required*"
    value = field.get_default(call_default_factory=True)
    shown = format_duration(value) if isinstance(value, timedelta) else value
    return f"`{json.dumps(shown, default=str)}`"


# --- types --------------------------------------------------------------------------------

_TYPE_NAMES: Mapping[Any, str] = {
    bool: "true or false",
    int: "whole number",
    float: "number",
    Decimal: "number",
    str: "string",
    SecretStr: "string (secret)",
    timedelta: "duration",
    type(None): "null",
    Any: "any JSON value",
}


def _describe(annotation: Any) -> tuple[str, list[str]]:
    """The type as the JSON file sees it, and the rules its `Annotated` metadata carries."""
    origin = get_origin(annotation)
    arguments = get_args(annotation)
    if origin is Annotated:
        text, rules = _describe(arguments[0])
        return text, rules + [item.text for item in arguments[1:] if isinstance(item, Rule)]
    if origin in (Union, types.UnionType):
        described = [_describe(argument) for argument in arguments]
        texts = dict.fromkeys(text for text, _ in described)
        return " or ".join(texts), [rule for _, rules in described for rule in rules]
    if origin is Literal:
        return "one of " + ", ".join(f"`{json.dumps(value)}`" for value in arguments), []
    if origin is list:
        text, rules = _describe(arguments[0])
        return f"list of {text}s", [f"each {rule}" for rule in rules]
    if origin is dict or _model_of(annotation) is not None:
        return "object", []
    return _TYPE_NAMES[annotation], []


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _item_model(annotation: Any) -> type[BaseModel] | None:
    """The model of each entry of a `list[Model]` or `dict[str, Model]` setting."""
    if get_origin(annotation) in (list, dict):
        return _model_of(get_args(annotation)[-1])
    return None


def _placeholder(annotation: Any, key: str) -> str:
    """`<n>` for a list position; for a dict, its key in the singular (`<provider>`)."""
    if get_origin(annotation) is list:
        return "<n>"
    return f"<{key.removesuffix('s').lower()}>"


# --- descriptions from defaults.py ----------------------------------------------------------


class _DefaultDocs:
    """The docstrings of defaults.py, found through the `defaults.X` a field's default names."""

    def __init__(self) -> None:
        self._docs = _constant_docstrings(ast.parse(inspect.getsource(defaults)))
        self._names = _default_names(ast.parse(inspect.getsource(sections)))

    def for_field(self, owner: type[BaseModel], name: str) -> str:
        constant = self._names.get((owner.__name__, name))
        return self._docs.get(constant, "") if constant is not None else ""


def _constant_docstrings(module: ast.Module) -> dict[str, str]:
    """`NAME: Final = value` followed by a string: the string documents `NAME`."""
    docs: dict[str, str] = {}
    for node, following in zip(module.body, module.body[1:], strict=False):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        text = following.value if isinstance(following, ast.Expr) else None
        if isinstance(target, ast.Name) and isinstance(text, ast.Constant):
            docs[target.id] = _first_paragraph(str(text.value))
    return docs


def _default_names(module: ast.Module) -> dict[tuple[str, str], str]:
    """(class, field) → the `defaults` constant the field's default is."""
    names: dict[tuple[str, str], str] = {}
    for cls in (node for node in module.body if isinstance(node, ast.ClassDef)):
        for statement in cls.body:
            if not (isinstance(statement, ast.AnnAssign) and statement.value is not None):
                continue
            if not isinstance(statement.target, ast.Name):
                continue
            for node in ast.walk(statement.value):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "defaults"
                ):
                    names[(cls.name, statement.target.id)] = node.attr
                    break
    return names


def _first_paragraph(text: str | None) -> str:
    return " ".join((text or "").strip().split("\n\n")[0].split())


if __name__ == "__main__":
    sys.stdout.write(render_reference())
