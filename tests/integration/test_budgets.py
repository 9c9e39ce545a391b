"""AgentGraph budgets and sub-agent runs: refusals at the right point with the right
message, and the overshoot bound of concurrent branches (real Redis, real SQL)."""

from __future__ import annotations

import threading
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
import redis
from sqlalchemy import func, select, update

from tests.helpers import MakeRuntime, Script, hold_queued, scripted_agent
from tests.stub_provider import Reply, StubProvider
from tracon_jobs.db.models import Run
from tracon_jobs.limits.budget_store import (
    UNCAPPED_ROOM,
    BudgetStore,
    Limits,
    MemoryBudgetStore,
    OutputAsk,
    RedisBudgetStore,
    Totals,
)
from tracon_jobs.limits.tree import MAX_CHAIN, ChainUnreadable, estimate_tokens, seed_totals
from tracon_jobs.runs.executor import initial_messages
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

LOOP = [
    {
        "ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A"}}],
        "InputTokens": 10,
        "OutputTokens": 5,
    }
]


def runtime_with(
    make_runtime: MakeRuntime,
    url: str,
    script: Script,
    tools: list[str],
    **sections: Any,
) -> Runtime:
    sections = scripted_agent(script, tools) | sections
    return make_runtime(url, sender=hold_queued, **sections)


def run_demo(runtime: Runtime, agent: str = "demo") -> Any:
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.runs.create(NewRun(tenant, agent, {"message": "go"})).id
    runtime.executor.execute(run_id)
    return runtime.runs.get(run_id)


def events(runtime: Runtime, run_id: str, type_: str) -> list[dict[str, Any]]:
    return [e.data for e in runtime.runs.events(run_id) if e.type == type_]


def test_token_limit_refuses_the_tool_call_then_the_next_model_call(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    runtime = runtime_with(
        make_runtime, sql_url, LOOP, ["lookup_order"], AgentGraph={"MaxTotalTokens": 50}
    )

    run = run_demo(runtime)

    assert (run.status, run.error_type, run.error_class) == (
        "Failed",
        "run_budget_exceeded",
        "QuotaExceeded",
    )
    assert "MaxTotalTokens" in run.error_message
    assert run.input_tokens + run.output_tokens == 60  # four calls of 15: the fourth crossed
    refused = [e for e in events(runtime, run.id, "ToolCallFailed")]
    assert refused[-1]["error"]["code"] == "BUDGET_EXCEEDED"
    assert refused[-1]["error"]["message"].endswith("The tool call did not start.")
    assert len(events(runtime, run.id, "ToolCallCompleted")) == 3


def test_reported_spend_counts_against_the_cost_limit_in_its_currency_only(
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    script = [{"ToolCalls": [{"Name": "render_audio", "Arguments": {"seconds": 1}}]}] * 3
    runtime = runtime_with(
        make_runtime,
        sqlite_url,
        script,
        ["render_audio"],
        AgentGraph={"MaxTotalCost": 0.08, "MaxTotalTokens": 0},
    )

    run = run_demo(runtime)

    assert run.error_type == "run_budget_exceeded" and "MaxTotalCost" in run.error_message
    reported = events(runtime, run.id, "UsageReported")
    assert [r["counted"] for r in reported] == [True, False, True, False]
    assert Decimal(run.cost_amount) > Decimal("0.10")


def test_an_unknown_price_makes_the_cost_limit_fall_back_to_tokens(
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    script: Script = [
        {"ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A"}}]},
        {"Text": "done"},
    ]
    runtime = runtime_with(
        make_runtime,
        sqlite_url,
        script,
        ["lookup_order"],
        Pricing={"Models": {}},
        AgentGraph={"MaxTotalCost": 0.000001},
    )

    run = run_demo(runtime)

    assert run.status == "Completed" and run.cost_source == "Unknown"


def test_duration_limit_refuses_the_next_model_call(
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    script: Script = [
        {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 0.4}}]},
        {"Text": "too late"},
    ]
    runtime = runtime_with(
        make_runtime, sqlite_url, script, ["slow_step"], AgentGraph={"MaxDuration": "00:00:00.300"}
    )

    run = run_demo(runtime)

    assert run.error_type == "run_budget_exceeded" and "MaxDuration" in run.error_message


SUPERVISOR: dict[str, Any] = {
    "Providers": {
        "boss": {
            "Kind": "scripted",
            "Script": [
                {"ToolCalls": [{"Name": "helper", "Arguments": {"message": "first"}}]},
                {"ToolCalls": [{"Name": "helper", "Arguments": {"message": "second"}}]},
                {"Text": "supervised"},
            ],
        },
        "worker": {"Kind": "scripted", "Script": [{"Text": "helped"}]},
    },
    "Agents": {
        "boss": {"Model": {"provider": "boss", "model": "m"}, "SubAgents": ["helper"]},
        "helper": {"Model": {"provider": "worker", "model": "m"}},
    },
}


def supervisor(make_runtime: MakeRuntime, url: str, **graph: Any) -> Runtime:
    return make_runtime(url, sender=hold_queued, **SUPERVISOR, AgentGraph=graph)


def test_a_sub_agent_is_a_child_run_of_the_tree(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    runtime = supervisor(make_runtime, sql_url)

    root = run_demo(runtime, "boss")

    assert root.status == "Completed" and root.output == {"text": "supervised"}
    tree = runtime.runs.tree(root.id, root.tenant_id)
    children = [r for r in tree if r.id != root.id]
    assert [(c.agent, c.parent_run_id, c.root_run_id, c.depth, c.status) for c in children] == [
        ("helper", root.id, root.id, 1, "Completed")
    ] * 2


@pytest.mark.parametrize(
    ("graph", "refused", "setting"),
    [
        ({"MaxDepth": 0}, 2, "MaxDepth"),
        ({"MaxTotalRuns": 1}, 1, "MaxTotalRuns"),
    ],
)
def test_a_refused_child_is_the_tools_error_and_the_parent_goes_on(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    graph: dict[str, Any],
    refused: int,
    setting: str,
) -> None:
    runtime = supervisor(make_runtime, sqlite_url, **graph)

    root = run_demo(runtime, "boss")

    assert root.status == "Completed"
    failures = [e["error"] for e in events(runtime, root.id, "ToolCallFailed")]
    assert len(failures) == refused
    assert all(f["code"] == "CHILD_REFUSED" and setting in f["message"] for f in failures)
    assert len(runtime.runs.tree(root.id, root.tenant_id)) == 1 + 2 - refused


@pytest.fixture(params=["memory", "redis"])
def budget_store(request: pytest.FixtureRequest, redis_client: redis.Redis) -> BudgetStore:
    return MemoryBudgetStore() if request.param == "memory" else RedisBudgetStore(redis_client)


def test_concurrent_branches_overshoot_by_less_than_one_call(budget_store: BudgetStore) -> None:
    # Given 8 branches of one tree, each call reserving what it will spend (30 tokens)
    limits = Limits(depth=3, tokens=100, cost=None, runs=None, duration=None)
    budget_store.open("root", Totals())
    barrier = threading.Barrier(8)

    def branch() -> None:
        barrier.wait()
        while budget_store.gate("root", "model", limits, reserve=30).allowed:
            budget_store.spend("root", released=30, tokens=30, cost=Decimal(0), unknown_price=False)

    threads = [threading.Thread(target=branch) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Then the tree stops within one call of its limit (without reservations: up to 8 calls)
    final = budget_store.gate("root", "tool", limits)
    assert 100 <= final.tokens < 100 + 30 and final.reserved == 0


def test_a_continuation_starts_from_what_its_chain_spent(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    runtime = supervisor(make_runtime, sql_url)
    first = run_demo(runtime, "boss")
    tenant = first.tenant_id
    continued = runtime.runs.create(
        NewRun(tenant, "boss", {"message": "again"}, continued_from_run_id=first.id, attempt=2)
    )

    seed = seed_totals(runtime.db, continued.id)

    tree = runtime.runs.tree(first.id, tenant)
    assert seed.tokens == sum(r.input_tokens + r.output_tokens for r in tree) > 0
    assert seed.children == 2


def walked_totals(runtime: Runtime, root: str) -> Totals:
    """What `seed_totals` answers, as it was computed before it was one statement: the chain
    walked run by run, each tree summed on its own (the reference it is held to)."""
    tokens, cost, children, unknown, executed = 0, Decimal(0), 0, False, 0
    current: str | None = root
    with runtime.db.read() as session:
        for _ in range(MAX_CHAIN):
            if current is None:
                break
            row = session.execute(
                select(
                    func.coalesce(func.sum(Run.input_tokens + Run.output_tokens), 0),
                    func.coalesce(func.sum(Run.cost_amount), 0),
                    func.count(),
                    func.max(Run.cost_source),
                ).where(Run.root_run_id == current)
            ).one()
            tokens += int(row[0])
            cost += Decimal(str(row[1]))
            children += max(int(row[2]) - 1, 0)
            unknown = unknown or row[3] == "Unknown"
            run = session.get(Run, current)
            if current != root and run is not None and run.started_at is not None:
                recovered = run.error_type in ("orphaned", "interrupted")
                end = (recovered and run.heartbeat_at) or run.ended_at or run.started_at
                ran = int((end - run.started_at).total_seconds() * 1000) - (run.waited_ms or 0)
                executed += max(ran, 0)
            current = session.scalar(select(Run.continued_from_run_id).where(Run.id == current))
        if current is not None:
            raise ChainUnreadable(root)
    return Totals(tokens, cost, children, unknown, executed)


def test_a_chain_s_spend_in_one_statement_is_what_walking_it_gives(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = make_runtime(sql_url, sender=hold_queued)
    tenant = runtime.tenants.ensure_tenant("acme")
    now = runtime.db.now()

    def run(continues: str | None = None, parent: str | None = None, **values: Any) -> str:
        new = NewRun(tenant, "demo", {"message": "x"}, continued_from_run_id=continues)
        if parent is not None:
            new = NewRun(
                tenant, "demo", {"message": "x"}, parent_run_id=parent, root_run_id=parent, depth=1
            )
        run_id = runtime.runs.create(new).id
        if values:
            with runtime.db.write() as session:
                session.execute(update(Run).where(Run.id == run_id).values(**values))
        return run_id

    # Given a chain of four trees: spend, children, a cost of unknown source, a run closed
    # as an orphan (it counts to its heartbeat), one that waited for a person
    second = timedelta(seconds=1)
    spent: dict[str, Any] = {"input_tokens": 7, "output_tokens": 5, "cost_amount": Decimal("0.25")}
    first = run(**spent, started_at=now, ended_at=now + 9 * second)
    run(parent=first, **spent)
    orphan = run(
        first,
        **spent,
        started_at=now,
        heartbeat_at=now + 2 * second,
        ended_at=now + 60 * second,
        error_type="orphaned",
    )
    run(parent=orphan, input_tokens=1, output_tokens=1, cost_source="Unknown")
    run(parent=orphan, input_tokens=3, output_tokens=0)
    waited = run(orphan, started_at=now, ended_at=now + 30 * second, waited_ms=25_000)
    last = run(waited, **spent)

    # Then one statement gives what walking the chain gave, on either database
    assert seed_totals(runtime.db, last) == walked_totals(runtime, last)
    assert seed_totals(runtime.db, last) == Totals(
        tokens=12 * 4 + 2 + 3,
        cost=Decimal("1.00"),
        children=3,
        unknown_price=True,
        executed_ms=(30 - 25 + 2 + 9) * 1000,
    )
    assert seed_totals(runtime.db, first) == walked_totals(runtime, first)

    # And a chain of as many runs as a run may continue is read; one more, or one whose
    # 128th run names a run that is gone, is refused, as before
    longest = run(None)
    for _ in range(MAX_CHAIN - 1):
        longest = run(longest)
    assert seed_totals(runtime.db, longest) == walked_totals(runtime, longest)
    dangling = run(None, continued_from_run_id="gone")
    for _ in range(MAX_CHAIN - 1):
        dangling = run(dangling)
    for root in (dangling, run(longest)):
        with pytest.raises(ChainUnreadable):
            walked_totals(runtime, root)
        with pytest.raises(ChainUnreadable):
            seed_totals(runtime.db, root)


def test_a_lost_budget_is_rebuilt_from_sql(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_client: redis.Redis,
) -> None:
    runtime = runtime_with(
        make_runtime, sqlite_url, LOOP, ["lookup_order"], AgentGraph={"MaxTotalTokens": 50}
    )
    flushed: list[bool] = []
    original = runtime.runs.record_spend

    def flush_after_the_second_call(*args: Any, **kwargs: Any) -> Any:
        event = original(*args, **kwargs)
        if event.data["turn"] == 1 and not flushed:
            redis_client.flushdb()  # Redis loses every tree's totals mid-run
            flushed.append(True)
        return event

    runtime.runs.record_spend = flush_after_the_second_call  # type: ignore[method-assign]

    run = run_demo(runtime)

    assert flushed and run.error_type == "run_budget_exceeded"
    assert run.input_tokens + run.output_tokens == 60, "the limit held across the flush"


TOKENS_100 = Limits(depth=3, tokens=100, cost=None, runs=None, duration=None)


def test_a_model_call_asks_for_no_more_output_than_the_tree_has_left(
    budget_store: BudgetStore,
) -> None:
    # Given a tree of 100 tokens that spent 30: 70 left, 20 of them the call's own input
    budget_store.open("root", Totals(tokens=30))

    capped = budget_store.gate("root", "model", TOKENS_100, ask=OutputAsk(20, 500))

    assert (capped.output_cap, capped.reserve) == (50, 70)
    # the reservation holds the rest: a concurrent call of the tree finds no room
    assert budget_store.gate("root", "model", TOKENS_100, ask=OutputAsk(20, 500)).refused
    budget_store.spend("root", released=70, tokens=25, cost=Decimal(0), unknown_price=False)
    # 45 left: a call wanting 10 is not capped, and reserves what it asked for
    small = budget_store.gate("root", "model", TOKENS_100, ask=OutputAsk(20, 10))
    assert (small.output_cap, small.reserve) == (0, 30)
    budget_store.spend("root", released=30, tokens=0, cost=Decimal(0), unknown_price=False)
    # a call asking for no particular output is capped at the room (small next to a model's)
    unset = budget_store.gate("root", "model", TOKENS_100, ask=OutputAsk(20, None))
    assert (unset.output_cap, unset.reserve) == (25, 45)
    budget_store.spend("root", released=45, tokens=0, cost=Decimal(0), unknown_price=False)
    # an input that alone fills the room still gets a request the provider accepts
    assert budget_store.gate("root", "model", TOKENS_100, ask=OutputAsk(60, 500)).output_cap == 1


def test_the_cost_left_caps_the_output_at_the_links_prices(budget_store: BudgetStore) -> None:
    limits = Limits(depth=3, tokens=None, cost=Decimal("1.0"), runs=None, duration=None)
    budget_store.open("root", Totals(cost=Decimal("0.5")))
    priced = OutputAsk(100, 1000, input_price=Decimal("0.001"), output_price=Decimal("0.008"))

    verdict = budget_store.gate("root", "model", limits, ask=priced)

    # 0.5 left, 0.1 of it the input's: 0.4 buys 50 output tokens; no token limit, no reserve
    assert (verdict.output_cap, verdict.reserve) == (50, 0)
    unpriced = OutputAsk(100, 1000)
    assert budget_store.gate("root", "model", limits, ask=unpriced).output_cap == 0
    budget_store.open("unknown", Totals(cost=Decimal("0.5"), unknown_price=True))
    # a tree with an unpriced spend has no cost limit (it falls back to tokens)
    assert budget_store.gate("unknown", "model", limits, ask=priced).output_cap == 0


def test_a_tree_with_room_to_spare_leaves_the_request_as_configured(
    budget_store: BudgetStore,
) -> None:
    limits = Limits(depth=3, tokens=10 * UNCAPPED_ROOM, cost=None, runs=None, duration=None)
    budget_store.open("root", Totals())

    assert budget_store.gate("root", "model", limits, ask=OutputAsk(20, None)).output_cap == 0
    assert budget_store.gate("root", "model", limits, ask=OutputAsk(20, 800)).output_cap == 0
    free = Limits(depth=3, tokens=None, cost=None, runs=None, duration=None)
    verdict = budget_store.gate("root", "model", free, ask=OutputAsk(20, 800))
    assert (verdict.output_cap, verdict.reserve) == (0, 0)


def stub_agent(stub: StubProvider, **graph: Any) -> dict[str, Any]:
    config = scripted_agent([])
    config["Providers"] = {"a": {"Kind": "openai", "BaseUrl": stub.base_url}}
    config["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a", "maxOutputTokens": 800}
    config["AgentGraph"] = graph
    config["Pricing"] = {
        "Models": {"gpt-a": {"InputPerMillion": 0, "OutputPerMillion": 1000}}  # 0.001 a token
    }
    return config


def run_with_spend_before(runtime: Runtime, spent: Totals) -> Any:
    """Run the demo agent in a tree that already spent `spent` (its budget opened with it)."""
    tenant = runtime.tenants.ensure_tenant("acme")
    run = runtime.runs.create(NewRun(tenant, "demo", {"message": "go"}))
    runtime.executor.budgets.open(run.id, spent)
    runtime.executor.execute(run.id)
    return runtime.runs.get(run.id)


@pytest.mark.parametrize("stream", [True, False])
def test_a_tree_with_50_tokens_left_asks_the_model_for_at_most_50(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider, stream: bool
) -> None:
    limit = 10_000
    config = stub_agent(stub_provider, MaxTotalTokens=limit)
    config["Providers"]["a"]["Stream"] = stream
    runtime = make_runtime(sql_url, **config)
    tenant = runtime.tenants.ensure_tenant("acme")
    run = runtime.runs.create(NewRun(tenant, "demo", {"message": "go"}))
    agent = runtime.settings.agents.get("demo")
    assert agent is not None
    own_input = estimate_tokens(initial_messages(agent, run))
    runtime.executor.budgets.open(run.id, Totals(tokens=limit - 50 - own_input))
    stub_provider.enqueue(Reply("short", chunks=2, output_tokens=5))

    runtime.executor.execute(run.id)

    request = stub_provider.requests[-1]
    assert request["max_tokens"] == 50 and bool(request.get("stream")) == stream
    started = next(e for e in runtime.runs.events(run.id) if e.type == "ModelCallStarted")
    assert started.data["maxOutputTokens"] == 50
    finished = runtime.runs.get(run.id)
    assert finished is not None and finished.status == "Completed"


def test_the_cost_left_caps_max_tokens_at_the_links_output_price(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    # 0.05 left of 1.00 at 0.001 an output token (input free): 50 tokens
    runtime = make_runtime(sql_url, **stub_agent(stub_provider, MaxTotalCost=1.0))
    stub_provider.enqueue(Reply("short", output_tokens=5))

    run = run_with_spend_before(runtime, Totals(cost=Decimal("0.95")))

    assert run.status == "Completed"
    assert stub_provider.requests[-1]["max_tokens"] == 50


def test_a_tree_with_room_sends_the_agents_own_max_tokens(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = make_runtime(sql_url, **stub_agent(stub_provider, MaxTotalTokens=1_000_000))
    stub_provider.enqueue(Reply("short", output_tokens=5))

    run = run_with_spend_before(runtime, Totals())

    assert stub_provider.requests[-1]["max_tokens"] == 800
    started = next(e for e in runtime.runs.events(run.id) if e.type == "ModelCallStarted")
    assert "maxOutputTokens" not in started.data
