"""`/v1/chat/completions` and `/v1/responses` with the official `openai` package as the
client, against the real Flask app served over HTTP, real SQL and real Redis.

Runs are executed by the real executor on a thread standing in for a worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from werkzeug.serving import BaseWSGIServer, make_server

from tests.helpers import MakeRuntime, ThreadWorker, hold_queued, scripted_agent, wait_until
from tracon_jobs.runtime import Runtime
from web import create_app

TEXT = "It shipped."


@pytest.fixture
def serve(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> Iterator[Callable[..., tuple[Runtime, str, str]]]:
    """Start the app on an ephemeral port: (runtime, base URL, API key of tenant acme)."""
    servers: list[BaseWSGIServer] = []

    def start(
        script: list[dict[str, Any]] | None = None, **sections: Any
    ) -> tuple[Runtime, str, str]:
        steps = script or [{"Text": TEXT, "InputTokens": 7, "OutputTokens": 3}]
        rt = make_runtime(sql_url, **{**scripted_agent(steps), **sections})
        rt.send_runs_with(thread_worker.sender(rt))
        app = create_app(rt, {"SSE_KEEPALIVE_SECONDS": 0.5})
        server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        key = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret
        return rt, f"http://127.0.0.1:{server.server_port}", key

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def client_for(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=20)


def api_runs(base: str, key: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{base}/api/runs", headers={"Authorization": f"Bearer {key}"})
    items: list[dict[str, Any]] = response.json()["items"]
    return items


USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Where is A-1?"}]


# -- chat completions -------------------------------------------------------------------


def test_chat_completion_is_an_ordinary_run_shaped_as_openai(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()

    completion = client_for(base, key).chat.completions.create(model="demo", messages=USER)

    assert completion.object == "chat.completion" and completion.model == "demo"
    assert completion.choices[0].message.content == TEXT
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (7, 3)
    assert completion.usage.total_tokens == 10
    [run] = api_runs(base, key)
    assert completion.id == f"chatcmpl-{run['id']}"
    assert run["status"] == "Completed" and run["agent"] == "demo"
    assert run["input"] == {"message": "Where is A-1?", "messages": USER}


def test_chat_history_reaches_the_model(serve: Callable[..., tuple[Runtime, str, str]]) -> None:
    # the scripted model answers step N when the conversation holds N assistant messages
    _, base, key = serve([{"Text": "first"}, {"Text": "second"}])
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "and then?"},
    ]

    completion = client_for(base, key).chat.completions.create(model="demo", messages=messages)

    assert completion.choices[0].message.content == "second"
    assert api_runs(base, key)[0]["input"]["message"] == "and then?"


def test_chat_completion_streams_chunks_ending_with_done(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()

    stream = client_for(base, key).chat.completions.create(
        model="demo", messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)

    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 10


def test_raw_chat_stream_ends_with_data_done(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    body = {"model": "demo", "messages": USER, "stream": True}

    response = httpx.post(
        f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )

    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.rstrip().endswith("data: [DONE]")


# -- responses --------------------------------------------------------------------------


def test_response_is_an_ordinary_run_shaped_as_openai(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()

    response = client_for(base, key).responses.create(
        model="demo", input="Where is A-1?", instructions="be brief"
    )

    assert response.object == "response" and response.status == "completed"
    assert response.output_text == TEXT
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (7, 3)
    [run] = api_runs(base, key)
    assert response.id == f"resp_{run['id']}"
    assert run["input"]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Where is A-1?"},
    ]


def test_response_accepts_a_list_of_input_messages(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    items: Any = [
        {"role": "user", "content": [{"type": "input_text", "text": "Where is A-1?"}]},
    ]

    response = client_for(base, key).responses.create(model="demo", input=items)

    assert response.output_text == TEXT
    assert api_runs(base, key)[0]["input"]["message"] == "Where is A-1?"


def test_response_streams_typed_events_with_sequence_numbers(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()

    events = list(
        client_for(base, key).responses.create(model="demo", input="Where is A-1?", stream=True)
    )

    assert [event.type for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == TEXT
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == TEXT
    assert completed.response.usage is not None and completed.response.usage.total_tokens == 10


def test_response_stream_helper_accumulates_the_final_response(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()

    with client_for(base, key).responses.stream(model="demo", input="Where is A-1?") as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()

    assert "".join(texts) == TEXT and final.output_text == TEXT


# -- errors -----------------------------------------------------------------------------


def test_unknown_model_is_404_in_openai_shape(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()

    with pytest.raises(openai.NotFoundError) as caught:
        client_for(base, key).chat.completions.create(model="nobody", messages=USER)

    assert caught.value.status_code == 404
    assert caught.value.code == "model_not_found"
    assert caught.value.body == {
        "message": "The model 'nobody' does not exist: a model names an agent",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert api_runs(base, key) == []


def test_bad_api_key_is_401_in_openai_shape(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, _ = serve()

    with pytest.raises(openai.AuthenticationError) as caught:
        client_for(base, "tjk_nope_nope").responses.create(model="demo", input="x")

    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_a_body_openai_would_refuse_is_400_in_openai_shape(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()

    response = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "demo", "messages": [{"role": "tool", "content": "x"}]},
        headers={"Authorization": f"Bearer {key}"},
    )

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "tool" in error["message"]


def test_a_failed_run_is_502_in_openai_shape(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve([{"ErrorStatus": 400}])

    with pytest.raises(openai.APIStatusError) as caught:
        client_for(base, key).chat.completions.create(model="demo", messages=USER)

    assert caught.value.status_code == 502
    assert caught.value.code == "provider_error"
    assert api_runs(base, key)[0]["status"] == "Failed"


def test_a_failed_run_ends_each_stream_with_an_error(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve([{"ErrorStatus": 400}])
    client = client_for(base, key)

    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="demo", messages=USER, stream=True))
    events = list(client.responses.create(model="demo", input="x", stream=True))

    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    failed = events[-1]
    assert failed.type == "response.failed"
    assert failed.response.status == "failed"
    assert failed.response.error is not None and failed.response.error.code == "provider_error"


# -- idempotency through the SDK --------------------------------------------------------


def test_an_idempotency_key_passed_as_an_extra_header_replays(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    client = client_for(base, key)
    extra = {"Idempotency-Key": "order-4182-v1"}

    first = client.chat.completions.with_raw_response.create(
        model="demo", messages=USER, extra_headers=extra
    )
    again = client.chat.completions.with_raw_response.create(
        model="demo", messages=USER, extra_headers=extra
    )

    assert first.parse().id == again.parse().id
    assert again.parse().choices[0].message.content == TEXT
    assert again.headers["Idempotency-Replayed"] == "true"
    assert first.http_response.content == again.http_response.content
    assert len(api_runs(base, key)) == 1

    responses = [
        client.responses.create(model="demo", input="x", extra_headers={"Idempotency-Key": "r"})
        for _ in range(2)
    ]
    assert responses[0].id == responses[1].id and len(api_runs(base, key)) == 2


def test_idempotency_errors_on_v1_use_the_openai_shape(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    client = client_for(base, key)
    client.chat.completions.create(
        model="demo", messages=USER, extra_headers={"Idempotency-Key": "k"}
    )

    with pytest.raises(openai.UnprocessableEntityError) as mismatch:
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "other"}],
            extra_headers={"Idempotency-Key": "k"},
        )
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model="demo", messages=USER, extra_headers={"Idempotency-Key": "k" * 256}
        )
    with pytest.raises(openai.BadRequestError) as streaming:
        client.responses.create(
            model="demo", input="x", stream=True, extra_headers={"Idempotency-Key": "s"}
        )

    assert mismatch.value.code == "idempotency_key_reused"
    assert too_long.value.code == streaming.value.code == "invalid_idempotency_key"
    assert isinstance(mismatch.value.body, dict) and set(mismatch.value.body) == {
        "message",
        "type",
        "param",
        "code",
    }


def test_idempotency_disabled_on_v1_is_501(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve(Idempotency={"Enabled": False})

    with pytest.raises(openai.APIStatusError) as caught:
        client_for(base, key).responses.create(
            model="demo", input="x", extra_headers={"Idempotency-Key": "k"}
        )

    assert caught.value.status_code == 501 and caught.value.code == "idempotency_disabled"
    assert api_runs(base, key) == []


def test_a_v1_run_is_cancellable_and_then_answers_409(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    rt, base, key = serve()
    rt.send_runs_with(hold_queued)
    outcome: list[BaseException] = []

    def ask() -> None:
        try:
            client_for(base, key).chat.completions.create(model="demo", messages=USER)
        except openai.APIStatusError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=ask)
    caller.start()
    wait_until(lambda: bool(api_runs(base, key)), what="the run of the call", timeout=10)
    run_id = api_runs(base, key)[0]["id"]

    cancel = httpx.post(
        f"{base}/api/runs/{run_id}/cancel", headers={"Authorization": f"Bearer {key}"}
    )
    caller.join(10)

    assert cancel.status_code == 202
    [error] = outcome
    assert isinstance(error, openai.ConflictError) and error.status_code == 409
    assert api_runs(base, key)[0]["status"] == "Canceled"


def test_openapi_describes_the_v1_routes_and_the_key(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, _ = serve()

    paths = httpx.get(f"{base}/openapi.json").json()["paths"]

    for path in ("/v1/chat/completions", "/v1/responses", "/api/agents/{name}/run"):
        names = [p["name"] for p in paths[path]["post"]["parameters"]]
        assert "Idempotency-Key" in names
        assert {"409", "422", "501"} <= set(paths[path]["post"]["responses"])


# -- models -----------------------------------------------------------------------------


def test_models_lists_the_agents_through_the_sdk(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    client = client_for(base, key)

    models = list(client.models.list())
    one = client.models.retrieve("demo")

    assert [(m.id, m.object, m.owned_by) for m in models] == [("demo", "model", "tracon")]
    assert isinstance(models[0].created, int) and models[0].created > 0
    assert one.id == "demo" and one.created == models[0].created
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nobody")
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        client_for(base, "tjk_nope_nope").models.list()


# -- streaming turn by turn -------------------------------------------------------------

FIRST = "Let me look that up."
SLOW_TURNS: list[dict[str, Any]] = [
    {"Text": FIRST, "ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 20}}]},
    {"Text": TEXT},
]


@pytest.fixture
def slow_turns(
    serve: Callable[..., tuple[Runtime, str, str]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[tuple[str, str, Path]]:
    """An agent whose first reply says something and calls `slow_step`, which waits until
    the returned `fast` flag file exists (at the latest when the test ends): (base URL, key,
    flag)."""
    monkeypatch.setenv("TRACON_TEST_FLAGS", str(tmp_path))
    agent = scripted_agent(SLOW_TURNS, ["slow_step"])
    _, base, key = serve(SLOW_TURNS, Agents=agent["Agents"])
    yield base, key, tmp_path / "fast"
    (tmp_path / "fast").touch()


def run_status(base: str, key: str, run_id: str) -> str:
    response = httpx.get(f"{base}/api/runs/{run_id}", headers={"Authorization": f"Bearer {key}"})
    status: str = response.json()["status"]
    return status


def test_chat_stream_sends_each_turns_text_while_the_run_goes_on(
    slow_turns: tuple[str, str, Path],
) -> None:
    base, key, fast = slow_turns

    chunks = iter(
        client_for(base, key).chat.completions.create(model="demo", messages=USER, stream=True)
    )
    role = next(chunks)
    first = next(chunks)
    run_id = api_runs(base, key)[0]["id"]

    assert role.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == FIRST
    assert run_status(base, key, run_id) == "Running"  # the tool is still working
    fast.touch()
    rest = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices)
    assert text == f"{FIRST}\n\n{TEXT}"
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "stop"
    assert run_status(base, key, run_id) == "Completed"


def test_response_stream_sends_each_turns_text_while_the_run_goes_on(
    slow_turns: tuple[str, str, Path],
) -> None:
    base, key, fast = slow_turns

    events = iter(
        client_for(base, key).responses.create(model="demo", input="Where is A-1?", stream=True)
    )
    opening = [next(events).type for _ in range(4)]
    first = next(events)
    run_id = api_runs(base, key)[0]["id"]

    assert opening == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert first.type == "response.output_text.delta" and first.delta == FIRST
    assert run_status(base, key, run_id) == "Running"
    fast.touch()
    rest = list(events)
    assert [event.type for event in rest] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    streamed = FIRST + "".join(e.delta for e in rest if e.type == "response.output_text.delta")
    assert streamed == f"{FIRST}\n\n{TEXT}"
    completed = rest[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == streamed
    assert [e.sequence_number for e in rest] == list(range(5, 10))


def test_a_stream_whose_turns_said_nothing_still_sends_the_output_once(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    script: list[dict[str, Any]] = [
        {"ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}]},
        {"Text": TEXT},
    ]
    _, base, key = serve(script, Agents=scripted_agent(script, ["lookup_order"])["Agents"])

    chunks = list(
        client_for(base, key).chat.completions.create(model="demo", messages=USER, stream=True)
    )

    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert deltas == [TEXT]


# -- the run id header ------------------------------------------------------------------


def test_every_v1_answer_that_made_a_run_names_it(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    client = client_for(base, key)
    headers = {"Authorization": f"Bearer {key}"}

    chat = client.chat.completions.with_raw_response.create(model="demo", messages=USER)
    response = client.responses.with_raw_response.create(model="demo", input="x")
    later = httpx.post(
        f"{base}/v1/responses",
        json={"model": "demo", "input": "x"},
        headers={**headers, "Prefer": "respond-async"},
    )
    streamed = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "demo", "messages": USER, "stream": True},
        headers=headers,
    )
    unknown = httpx.post(
        f"{base}/v1/chat/completions", json={"model": "nobody", "messages": USER}, headers=headers
    )

    assert chat.headers["X-Tracon-Run-Id"] == chat.parse().id.removeprefix("chatcmpl-")
    assert response.headers["X-Tracon-Run-Id"] == response.parse().id.removeprefix("resp_")
    assert later.status_code == 202
    assert later.headers["X-Tracon-Run-Id"] == later.json()["id"].removeprefix("resp_")
    assert streamed.headers["X-Tracon-Run-Id"] in {run["id"] for run in api_runs(base, key)}
    assert "X-Tracon-Run-Id" not in unknown.headers  # no run was made
    assert len({r.headers["X-Tracon-Run-Id"] for r in (chat, response, later, streamed)}) == 4


def test_a_failed_run_names_itself_in_its_error_answer(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve([{"ErrorStatus": 400}])

    with pytest.raises(openai.APIStatusError) as caught:
        client_for(base, key).chat.completions.create(model="demo", messages=USER)

    assert caught.value.status_code == 502
    assert caught.value.response.headers["X-Tracon-Run-Id"] == api_runs(base, key)[0]["id"]


def test_a_run_that_fails_after_a_turn_spoke_closes_the_message_then_fails(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    script: list[dict[str, Any]] = [
        {"Text": FIRST, "ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A"}}]},
        {"ErrorStatus": 400},
    ]
    _, base, key = serve(script, Agents=scripted_agent(script, ["lookup_order"])["Agents"])

    events = list(client_for(base, key).responses.create(model="demo", input="x", stream=True))

    assert [e.type for e in events][2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    done = events[-2]
    assert done.type == "response.output_item.done" and done.item.type == "message"
    assert done.item.status == "incomplete"
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.error is not None
    assert failed.response.error.code == "provider_error"


# -- the SDK's own retries ----------------------------------------------------------------


def retrying_client(base: str, key: str) -> openai.OpenAI:
    """The SDK as its users get it: `max_retries` left at its default (2)."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=20)


def test_a_failed_run_is_not_retried_by_the_sdk_one_call_makes_one_run(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve([{"ErrorStatus": 400}])
    client = retrying_client(base, key)
    assert client.max_retries == 2

    with pytest.raises(openai.APIStatusError) as chat:
        client.chat.completions.create(model="demo", messages=USER)
    chat_runs = len(api_runs(base, key))
    with pytest.raises(openai.APIStatusError) as response:
        client.responses.create(model="demo", input="x")

    assert (chat_runs, len(api_runs(base, key))) == (1, 2), "one run per call"
    assert chat.value.status_code == response.value.status_code == 502
    assert chat.value.response.headers["x-should-retry"] == "false"


CLOSE: list[dict[str, Any]] = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]},
    {"Text": "Done."},
]


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_run_that_waits_for_an_approval_raises_naming_the_run_and_the_approval(
    serve: Callable[..., tuple[Runtime, str, str]], route: str
) -> None:
    _, base, key = serve(CLOSE, Agents=scripted_agent(CLOSE, ["close_account"])["Agents"])
    client = retrying_client(base, key)

    with pytest.raises(openai.ConflictError) as caught:
        if route == "chat":
            client.chat.completions.create(model="demo", messages=USER)
        else:
            client.responses.create(model="demo", input="x")

    [run] = api_runs(base, key)
    [approval_id] = run["pendingApprovals"]
    error = caught.value
    assert run["status"] == "Waiting" and run["id"] in error.message
    assert approval_id in error.message
    assert error.code == "run_waiting_for_approval" and error.status_code == 409
    assert error.response.headers["X-Tracon-Run-Id"] == run["id"]
    assert error.response.headers["Location"] == f"/api/runs/{run['id']}"


def test_the_priority_header_sets_a_v1_runs_priority_and_a_bad_one_is_a_400(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    runtime, base, key = serve()
    headers = {"Authorization": f"Bearer {key}", "X-Tracon-Priority": "8"}
    body = {"model": "demo", "messages": USER}
    done = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=20)
    assert done.status_code == 200, done.text
    [run] = api_runs(base, key)
    found = runtime.runs.get(run["id"])
    assert found is not None and found.priority == 8
    for bad in ("10", "x", "-1"):
        refused = httpx.post(
            f"{base}/v1/chat/completions",
            json=body,
            headers={**headers, "X-Tracon-Priority": bad},
            timeout=20,
        )
        assert refused.status_code == 400, (bad, refused.text)
        assert "X-Tracon-Priority" in refused.text
    assert len(api_runs(base, key)) == 1  # nothing written for a refused one
