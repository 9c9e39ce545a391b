"""The executor end to end in one process: real SQL (both backends), real Redis, and the
OpenAI-compatible stub over real HTTP for the `openai` provider kind."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select, update

from tests import tools
from tests.helpers import MakeRuntime, Script, claim_run, event_types, scripted_agent
from tests.stub_provider import Reply, StubProvider, StubToolCall, error, reply
from tracon_jobs import ToolContext, tool
from tracon_jobs.db.models import Run, ToolCallRecord
from tracon_jobs.errors import RunTakenAway
from tracon_jobs.limits.budget_store import Limits
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

TOOL_THEN_ANSWER = [
    {
        "ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}],
        "InputTokens": 100,
        "OutputTokens": 20,
    },
    {"Text": "It shipped.", "InputTokens": 150, "OutputTokens": 10},
]


def submit(runtime: Runtime, agent: str = "demo", message: str = "where is A-1?") -> str:
    tenant = runtime.tenants.ensure_tenant("acme")
    return runtime.runs.create(NewRun(tenant_id=tenant, agent=agent, input={"message": message})).id


def test_tool_call_then_answer_records_ledger_tokens_and_cost(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = make_runtime(sql_url, **scripted_agent(TOOL_THEN_ANSWER, ["lookup_order"]))
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Completed"

    run = runtime.runs.get(run_id)
    assert run is not None
    assert run.status == "Completed"
    assert run.output == {"text": "It shipped."}
    assert (run.input_tokens, run.output_tokens) == (250, 30)
    # 250 input tokens at 1/M + 30 output tokens at 2/M
    assert Decimal(run.cost_amount) == Decimal("0.00031")
    assert run.cost_source == "Configured"
    assert run.model_id == "demo-model"
    assert run.turns_completed == 1
    assert [m["role"] for m in run.messages or []] == ["system", "user", "assistant", "tool"]
    assert event_types(runtime, run_id) == [
        "RunQueued",
        "RunStarted",
        "ModelCallStarted",
        "ModelCallCompleted",
        "ToolCallStarted",
        "ToolCallCompleted",
        "ModelCallStarted",
        "ModelCallCompleted",
        "RunCompleted",
    ]
    with runtime.db.read() as session:
        ledger = session.scalars(select(ToolCallRecord)).all()
    assert [(row.tool, row.status, row.result) for row in ledger] == [
        ("lookup_order", "succeeded", {"value": {"order_id": "A-1", "status": "shipped"}})
    ]


def test_openai_provider_over_real_http(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    sections = scripted_agent([], ["lookup_order"])
    sections["Providers"] = {
        "stub": {"Kind": "openai", "BaseUrl": stub_provider.base_url, "TimeoutSeconds": 5}
    }
    sections["Agents"]["demo"]["Model"] = {
        "provider": "stub",
        "model": "gpt-test",
        "temperature": 0.2,
    }
    sections["Pricing"] = {"Models": {"gpt-test": {"InputPerMillion": 2, "OutputPerMillion": 8}}}
    runtime = make_runtime(sql_url, **sections)
    stub_provider.enqueue(
        Reply(
            None,
            tool_calls=(StubToolCall("lookup_order", {"order_id": "B-7"}),),
            input_tokens=40,
            output_tokens=8,
        ),
        reply("B-7 shipped.", input_tokens=60, output_tokens=6),
    )
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Completed"

    run = runtime.runs.get(run_id)
    assert run is not None and run.output == {"text": "B-7 shipped."}
    assert (run.input_tokens, run.output_tokens) == (100, 14)
    assert Decimal(run.cost_amount) == Decimal("0.000312")
    second = stub_provider.requests[1]
    assert second["temperature"] == 0.2
    assert second["messages"][-1]["role"] == "tool"
    assert "B-7" in second["messages"][-1]["content"]


def test_provider_failure_fails_the_run_with_its_status(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    sections = scripted_agent([])
    sections["Providers"] = {"stub": {"Kind": "openai", "BaseUrl": stub_provider.base_url}}
    sections["Agents"]["demo"]["Model"] = {"provider": "stub", "model": "gpt-test"}
    runtime = make_runtime(sql_url, **sections)
    stub_provider.enqueue(error(503))
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Failed"

    run = runtime.runs.get(run_id)
    assert run is not None
    assert (run.error_type, run.error_class) == ("provider_error", "Provider")
    assert "503" in (run.error_message or "")
    assert run.cost_source == "Configured" and run.input_tokens == 0


def test_second_delivery_is_dropped(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime = make_runtime(sql_url, **scripted_agent([{"Text": "hi"}]))
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Completed"
    assert runtime.executor.execute(run_id) == "dropped"
    assert event_types(runtime, run_id).count("RunStarted") == 1


def test_a_zombie_cannot_write_after_the_run_was_taken_away(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = make_runtime(sql_url, **scripted_agent([{"Text": "hi"}]))
    run_id = submit(runtime)
    zombie = claim_run(runtime, run_id, "worker-a")
    assert zombie is not None
    # Given the run was handed back and claimed by a new owner
    with runtime.db.write() as session:
        session.execute(update(Run).where(Run.id == run_id).values(status="Queued"))
    owner = claim_run(runtime, run_id, "worker-b")
    assert owner is not None and owner.fence == zombie.fence + 1

    # Then every fenced write of the zombie fails, and its final write changes nothing
    with pytest.raises(RunTakenAway):
        runtime.runs.append(zombie, "ModelCallStarted", {})
    with pytest.raises(RunTakenAway):
        runtime.runs.save_turn(zombie, [], 1)
    assert runtime.runs.finish(zombie, RunStatus.COMPLETED, output={"text": "zombie"}) is None
    assert runtime.runs.finish(owner, RunStatus.COMPLETED, output={"text": "owner"}) is not None
    run = runtime.runs.get(run_id)
    assert run is not None and run.output == {"text": "owner"}


@pytest.mark.parametrize(
    ("sections", "missing"),
    [
        ({"Agents": {}}, "agent 'demo'"),
        ({"ToolModules": []}, "tool 'lookup_order' (of agent 'demo')"),
    ],
)
def test_a_worker_without_the_agent_leaves_the_run_for_one_that_has_it(
    make_runtime: MakeRuntime, sqlite_url: str, sections: dict[str, Any], missing: str
) -> None:
    base = scripted_agent([{"Text": "hi"}], ["lookup_order"])
    runtime = make_runtime(sqlite_url, **(base | sections))
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.runs.create(NewRun(tenant_id=tenant, agent="demo", input={"message": "x"})).id
    if sections.get("ToolModules") == []:
        runtime.tools = type(runtime.tools)()  # a registry without the test tools

    # A worker of an older deploy hands the run back, untouched
    assert runtime.executor.execute(run_id) == "released"
    run = runtime.runs.get(run_id)
    assert run is not None and (run.status, run.owner, run.error_type) == ("Queued", None, None)
    released = [e for e in runtime.runs.events(run_id) if e.type == "RunReleased"]
    assert missing in released[0].data["reason"]

    # Once Runs.RequeueAfter has passed since it was submitted, nobody has it: it fails
    long_ago = run.created_at - runtime.settings.runs.requeue_after * 2
    with runtime.db.write() as session:
        session.execute(update(Run).where(Run.id == run_id).values(created_at=long_ago))
    assert runtime.executor.execute(run_id) == "Failed"
    run = runtime.runs.get(run_id)
    assert run is not None and run.error_type == "configuration_error"
    assert f"no worker has {missing} configured" in (run.error_message or "")


def test_tool_timeout_is_reported_to_the_model_and_the_run_goes_on(
    make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    script: Script = [
        {"ToolCalls": [{"Name": "slow_tool", "Arguments": {"seconds": 2}}]},
        {"Text": "gave up waiting"},
    ]
    runtime = make_runtime(sqlite_url, **scripted_agent(script, ["slow_tool"]))
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Completed"
    failed = [e for e in runtime.runs.events(run_id) if e.type == "ToolCallFailed"]
    assert failed[0].data["error"]["code"] == "TIMEOUT"
    run = runtime.runs.get(run_id)
    assert run is not None
    assert "TIMEOUT" in (run.messages or [])[-1]["content"]


def test_max_turns_fails_the_run(make_runtime: MakeRuntime, sqlite_url: str) -> None:
    loop = [{"ToolCalls": [{"Name": "async_echo", "Arguments": {"text": "again"}}]}]
    runtime = make_runtime(sqlite_url, Runs={"MaxTurns": 3}, **scripted_agent(loop, ["async_echo"]))
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Failed"
    run = runtime.runs.get(run_id)
    assert run is not None and run.error_type == "max_turns_exceeded"
    assert event_types(runtime, run_id).count("ToolCallCompleted") == 3


def test_runtime_retries_keep_the_key_and_a_new_model_call_gets_a_new_one(
    make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    from tests import tools

    script: Script = [
        {"ToolCalls": [{"Name": "flaky_read", "Arguments": {"key": "k-retry"}}]},
        {"ToolCalls": [{"Name": "flaky_read", "Arguments": {"key": "k-retry"}}]},
        {"Text": "done"},
    ]
    runtime = make_runtime(sqlite_url, **scripted_agent(script, ["flaky_read"]))
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Completed"

    keys = tools.flaky_attempts["k-retry"]
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2]
    events = runtime.runs.events(run_id)
    retried = [e.data for e in events if e.type == "CapabilityRetried"]
    assert retried == [
        {
            "tool": "flaky_read",
            "executionId": retried[0]["executionId"],
            "attempt": 2,
            "previousError": "EXECUTION_FAILED",
        }
    ]
    completed = [e.data["attempts"] for e in events if e.type == "ToolCallCompleted"]
    assert completed == [2, 1]


@pytest.mark.parametrize(
    ("priced", "answered"),
    [
        ("gpt-4o-mini", "gpt-4o-mini-2024-07-18"),  # the alias asked for is priced
        ("gpt-4o-mini-2024-07-18", "gpt-4o-mini-2024-07-18"),  # the answered name is priced
    ],
)
def test_a_dated_model_name_in_the_answer_is_priced_at_the_configured_model(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider, priced: str, answered: str
) -> None:
    """OpenAI answers an alias with a dated name; the price (and so the cost limits) must
    not turn `Unknown` for it."""
    sections = scripted_agent([])
    sections["Providers"] = {"stub": {"Kind": "openai", "BaseUrl": stub_provider.base_url}}
    sections["Agents"]["demo"]["Model"] = {"provider": "stub", "model": "gpt-4o-mini"}
    sections["Pricing"] = {"Models": {priced: {"InputPerMillion": 1, "OutputPerMillion": 2}}}
    runtime = make_runtime(sql_url, **sections)
    stub_provider.enqueue(reply("hi", input_tokens=1000, output_tokens=500, model=answered))
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Completed"

    run = runtime.runs.get(run_id)
    assert run is not None
    assert (run.cost_source, Decimal(run.cost_amount)) == ("Configured", Decimal("0.002"))
    assert run.model_id == "gpt-4o-mini"  # the link's configured model
    [completed] = [e for e in runtime.runs.events(run_id) if e.type == "ModelCallCompleted"]
    assert completed.data["providerModel"] == answered


def test_a_dated_suffix_falls_back_to_the_undated_price() -> None:
    from tracon_jobs.pricing import price_at
    from tracon_jobs.providers.base import Usage
    from tracon_jobs.settings import PricingSettings

    pricing = PricingSettings.model_validate(
        {"Models": {"gpt-4o": {"InputPerMillion": 1, "OutputPerMillion": 1}}}
    )
    usage = Usage(1_000_000, 0)

    assert price_at(pricing, "my-alias", "gpt-4o-2024-08-06", usage) == (Decimal(1), "Configured")
    assert price_at(pricing, "my-alias", "gpt-4o-0613", usage) == (Decimal(1), "Configured")
    assert price_at(pricing, "my-alias", "other-2024-08-06", usage) == (Decimal(0), "Unknown")


def test_prompt_cache_tokens_are_priced_at_their_own_rates_when_given() -> None:
    from tracon_jobs.pricing import price
    from tracon_jobs.providers.base import Usage
    from tracon_jobs.settings import PricingSettings

    rates = {"InputPerMillion": 3, "OutputPerMillion": 15}
    pricing = PricingSettings.model_validate(
        {
            "Models": {
                "plain": rates,
                "cached": {**rates, "CachedInputPerMillion": "0.3", "CacheWritePerMillion": 3.75},
            }
        }
    )
    # a million input tokens: 600k uncached, 300k read from the cache, 100k written to it
    usage = Usage(
        1_000_000, 1_000_000, cached_input_tokens=300_000, cache_write_input_tokens=100_000
    )

    assert price(pricing, "plain", usage) == (Decimal(3 + 15), "Configured")
    cost = Decimal("0.6") * 3 + Decimal("0.3") * Decimal("0.3") + Decimal("0.1") * Decimal("3.75")
    assert price(pricing, "cached", usage) == (cost + 15, "Configured")


CANCEL_IN_SQL: list[Runtime] = []


@tool(side_effect="none", name="cancel_in_sql_only")
def cancel_in_sql_only(*, context: ToolContext) -> str:
    """Stands in for another web node's cancel whose notice has not arrived: SQL only."""
    runtime = CANCEL_IN_SQL[-1]
    with runtime.db.write() as session:
        session.execute(
            update(Run).where(Run.id == context.run_id).values(cancel_requested_at=runtime.db.now())
        )
    return "canceled in SQL"


def test_a_tool_body_does_not_start_once_the_run_was_canceled_in_sql(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    """Ownership and the cancel flag are read from SQL right before a tool body starts, so
    an owner that has not heard of a cancel (or of a takeover) yet never starts one late."""
    script: Script = [
        {
            "ToolCalls": [
                {"Name": "cancel_in_sql_only", "Arguments": {}},
                {"Name": "lookup_order", "Arguments": {"order_id": "A-1"}},
            ]
        },
        {"Text": "done"},
    ]
    runtime = make_runtime(
        sql_url, **scripted_agent(script, ["cancel_in_sql_only", "lookup_order"])
    )
    CANCEL_IN_SQL.append(runtime)
    run_id = submit(runtime)
    before = len([c for c in tools.calls if c[0] == "lookup_order"])

    runtime.executor.execute(run_id)

    assert len([c for c in tools.calls if c[0] == "lookup_order"]) == before
    with runtime.db.read() as session:
        rows = session.scalars(
            select(ToolCallRecord).where(
                ToolCallRecord.run_id == run_id, ToolCallRecord.tool == "lookup_order"
            )
        ).all()
    assert [(row.status, row.error_code) for row in rows] == [("failed", "CANCELLED")]


def test_the_claim_commits_with_the_first_model_calls_start_in_one_write(
    make_runtime: MakeRuntime, sql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = make_runtime(sql_url, **scripted_agent([{"Text": "hi"}]))
    run_id = submit(runtime)
    began: list[str] = []  # the writes: a transaction (SQLite), a statement (PostgreSQL)

    def counted(name: str, opened: Callable[[], Any]) -> Callable[[], Any]:
        def write() -> Any:
            began.append(name)
            return opened()

        return write

    for name in ("transaction", "autocommit", "write"):
        monkeypatch.setattr(runtime.db, name, counted(name, getattr(runtime.db, name)))
    claimed = runtime.runs.open_claim(run_id, "me")
    assert claimed is not None
    claim = claimed[0]

    # Given the claim was read: nothing is written yet, and the heartbeat counts it as ours
    assert began == [] and event_types(runtime, run_id) == ["RunQueued"]
    assert runtime.runs.get(run_id).status == "Queued"  # type: ignore[union-attr]
    assert runtime.runs.heartbeat({run_id: claim.fence}) == {run_id}

    # When its first write is the model call's start, it makes the claim in its transaction
    runtime.runs.append(claim, "ModelCallStarted", {"turn": 0})
    assert len(began) == 1
    assert event_types(runtime, run_id) == ["RunQueued", "RunStarted", "ModelCallStarted"]
    row = runtime.runs.get(run_id)
    assert row is not None and (row.status, row.fence, row.owner) == ("Running", 1, "me")
    assert [e.seq for e in runtime.runs.events(run_id)] == [1, 2, 3]
    read = claimed[1]  # the row as read, as the claim leaves it settled with RunStarted alone
    assert (read.status, read.fence, read.owner, read.event_seq) == ("Running", 1, "me", 2)
    runtime.runs.let_go(claim)
    assert runtime.runs.heartbeat({run_id: claim.fence}) == {run_id}


def test_a_claim_read_by_two_processes_is_made_by_the_first_to_write(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    mine = make_runtime(sql_url, **scripted_agent([{"Text": "hi"}]))
    theirs = make_runtime(sql_url, **scripted_agent([{"Text": "hi"}]))
    run_id = submit(mine)
    my_read = mine.runs.open_claim(run_id, "me")
    assert my_read is not None
    assert claim_run(theirs, run_id, "them") is not None  # read and made while mine waits

    # Then my first write gives the run up, and the heartbeat no longer counts it as mine,
    # nor any write after it, though its fence number is theirs
    with pytest.raises(RunTakenAway):
        mine.runs.append(my_read[0], "ModelCallStarted", {"turn": 0})
    assert mine.runs.heartbeat({run_id: my_read[0].fence}) == set()
    with pytest.raises(RunTakenAway):
        mine.runs.save_turn(my_read[0], [], 1)
    assert event_types(mine, run_id) == ["RunQueued", "RunStarted"]
    row = mine.runs.get(run_id)
    assert row is not None and (row.owner, row.fence) == ("them", 1)
    # and a claim that is read and settled at once says the run is not there to take
    assert claim_run(mine, run_id, "me") is None


def test_a_run_claimed_elsewhere_before_its_first_call_makes_no_call_and_reserves_nothing(
    make_runtime: MakeRuntime, sql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = {"MaxTotalTokens": 10_000}
    runtime = make_runtime(sql_url, AgentGraph=graph, **scripted_agent([{"Text": "hi"}]))
    other = make_runtime(sql_url, AgentGraph=graph, **scripted_agent([{"Text": "hi"}]))
    run_id = submit(runtime)
    gate = runtime.executor._budget_for_model_call

    def claimed_meanwhile(*args: Any) -> tuple[int, int | None]:
        reserved, cap = gate(*args)
        assert reserved > 0  # the gate reserved the call's tokens
        assert claim_run(other, run_id, "other") is not None
        return reserved, cap

    monkeypatch.setattr(runtime.executor, "_budget_for_model_call", claimed_meanwhile)

    # When another process claims the run between the gate and the call's start, this
    # delivery is a duplicate that lost the race
    assert runtime.executor.execute(run_id) == "dropped"

    # Then no call started here, and the tokens reserved for it are the tree's again
    assert event_types(runtime, run_id) == ["RunQueued", "RunStarted"]
    limits = Limits.from_settings(runtime.settings.agent_graph)
    assert runtime.executor.budgets.gate(run_id, "tool", limits).reserved == 0


def test_a_second_delivery_to_the_same_process_finds_the_run_claimed(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = make_runtime(sql_url, **scripted_agent([{"Text": "hi"}]))
    run_id = submit(runtime)
    first = runtime.runs.open_claim(run_id, "worker-a")
    assert first is not None

    # While the first thread's claim is read and not made, a second thread of the same
    # process (the same owner, so the same fence and an equal claim) gets nothing
    assert runtime.runs.open_claim(run_id, "worker-a") is None
    assert runtime.executor.execute(run_id) == "dropped"

    # and the first makes it, alone
    runtime.runs.append(first[0], "ModelCallStarted", {"turn": 0})
    runtime.runs.let_go(first[0])
    assert event_types(runtime, run_id).count("RunStarted") == 1
    assert runtime.runs.open_claim(run_id, "worker-a") is None  # Running now
