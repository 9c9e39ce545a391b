"""Client input checked at the edge, so that no input reaches SQL, a worker or a recursion
the process cannot take: every answer to a bad input is a `400` naming the field.

- JSON bodies (`json_body`): UTF-8 only, nested at most `MAX_DEPTH` levels (counted before
  parsing, without recursion), finite numbers only (`NaN`, `Infinity` and floats that
  overflow to infinity are refused), and no string or key holding a NUL character or a lone
  surrogate (PostgreSQL's `json` and `text` refuse the first, UTF-8 cannot encode the second).
- Path parameters, query parameters and headers (`init_app`): no NUL character.
- Integers in queries and headers (`integer`): ASCII digits only, in a stated range
  (`str.isdigit` holds for `²`, which `int` refuses).

The size of a body is bounded by Flask's `MAX_CONTENT_LENGTH` (`Web.MaxRequestBytes`),
which also cuts a chunked body off at the limit: `413`.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import re
from collections.abc import Iterator
from typing import Any

from flask import Flask, current_app, request
from werkzeug.exceptions import RequestEntityTooLarge

from web.problems import bad_request

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects a JSON body may have."""

_BAD_CHARACTER = re.compile("[\x00\ud800-\udfff]")
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")
_OPENERS = re.compile(r"[\[{]")
PATH_FIELDS = {
    "run_id": "id",
    "approval_id": "id",
    "endpoint_id": "id",
    "delivery_id": "deliveryId",
    "schedule_id": "id",
}
"""Path parameters by the name the API description gives them."""
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_DIGITS = re.compile(r"[0-9]{1,20}")


class _Refused(ValueError):
    """A JSON document this API does not accept, though `json` would."""


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused(f"{text} is too large a number")
    return value


def too_deep(text: str) -> bool:
    """Whether `text` nests arrays and objects deeper than `MAX_DEPTH`, without parsing it."""
    if len(_OPENERS.findall(text, 0)) <= MAX_DEPTH:
        return False
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(_STEP[c] for c in brackets)) > MAX_DEPTH


def loads(raw: bytes) -> Any:
    """The JSON document in `raw`; 400 naming `body` when it is not one this API accepts."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request("the request body must be UTF-8", field="body") from exc
    if too_deep(text):
        raise bad_request(
            f"the request body is nested deeper than {MAX_DEPTH} levels", field="body"
        )
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except _Refused as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", field="body") from exc
    except (ValueError, RecursionError) as exc:
        raise bad_request("the request body is not valid JSON", field="body") from exc
    check_strings(value)
    return value


def json_body() -> Any:
    """The request's JSON body, checked (see the module doc); None when it sends no JSON."""
    if not request.is_json:
        return None
    return loads(request.get_data(cache=True))


def check_strings(value: Any) -> None:
    """400 naming the first string or key (as `a.0.b`) with a NUL or a lone surrogate."""
    for path, text in _strings(value):
        if _BAD_CHARACTER.search(text):
            field = ".".join(str(part) for part in path) or "body"
            raise bad_request(
                f"{field}: must not contain NUL characters or lone surrogates", field=field
            )


def _strings(value: Any) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Every string and key of a parsed document with its path, without recursion."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            yield path, item
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                yield path, key
                stack.append(((*path, key), child))
        elif isinstance(item, list):
            stack.extend(
                ((*path, index), child) for index, child in reversed(list(enumerate(item)))
            )


def check_text(value: str, field: str) -> str:
    """`value`, when it holds no NUL character; else 400 naming `field`."""
    if "\x00" in value:
        raise bad_request(f"{field}: must not contain NUL characters", field=field)
    return value


def integer(raw: str, field: str, lowest: int, highest: int) -> int:
    """`raw` as an integer from `lowest` to `highest`: ASCII digits only, else 400. Nothing
    is stripped: `?limit=+5` reaches here as `" 5"` (a `+` is a space in a query string), and
    a sign or a blank is not a digit (a header's own blanks are gone before it gets here)."""
    if _DIGITS.fullmatch(raw) and lowest <= int(raw) <= highest:
        return int(raw)
    raise bad_request(f"{field}: must be an integer from {lowest} to {highest}", field=field)


def init_app(app: Flask) -> None:
    """Bound chunked bodies, and refuse a NUL character in any path parameter, query parameter
    or header value."""

    @app.before_request
    def _bound_chunked_bodies() -> None:
        """Werkzeug cuts a chunked body off at `MAX_CONTENT_LENGTH` without a word, which
        reads as a truncated document; read it here instead (one byte past the limit), answer
        413 when it is larger, and hand the rest of the request a body of known length."""
        limit = current_app.config.get("MAX_CONTENT_LENGTH")
        environ = request.environ
        if limit is None or request.content_length is not None:
            return
        if not environ.get("wsgi.input_terminated"):
            return  # Werkzeug reads no body of unknown length from such a server
        body = environ["wsgi.input"].read(limit + 1)
        if len(body) > limit:
            raise RequestEntityTooLarge()
        environ.pop("HTTP_TRANSFER_ENCODING", None)
        environ.update({"wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body))})

    @app.before_request
    def _refuse_nul_characters() -> None:
        for name, value in (request.view_args or {}).items():
            if isinstance(value, str):
                check_text(value, PATH_FIELDS.get(name, name))
        for name, value in request.args.items(multi=True):
            check_text(name, "query")
            check_text(value, name)
        for name, value in request.headers.items():
            check_text(value, name)
