"""The read routes around a run and its agents: the tool-call ledger, the saved conversation
and the configured agents, through the real Flask app, real SQL and real Redis. Runs are
executed by the real executor on a thread standing in for a worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from flask.testing import FlaskClient

from tests.helpers import ENDED, MakeRuntime, Script, ThreadWorker, scripted_agent, wait_for_status
from tracon_jobs.runtime import Runtime
from web import create_app


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def setup(
    make_runtime: MakeRuntime,
    sql_url: str,
    thread_worker: ThreadWorker,
    script: Script,
    tools: list[str],
    **sections: Any,
) -> tuple[Runtime, FlaskClient, str]:
    """The app over a `demo` agent running `script`: (runtime, client, key of tenant acme)."""
    rt = make_runtime(sql_url, **{**scripted_agent(script, tools), **sections})
    rt.send_runs_with(thread_worker.sender(rt))
    client = create_app(rt, {"TESTING": True}).test_client()
    key = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret
    return rt, client, key


def finished_run(client: FlaskClient, key: str) -> dict[str, Any]:
    """Submit a run of `demo` and wait for its end: the run JSON."""
    submitted = client.post(
        "/api/agents/demo/run",
        headers={**auth(key), "Prefer": "respond-async"},
        json={"message": "Where is A-1?"},
    )
    return wait_for_status(client, key, submitted.get_json()["runId"], *ENDED, timeout=10)


# -- the ledger -------------------------------------------------------------------------


def test_tool_calls_lists_the_runs_ledger(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    flaky = f"k-{uuid.uuid4().hex[:8]}"  # flaky_read fails once per key, then answers
    script: Script = [
        {
            "ToolCalls": [
                {"Name": "lookup_order", "Arguments": {"order_id": "A-1"}},
                {"Name": "flaky_read", "Arguments": {"key": flaky}},
                {"Name": "failing_tool", "Arguments": {"reason": "no stock"}},
            ]
        },
        {"Text": "It shipped."},
    ]
    tools = ["lookup_order", "flaky_read", "failing_tool"]
    _, client, key = setup(make_runtime, sql_url, thread_worker, script, tools)
    run = finished_run(client, key)

    response = client.get(f"/api/runs/{run['id']}/tool-calls", headers=auth(key))

    assert response.status_code == 200 and run["status"] == "Completed"
    items = response.get_json()["items"]
    assert [item["tool"] for item in items] == tools
    assert [item["id"] for item in items] == sorted(item["id"] for item in items)
    lookup, flaky_call, failing = items
    assert lookup["arguments"] == {"order_id": "A-1"}
    assert lookup["result"] == {"order_id": "A-1", "status": "shipped"}
    assert (lookup["status"], lookup["error"], lookup["attempts"]) == ("succeeded", None, 1)
    assert lookup["callId"] == "call_0_0" and lookup["turn"] == 0
    assert lookup["idempotencyKey"] == f"tj-{lookup['executionId']}"
    assert lookup["startedAt"] and lookup["endedAt"] and lookup["durationMs"] >= 0
    assert (flaky_call["status"], flaky_call["attempts"]) == ("succeeded", 2)
    assert flaky_call["result"] == f"value of {flaky}"
    assert failing["status"] == "failed" and failing["result"] is None
    assert set(failing["error"]) == {"code", "message"}
    assert "no stock" in failing["error"]["message"]
    events = client.get(f"/api/runs/{run['id']}/events", headers=auth(key)).get_json()["items"]
    started = [e["data"]["executionId"] for e in events if e["type"] == "ToolCallStarted"]
    assert started == [item["executionId"] for item in items]


def test_tool_calls_of_a_run_without_calls_is_empty_and_another_tenants_is_404(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    rt, client, key = setup(make_runtime, sql_url, thread_worker, [{"Text": "hi"}], [])
    run = finished_run(client, key)
    other = rt.tenants.issue_key(rt.tenants.ensure_tenant("globex")).secret

    mine = client.get(f"/api/runs/{run['id']}/tool-calls", headers=auth(key))
    theirs = client.get(f"/api/runs/{run['id']}/tool-calls", headers=auth(other))
    unknown = client.get("/api/runs/nope/tool-calls", headers=auth(key))
    anonymous = client.get(f"/api/runs/{run['id']}/tool-calls")

    assert mine.status_code == 200 and mine.get_json() == {"items": []}
    assert theirs.status_code == 404 and unknown.status_code == 404
    assert anonymous.status_code == 401


# -- the conversation -------------------------------------------------------------------


def test_the_run_includes_its_messages_on_request(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    script: Script = [
        {"ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}]},
        {"Text": "It shipped."},
    ]
    rt, client, key = setup(make_runtime, sql_url, thread_worker, script, ["lookup_order"])
    run = finished_run(client, key)
    other = rt.tenants.issue_key(rt.tenants.ensure_tenant("globex")).secret

    with_messages = client.get(f"/api/runs/{run['id']}?include=messages", headers=auth(key))
    bad = client.get(f"/api/runs/{run['id']}?include=secrets", headers=auth(key))
    theirs = client.get(f"/api/runs/{run['id']}?include=messages", headers=auth(other))

    assert "messages" not in run
    body = with_messages.get_json()
    assert with_messages.status_code == 200 and body["id"] == run["id"]
    messages = body["messages"]
    # saved after each turn that called tools; the last answer is the run's `output`
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[1]["content"] == "Where is A-1?"
    assert messages[2]["tool_calls"][0]["function"]["name"] == "lookup_order"
    assert '"shipped"' in messages[3]["content"]
    assert body["output"] == {"text": "It shipped."}
    assert bad.status_code == 400 and bad.get_json()["field"] == "include"
    assert theirs.status_code == 404


# -- agents -----------------------------------------------------------------------------


def test_agents_lists_the_configured_agents(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    agents = {
        "demo": {
            "Instructions": "secret instructions",
            "Model": {
                "provider": "scripted",
                "model": "demo-model",
                "fallbacks": [{"provider": "scripted", "model": "backup-model"}],
                "temperature": 0.2,
            },
            "Tools": ["lookup_order", "failing_tool", "close_account"],
            "SubAgents": ["helper"],
            "RequireApproval": ["failing_tool"],
        },
        "helper": {"Model": {"provider": "scripted", "model": "demo-model"}},
    }
    _, client, key = setup(
        make_runtime, sql_url, thread_worker, [{"Text": "hi"}], [], Agents=agents
    )

    response = client.get("/api/agents", headers=auth(key))

    assert response.status_code == 200
    items = response.get_json()["items"]
    assert [agent["name"] for agent in items] == ["demo", "helper"]
    demo = items[0]
    assert demo["model"] == {
        "provider": "scripted",
        "model": "demo-model",
        "fallbacks": [{"provider": "scripted", "model": "backup-model"}],
        "temperature": 0.2,
        "topP": None,
        "maxOutputTokens": None,
    }
    tools = {tool["name"]: tool for tool in demo["tools"]}
    assert list(tools) == ["lookup_order", "failing_tool", "close_account"]
    assert tools["lookup_order"]["sideEffect"] == "read"
    assert tools["lookup_order"]["description"] == "Look up an order."
    assert [tools[n]["requiresApproval"] for n in tools] == [False, True, True]
    assert tools["close_account"]["sideEffect"] == "destructive"
    assert demo["subAgents"] == ["helper"] and demo["requireApproval"] == ["failing_tool"]
    assert "secret instructions" not in response.get_data(as_text=True)
    assert items[1]["tools"] == [] and items[1]["model"]["fallbacks"] == []
    assert client.get("/api/agents").status_code == 401


@pytest.mark.parametrize("path", ["/api/agents", "/api/runs/x/tool-calls"])
def test_openapi_describes_the_read_routes(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker, path: str
) -> None:
    _, client, _ = setup(make_runtime, sql_url, thread_worker, [{"Text": "hi"}], [])
    spec = client.get("/openapi.json").get_json()
    template = path.replace("/x/", "/{id}/")

    assert "200" in spec["paths"][template]["get"]["responses"]


def test_a_session_id_filter_longer_than_a_session_id_is_400(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    _, client, key = setup(make_runtime, sql_url, thread_worker, [{"Text": "hi"}], [])

    long = client.get(f"/api/runs?sessionId={'s' * 201}", headers=auth(key))
    fits = client.get(f"/api/runs?sessionId={'s' * 200}", headers=auth(key))

    assert long.status_code == 400 and long.get_json()["field"] == "sessionId"
    assert fits.status_code == 200 and fits.get_json()["items"] == []
