"""`tracon-jobs webhooks ...`: a tenant's webhook endpoints and their deliveries, through the
same store and the same rules as `POST /api/webhooks` (the URL policy of the configuration,
known event types). A secret is printed once, by `create` and `rotate-secret`; every change
tells the running processes, as the API's do."""

from __future__ import annotations

import argparse
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from tracon_jobs.cli.context import CommandError, load_runtime
from tracon_jobs.numbers import json_text
from tracon_jobs.webhooks.addresses import Destinations
from tracon_jobs.webhooks.endpoints import (
    Delivery,
    DeliveryNotFound,
    Endpoint,
    EndpointChanges,
    EndpointDisabled,
    EndpointNotFound,
    EndpointStore,
    InvalidEndpoint,
    checked,
    endpoint_json,
)

if TYPE_CHECKING:
    from tracon_jobs.runtime import Runtime


def _opened(args: argparse.Namespace) -> tuple[Runtime, EndpointStore, str]:
    """The runtime, the endpoint store (telling the processes of changes) and the tenant."""
    runtime = load_runtime()
    tenant_id = runtime.tenants.find_tenant(args.tenant)
    if tenant_id is None:
        raise CommandError(f"no tenant '{args.tenant}'")
    return runtime, EndpointStore(runtime.db, runtime.redis), tenant_id


def _checked(runtime: Runtime, fields: dict[str, Any], creating: bool) -> EndpointChanges:
    config = runtime.settings.webhooks
    policy = Destinations(config.allow_http, config.allow_private_networks)
    try:
        return checked(fields, policy, creating=creating)
    except InvalidEndpoint as invalid:
        raise CommandError(f"{_option(invalid.field)}: {invalid.rule}") from None


def _option(field: str) -> str:
    """The option a body's field is given with (`events[1]` is the second --event)."""
    if field.startswith("events["):
        return f"--event #{int(field[7:-1]) + 1}"
    return {"events": "--event", "url": "URL"}.get(field, f"--{field}")


def _missing(args: argparse.Namespace) -> CommandError:
    return CommandError(f"no webhook endpoint '{args.endpoint_id}' of tenant '{args.tenant}'")


def cmd_webhooks_create(args: argparse.Namespace, rest: list[str]) -> int:
    runtime, store, tenant_id = _opened(args)
    fields: dict[str, Any] = {"url": args.url, "events": args.events or []}
    if args.description is not None:
        fields["description"] = args.description
    changes = _checked(runtime, fields, creating=True)
    endpoint, secret = store.create(
        tenant_id, changes["url"], changes["events"], changes.get("description")
    )
    print(f"webhook endpoint {endpoint.id}: {endpoint.url}\nsecret (shown once): {secret}")
    return 0


ENDPOINT_HEADER = f"{'id':<36}  {'state':<8}  {'created':<19}  {'url':<40}  events"


def _endpoint_line(endpoint: Endpoint) -> str:
    state = "enabled" if endpoint.enabled else "disabled"
    return (
        f"{endpoint.id:<36}  {state:<8}  {_second(endpoint.created_at):<19}  "
        f"{endpoint.url:<40}  {','.join(endpoint.events or [])}"
    )


def cmd_webhooks_list(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    print(ENDPOINT_HEADER)
    for endpoint in store.page(tenant_id, args.limit):
        print(_endpoint_line(endpoint))
    return 0


def cmd_webhooks_show(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    endpoint = store.get(tenant_id, args.endpoint_id)
    if endpoint is None:
        raise _missing(args)
    print(json_text(endpoint_json(endpoint)))
    return 0


def cmd_webhooks_update(args: argparse.Namespace, rest: list[str]) -> int:
    runtime, store, tenant_id = _opened(args)
    fields: dict[str, Any] = {}
    if args.url is not None:
        fields["url"] = args.url
    if args.events is not None:
        fields["events"] = args.events
    if args.description is not None:
        fields["description"] = args.description or None  # "": remove it
    if args.enabled is not None:
        fields["enabled"] = args.enabled
    if not fields:
        raise CommandError(
            "nothing to change: give --url, --event, --description, --enable or --disable"
        )
    changes = _checked(runtime, fields, creating=False)
    try:
        endpoint = store.update(tenant_id, args.endpoint_id, changes)
    except EndpointNotFound:
        raise _missing(args) from None
    print(json_text(endpoint_json(endpoint)))
    return 0


def cmd_webhooks_delete(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    try:
        canceled = store.delete(tenant_id, args.endpoint_id)
    except EndpointNotFound:
        raise _missing(args) from None
    print(f"webhook endpoint {args.endpoint_id} deleted; {canceled} pending deliveries canceled")
    return 0


def cmd_webhooks_rotate_secret(args: argparse.Namespace, rest: list[str]) -> int:
    runtime, store, tenant_id = _opened(args)
    grace = runtime.settings.webhooks.rotation_grace
    if args.grace is not None:
        grace = timedelta(seconds=args.grace)
    try:
        endpoint, secret = store.rotate_secret(tenant_id, args.endpoint_id, grace)
    except EndpointNotFound:
        raise _missing(args) from None
    until = endpoint.previous_secret_until
    previous = "no longer signs" if until is None else f"signs too until {_second(until)} UTC"
    print(f"secret (shown once): {secret}\nthe previous secret {previous}")
    return 0


DELIVERY_HEADER = (
    f"{'id':<36}  {'status':<9}  {'type':<18}  {'attempts':>8}  {'created':<19}  next attempt"
)


def _delivery_lines(delivery: Delivery) -> list[str]:
    """The delivery's line, then one indented line per attempt."""
    row = delivery.row
    due = _second(row.next_attempt_at) if row.status == "pending" else "-"
    lines = [
        f"{row.id:<36}  {row.status:<9}  {delivery.type:<18}  {row.attempts:>8}  "
        f"{_second(row.created_at):<19}  {due}"
    ]
    for attempt in delivery.attempts:
        answer = "no answer" if attempt.status is None else f"HTTP {attempt.status}"
        error = f"  {attempt.error}" if attempt.error else ""
        lines.append(
            f"    {_second(attempt.attempted_at)}  {answer}  {attempt.latency_ms} ms{error}"
        )
    return lines


def cmd_webhooks_deliveries(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    try:
        found = store.deliveries(tenant_id, args.endpoint_id, args.limit, status=args.status)
    except EndpointNotFound:
        raise _missing(args) from None
    print(DELIVERY_HEADER)
    for delivery in found:
        print("\n".join(_delivery_lines(delivery)))
    return 0


def cmd_webhooks_redeliver(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    try:
        delivery = store.redeliver(tenant_id, args.endpoint_id, args.delivery_id)
    except EndpointNotFound:
        raise _missing(args) from None
    except DeliveryNotFound:
        raise CommandError(
            f"no delivery '{args.delivery_id}' of webhook endpoint '{args.endpoint_id}'"
        ) from None
    except EndpointDisabled:
        raise CommandError(
            f"webhook endpoint '{args.endpoint_id}' is disabled; enable it first "
            "(webhooks update ID --enable)"
        ) from None
    print(f"delivery {delivery.row.id} ({delivery.type}) is pending again, due now")
    return 0


def grace_seconds(raw: str) -> int:
    """`--grace`: whole seconds, 0 (the previous secret stops at once) or more."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of seconds: {raw!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {raw})")
    return value


def _second(moment: datetime | None) -> str:
    return "-" if moment is None else f"{moment:%Y-%m-%d %H:%M:%S}"
