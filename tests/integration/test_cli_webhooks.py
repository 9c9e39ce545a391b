"""`tracon-jobs webhooks ...` through the cli's `main`, with `TRACON_CONFIG` naming a config on
the test's database and Redis (both SQL backends): create (the secret printed once), list,
show, update, delete, rotate-secret, deliveries and redeliver, the same rules as the API's,
and another tenant's endpoint never found."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.helpers import MakeRuntime
from tests.webhook_rows import Tried, delivery, delivery_row, heard, subscribed
from tracon_jobs.cli import main
from tracon_jobs.runtime import Runtime
from tracon_jobs.webhooks.endpoints import EndpointStore
from tracon_jobs.webhooks.events import CHANGED_CHANNEL

URL = "https://hooks.example.com/tracon"


@pytest.fixture
def runtime(
    make_runtime: MakeRuntime,
    sql_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Runtime:
    """The test's runtime and `TRACON_CONFIG` for the cli, alike."""
    path = write_config(Database={"Url": sql_url}, Redis={"Url": redis_url})
    monkeypatch.setenv("TRACON_CONFIG", str(path))
    rt = make_runtime(sql_url, sender=lambda _run_id: None)
    rt.tenants.ensure_tenant("acme")
    rt.tenants.ensure_tenant("globex")
    return rt


@pytest.fixture
def store(runtime: Runtime) -> EndpointStore:
    return EndpointStore(runtime.db)


def tenant(runtime: Runtime, name: str = "acme") -> str:
    found = runtime.tenants.find_tenant(name)
    assert found is not None
    return found


def created(capsys: pytest.CaptureFixture[str], *events: str) -> tuple[str, str]:
    """`webhooks create`: (the endpoint's id, its secret) from the two lines it prints."""
    args = ["webhooks", "create", URL, "--tenant", "acme"]
    for event in events or ("run.completed",):
        args += ["--event", event]
    assert main(args) == 0
    first, second = capsys.readouterr().out.splitlines()
    endpoint_id = first.split()[2].rstrip(":")
    assert first == f"webhook endpoint {endpoint_id}: {URL}"
    assert second.startswith("secret (shown once): whsec_")
    return endpoint_id, second.split(": ", 1)[1]


def test_create_prints_the_secret_once_and_list_and_show_never(
    runtime: Runtime,
    store: EndpointStore,
    capsys: pytest.CaptureFixture[str],
    redis_client: redis.Redis,
) -> None:
    listener = subscribed(redis_client, CHANGED_CHANNEL)
    endpoint_id, secret = created(capsys, "run.completed", "approval.requested")
    assert heard(listener, 1) == [CHANGED_CHANNEL]

    stored = store.get(tenant(runtime), endpoint_id)
    assert stored is not None and stored.secret == secret
    assert stored.events == ["run.completed", "approval.requested"]

    assert main(["webhooks", "list", "--tenant", "acme"]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert header.split() == ["id", "state", "created", "url", "events"]
    fields = line.split()
    assert (fields[0], fields[1], fields[-2], fields[-1]) == (
        endpoint_id,
        "enabled",
        URL,
        "run.completed,approval.requested",
    )
    assert main(["webhooks", "show", endpoint_id, "--tenant", "acme"]) == 0
    shown = capsys.readouterr().out
    assert json.loads(shown)["id"] == endpoint_id and secret not in shown
    assert main(["webhooks", "list", "--tenant", "globex"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_create_holds_the_options_to_the_apis_rules(
    runtime: Runtime, store: EndpointStore, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["http://hooks.example.com/", "--event", "run.failed"], "URL: must be an https URL"),
        ([URL, "--event", "run.failed", "--event", "nope"], "--event #2: 'nope' is not an event"),
        ([URL, "--event", "run.failed", "--event", "run.failed"], "--event #2: 'run.failed' is"),
        ([URL, "--event", "run.failed", "--description", "d" * 1001], "--description: must be"),
    ]
    for args, words in cases:
        assert main(["webhooks", "create", *args, "--tenant", "acme"]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and words in captured.err, captured.err
    assert store.page(tenant(runtime), 10) == []
    with pytest.raises(SystemExit):  # argparse: at least one --event
        main(["webhooks", "create", URL, "--tenant", "acme"])
    assert main(["webhooks", "create", URL, "--event", "run.failed", "--tenant", "nobody"]) == 1
    assert "no tenant 'nobody'" in capsys.readouterr().err


def test_update_disables_enables_and_changes(
    runtime: Runtime, store: EndpointStore, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint_id, _ = created(capsys)
    base = ["webhooks", "update", endpoint_id, "--tenant", "acme"]

    assert main([*base, "--disable", "--description", "paused"]) == 0
    disabled = json.loads(capsys.readouterr().out)
    assert (disabled["enabled"], disabled["description"]) == (False, "paused")
    assert disabled["disabledReason"] == "disabled by the tenant"
    assert main([*base, "--enable", "--event", "run.failed", "--description", ""]) == 0
    enabled = json.loads(capsys.readouterr().out)
    assert (enabled["enabled"], enabled["events"], enabled["description"]) == (
        True,
        ["run.failed"],
        None,
    )
    assert main(base) == 1
    assert "nothing to change" in capsys.readouterr().err
    assert main([*base, "--url", "https://10.1.2.3/"]) == 1
    assert "URL: must not be a private" in capsys.readouterr().err


def test_rotate_prints_the_new_secret_and_the_grace(
    runtime: Runtime, store: EndpointStore, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint_id, first = created(capsys)
    base = ["webhooks", "rotate-secret", endpoint_id, "--tenant", "acme"]

    assert main(base) == 0
    secret_line, grace_line = capsys.readouterr().out.splitlines()
    second = secret_line.split(": ", 1)[1]
    stored = store.get(tenant(runtime), endpoint_id)
    assert stored is not None and (stored.secret, stored.previous_secret) == (second, first)
    assert grace_line.startswith("the previous secret signs too until ")
    assert main([*base, "--grace", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "the previous secret no longer signs"
    with pytest.raises(SystemExit):
        main([*base, "--grace", "-5"])


def test_deliveries_list_each_attempt_and_redeliver_makes_one_pending(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint_id, _ = created(capsys)
    tried = (Tried(None, 10_000, "timed out"), Tried(503, 42, "HTTP 503"))
    failed, _ = delivery(runtime.db, endpoint_id, tenant(runtime), status="failed", tried=tried)

    assert main(["webhooks", "deliveries", endpoint_id, "--tenant", "acme"]) == 0
    header, line, first, second = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["id", "status", "type", "attempts"]
    assert line.split()[:4] == [failed, "failed", "run.completed", "2"]
    assert "no answer  10000 ms  timed out" in first and "HTTP 503  42 ms  HTTP 503" in second
    assert (
        main(["webhooks", "deliveries", endpoint_id, "--tenant", "acme", "--status", "pending"])
        == 0
    )
    assert len(capsys.readouterr().out.splitlines()) == 1

    assert main(["webhooks", "redeliver", endpoint_id, failed, "--tenant", "acme"]) == 0
    assert "pending again" in capsys.readouterr().out
    assert delivery_row(runtime.db, failed).status == "pending"
    assert main(["webhooks", "redeliver", endpoint_id, "nope", "--tenant", "acme"]) == 1
    assert "no delivery 'nope'" in capsys.readouterr().err


def test_delete_cancels_pending_deliveries_then_the_endpoint_is_gone(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint_id, _ = created(capsys)
    pending, _ = delivery(runtime.db, endpoint_id, tenant(runtime))

    assert main(["webhooks", "delete", endpoint_id, "--tenant", "acme"]) == 0
    assert "1 pending deliveries canceled" in capsys.readouterr().out
    assert delivery_row(runtime.db, pending).status == "canceled"
    assert main(["webhooks", "show", endpoint_id, "--tenant", "acme"]) == 1
    assert "no webhook endpoint" in capsys.readouterr().err


def test_another_tenants_endpoint_is_never_found(
    runtime: Runtime, store: EndpointStore, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint_id, secret = created(capsys)
    failed, _ = delivery(runtime.db, endpoint_id, tenant(runtime), status="failed")
    commands = [
        ["show", endpoint_id],
        ["update", endpoint_id, "--disable"],
        ["delete", endpoint_id],
        ["rotate-secret", endpoint_id],
        ["deliveries", endpoint_id],
        ["redeliver", endpoint_id, failed],
    ]

    for command in commands:
        assert main(["webhooks", *command, "--tenant", "globex"]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == len(commands) and all("no webhook endpoint" in e for e in errors)
    kept = store.get(tenant(runtime), endpoint_id)
    assert kept is not None and kept.enabled and kept.secret == secret
    assert delivery_row(runtime.db, failed).status == "failed"
