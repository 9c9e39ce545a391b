"""The SQL idempotency store on SQLite and PostgreSQL, its retention pass and its schedule."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

import pytest

from beat_schedules import build_schedule
from beat_schedules.schedule import IDEMPOTENCY_PURGE_TASK
from tests.helpers import MakeRuntime
from tracon_jobs.idempotency import (
    IdempotencyStore,
    Outcome,
    PurgeResult,
    StoredResponse,
    fingerprint,
    purge_past_retention,
)
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings

PATH = "/api/agents/demo/run"


def retention_pass(rt: Runtime, now: datetime) -> PurgeResult:
    """What the periodic purge task runs, with an explicit `now`."""
    return purge_past_retention(
        IdempotencyStore(rt.db), rt.settings.retention.idempotency_retention, now
    )


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return make_runtime(sql_url)


@pytest.fixture
def store(runtime: Runtime) -> IdempotencyStore:
    return IdempotencyStore(runtime.db)


@pytest.fixture
def tenant(runtime: Runtime) -> str:
    return runtime.tenants.ensure_tenant("acme")


def test_fingerprint_is_method_path_and_raw_bytes() -> None:
    base = fingerprint("POST", PATH, b'{"a": 1}')
    assert base == fingerprint("post", PATH, b'{"a": 1}')
    assert base != fingerprint("POST", PATH, b'{"a":1}')
    assert base != fingerprint("POST", "/v1/responses", b'{"a": 1}')


def test_reserve_complete_replay(store: IdempotencyStore, tenant: str) -> None:
    assert store.reserve(tenant, "k", "POST", PATH, b"{}").outcome is Outcome.RESERVED
    assert store.reserve(tenant, "k", "POST", PATH, b"{}").outcome is Outcome.IN_PROGRESS
    stored = StoredResponse(201, b"\x00body", "application/json", "/x", "respond-async", "r-1")

    assert store.complete(tenant, "k", stored)

    replay = store.reserve(tenant, "k", "POST", PATH, b"{}")
    assert replay.outcome is Outcome.REPLAY and replay.stored == stored
    assert store.reserve(tenant, "k", "POST", PATH, b"{ }").outcome is Outcome.MISMATCH


def test_release_frees_only_an_in_progress_record(store: IdempotencyStore, tenant: str) -> None:
    store.reserve(tenant, "open", "POST", PATH, b"{}")
    store.reserve(tenant, "done", "POST", PATH, b"{}")
    store.complete(tenant, "done", StoredResponse(200, b"ok"))

    assert store.release(tenant, "open") and not store.release(tenant, "open")
    assert not store.release(tenant, "done")
    assert store.reserve(tenant, "open", "POST", PATH, b"{}").outcome is Outcome.RESERVED
    assert store.reserve(tenant, "done", "POST", PATH, b"{}").outcome is Outcome.REPLAY


def test_complete_after_release_stores_nothing(store: IdempotencyStore, tenant: str) -> None:
    store.reserve(tenant, "k", "POST", PATH, b"{}")
    store.release(tenant, "k")

    assert not store.complete(tenant, "k", StoredResponse(200, b"late"))
    assert store.list_in_progress() == []


def test_list_in_progress_names_the_run_and_filters_by_tenant(
    store: IdempotencyStore, tenant: str, runtime: Runtime
) -> None:
    other = runtime.tenants.ensure_tenant("globex")
    store.reserve(tenant, "k1", "POST", PATH, b"{}")
    store.attach_run(tenant, "k1", "run-1")
    store.reserve(other, "k1", "POST", PATH, b"{}")
    store.reserve(tenant, "k2", "POST", PATH, b"{}")
    store.complete(tenant, "k2", StoredResponse(200, b"ok"))

    mine = store.list_in_progress(tenant)
    everyone = store.list_in_progress()

    assert [(r.key, r.run_id, r.state) for r in mine] == [("k1", "run-1", "InProgress")]
    assert sorted(r.tenant_id for r in everyone) == sorted([tenant, other])


def test_twenty_threads_reserving_one_key_reserve_it_once(
    store: IdempotencyStore, tenant: str
) -> None:
    barrier = threading.Barrier(20)
    outcomes: list[Outcome] = []

    def race() -> None:
        barrier.wait()
        outcomes.append(store.reserve(tenant, "race", "POST", PATH, b"{}").outcome)

    threads = [threading.Thread(target=race) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert outcomes.count(Outcome.RESERVED) == 1
    assert outcomes.count(Outcome.IN_PROGRESS) == 19


def test_purge_deletes_records_older_than_the_retention(
    store: IdempotencyStore, tenant: str, runtime: Runtime
) -> None:
    store.reserve(tenant, "old", "POST", PATH, b"{}")
    store.reserve(tenant, "older", "POST", PATH, b"{}")
    store.complete(tenant, "older", StoredResponse(200, b"ok"))
    now = runtime.db.now()

    assert store.purge(timedelta(hours=1), now) == 0
    assert store.purge(timedelta(hours=1), now + timedelta(hours=2)) == 2
    assert store.reserve(tenant, "older", "POST", PATH, b"{}").outcome is Outcome.RESERVED


def test_retention_scan_does_nothing_while_retention_is_off(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    rt = make_runtime(sql_url)
    tenant = rt.tenants.ensure_tenant("acme")
    IdempotencyStore(rt.db).reserve(tenant, "k", "POST", PATH, b"{}")

    result = retention_pass(rt, rt.db.now() + timedelta(days=30))

    assert not result.enabled and result.deleted == 0
    assert len(IdempotencyStore(rt.db).list_in_progress()) == 1


def test_retention_scan_deletes_after_the_default_day_when_enabled(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    rt = make_runtime(sql_url, Retention={"Enabled": True})
    tenant = rt.tenants.ensure_tenant("acme")
    IdempotencyStore(rt.db).reserve(tenant, "k", "POST", PATH, b"{}")
    now = rt.db.now()

    assert retention_pass(rt, now + timedelta(hours=23)).deleted == 0
    assert retention_pass(rt, now + timedelta(hours=25)).deleted == 1


def test_the_purge_is_scheduled_only_when_retention_is_on_and_expires_within_its_interval() -> None:
    off = build_schedule(Settings.model_validate({}))
    on = build_schedule(Settings.model_validate({"Retention": {"Enabled": True}}))
    short = build_schedule(
        Settings.model_validate({"Retention": {"Enabled": True, "Idempotency": "00:10:00"}})
    )

    assert IDEMPOTENCY_PURGE_TASK not in [entry["task"] for entry in off.values()]
    entry = on["purge-idempotency-records"]
    assert entry["task"] == IDEMPOTENCY_PURGE_TASK
    assert entry["schedule"] == 3600 and entry["options"]["expires"] <= entry["schedule"]
    assert short["purge-idempotency-records"]["schedule"] == 60
