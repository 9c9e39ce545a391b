"""The `@tool` decorator, tool metadata and the process-wide tool registry.

A tool's metadata is a reviewable claim about its effect: the side-effect class decides
whether the runtime may ever retry it, and `safe_to_repeat` whether a continuation may run
it again after an unknown outcome. The JSON schema the model sees comes from type hints.
"""

from __future__ import annotations

import inspect
import threading
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal, get_args, get_origin

from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ToolError, ToolRegistrationError

SideEffect = Literal["none", "read", "write", "destructive", "external"]
SIDE_EFFECTS: tuple[str, ...] = get_args(SideEffect)
WRITE_LIKE = frozenset({"write", "destructive", "external"})
DEFAULT_TIMEOUT_MS = 30_000
DEFAULT_BACKOFF_MS = 250


@dataclass(frozen=True)
class RetryPolicy:
    """`max_attempts` counts re-attempts after the first (0 = never retry)."""

    max_attempts: int = 0
    backoff_ms: int = DEFAULT_BACKOFF_MS
    retry_on: Callable[[ToolError], bool] | None = None


@dataclass
class ToolContext:
    """What a handler gets besides its arguments."""

    run_id: str
    tool_name: str
    execution_id: str
    idempotency_key: str
    attempt: int
    signal: AbortSignal
    report_usage: Callable[[Decimal | float, str], None] = field(
        default=lambda _amount, _currency: None
    )
    """Report spend beyond tokens (`context.report_usage(0.02, "USD")`); it counts against
    `AgentGraph.MaxTotalCost` when the currency is `Pricing.Currency`."""

    @property
    def cancelled(self) -> bool:
        return self.signal.aborted


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    handler: Callable[..., Any]
    parameters: dict[str, Any]
    side_effect: SideEffect = "none"
    idempotent: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    safe_to_repeat: bool = False
    requires_approval: bool = False
    wants_context: bool = False
    is_async: bool = False

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


class ToolRegistry:
    """Name -> ToolSpec; registration is checked once, lookups are lock-free reads."""

    def __init__(self) -> None:
        self._tools: dict[str, ToolSpec] = {}
        self._lock = threading.Lock()

    def register(self, spec: ToolSpec) -> None:
        with self._lock:
            existing = self._tools.get(spec.name)
            if existing is not None and existing.handler is not spec.handler:
                raise ToolRegistrationError(f"tool '{spec.name}' is already registered")
            self._tools[spec.name] = spec

    def get(self, name: str) -> ToolSpec | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)


registry = ToolRegistry()
"""The process-wide registry that `@tool` writes to; `ToolModules` fill it at startup."""


def tool(
    func: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    side_effect: SideEffect = "none",
    idempotent: bool = False,
    retry: RetryPolicy | Mapping[str, Any] | None = None,
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    safe_to_repeat: bool = False,
    requires_approval: bool = False,
    into: ToolRegistry | None = None,
) -> Any:
    """Register a function as a tool. Usable bare (`@tool`) or with options."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        spec = build_spec(
            fn,
            name=name or fn.__name__,
            description=description or inspect.getdoc(fn) or "",
            side_effect=side_effect,
            idempotent=idempotent,
            retry=_retry_policy(retry),
            timeout_ms=timeout_ms,
            safe_to_repeat=safe_to_repeat,
            requires_approval=requires_approval,
        )
        (into or registry).register(spec)
        fn.__tracon_tool__ = spec  # type: ignore[attr-defined]
        return fn

    return decorate(func) if func is not None else decorate


def build_spec(fn: Callable[..., Any], **options: Any) -> ToolSpec:
    _check_options(options)
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    return ToolSpec(
        handler=fn,
        parameters=_parameters_schema(signature, hints),
        wants_context="context" in signature.parameters,
        is_async=inspect.iscoroutinefunction(fn),
        **options,
    )


def _retry_policy(value: RetryPolicy | Mapping[str, Any] | None) -> RetryPolicy:
    if value is None or isinstance(value, RetryPolicy):
        return value or RetryPolicy()
    return RetryPolicy(**dict(value))


def _check_options(options: Mapping[str, Any]) -> None:
    name, side_effect, retry = options["name"], options["side_effect"], options["retry"]
    if side_effect not in SIDE_EFFECTS:
        raise ToolRegistrationError(
            f"tool '{name}': side_effect must be one of {', '.join(SIDE_EFFECTS)}"
        )
    if retry.max_attempts < 0:
        raise ToolRegistrationError(f"tool '{name}': retry max_attempts must be >= 0")
    if retry.max_attempts > 0 and side_effect in WRITE_LIKE and not options["idempotent"]:
        raise ToolRegistrationError(
            f"tool '{name}': a retry policy on a '{side_effect}' tool requires "
            "idempotent=True (the handler must deduplicate with context.idempotency_key)"
        )
    if options["timeout_ms"] <= 0:
        raise ToolRegistrationError(f"tool '{name}': timeout_ms must be positive")


def _parameters_schema(signature: inspect.Signature, hints: Mapping[str, Any]) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in signature.parameters.values():
        if param.name == "context" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        properties[param.name] = json_schema(hints.get(param.name, Any))
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required}


_SCALARS: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
}


def json_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of a type hint, for the hints tools use in practice."""
    if hint in _SCALARS:
        return dict(_SCALARS[hint])
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (list, tuple, set, frozenset):
        return {"type": "array", "items": json_schema(args[0]) if args else {}}
    if origin is dict or hint is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [json_schema(arg) for arg in args]}
    if hasattr(hint, "model_json_schema"):
        schema: dict[str, Any] = hint.model_json_schema()
        return schema
    return {}
