"""`/v1/chat/completions` and `/v1/responses` with the official `openai` package as the
client, against the real Flask app served over HTTP, real SQL and real Redis.

Runs are executed by the real executor on a thread standing in for a worker.
"""

from __future__ import annotations

import inspect
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
from tests.stub_provider import StubProvider
from tracon_jobs.runtime import Runtime
from web import create_app
from web.openai_request import NEUTRAL

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


def error_message(error: openai.APIStatusError) -> str:
    """The server's own message, the error body's `message`: what the SDK's `.message` prints
    around it differs between its versions (the body's repr on the lowest allowed one)."""
    body = error.body
    assert isinstance(body, dict), body
    return str(body["message"])


def as_sent(create: Callable[..., Any], fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` as `create`'s keyword arguments, those this version of the SDK does not have
    yet (the lowest allowed one lacks some) in `extra_body`: the same JSON reaches the server."""
    known = inspect.signature(create).parameters
    given = {name: value for name, value in fields.items() if name in known}
    extra = {name: value for name, value in fields.items() if name not in known}
    return {**given, "extra_body": extra} if extra else given


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
    assert run["status"] == "Waiting" and run["id"] in error_message(error)
    assert approval_id in error_message(error)
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


# -- what the agent is configured with on the server ---------------------------------------

LOOKUP_TOOL: Any = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}


def test_a_request_that_gives_tools_or_asks_for_a_tool_call_is_refused_naming_the_field(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    client = client_for(base, key)
    chat: Any = client.chat.completions.create
    refused = {
        "tools": lambda: chat(model="demo", messages=USER, tools=[LOOKUP_TOOL]),
        "tool_choice": lambda: chat(model="demo", messages=USER, tool_choice="required"),
        "functions": lambda: chat(model="demo", messages=USER, functions=[{"name": "f"}]),
        "function_call": lambda: chat(model="demo", messages=USER, function_call={"name": "f"}),
    }
    responses: Any = client.responses.create
    refused_by_responses = {
        "tools": lambda: responses(model="demo", input="x", tools=[{"type": "web_search"}]),
        "tool_choice": lambda: responses(
            model="demo", input="x", tool_choice={"type": "function", "name": "lookup"}
        ),
    }

    for field, call in [*refused.items(), *refused_by_responses.items()]:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.param == field and caught.value.code == "unsupported_parameter"
        assert error_message(caught.value).startswith(f"{field}: ")
        assert "configured on the server (Agents.demo.Tools)" in error_message(caught.value)

    assert api_runs(base, key) == []


def test_an_empty_tools_list_and_tool_choice_auto_or_none_ask_for_nothing_and_are_served(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    client = client_for(base, key)

    chat = client.chat.completions.create(model="demo", messages=USER, tools=[], tool_choice="none")
    response = client.responses.create(model="demo", input="x", tool_choice="auto")

    assert chat.choices[0].message.content == TEXT and response.output_text == TEXT
    assert len(api_runs(base, key)) == 2


@pytest.fixture
def serve_stub(
    serve: Callable[..., tuple[Runtime, str, str]], stub_provider: StubProvider
) -> Callable[..., tuple[str, str]]:
    """The agent `demo` on the stub model server (whose `requests` show what the model got):
    temperature 0.2 and 800 output tokens of its own (`own` adds to its `Model`), calling the
    provider `stub` (OpenAI-compatible) or `claude` (anthropic); `fallback` adds a link."""

    def start(
        fallback: dict[str, Any] | None = None, provider: str = "stub", **own: Any
    ) -> tuple[str, str]:
        model: dict[str, Any] = {
            "provider": provider,
            "model": "stub-model",
            "temperature": 0.2,
            "maxOutputTokens": 800,
            **own,
        }
        providers: dict[str, Any] = {
            "stub": {"Kind": "openai", "BaseUrl": stub_provider.base_url},
            "claude": {"Kind": "anthropic", "BaseUrl": stub_provider.root_url},
        }
        if fallback is not None:
            model["fallbacks"] = [fallback]
        agent = {"Instructions": "test agent", "Model": model}
        _, base, key = serve(Providers=providers, Agents={"demo": agent})
        return base, key

    return start


def test_temperature_top_p_and_the_output_limit_of_a_request_reach_the_model(
    serve_stub: Callable[..., tuple[str, str]], stub_provider: StubProvider
) -> None:
    base, key = serve_stub()
    client = client_for(base, key)

    client.chat.completions.create(model="demo", messages=USER)
    client.chat.completions.create(
        model="demo", messages=USER, temperature=0.7, top_p=0.5, max_tokens=50
    )
    client.chat.completions.create(
        model="demo", messages=USER, max_tokens=90, max_completion_tokens=60
    )
    response = client.responses.create(model="demo", input="x", temperature=0, max_output_tokens=40)

    sent = [
        (body.get("temperature"), body.get("top_p"), body.get("max_tokens"))
        for body in stub_provider.requests
    ]
    assert sent == [(0.2, None, 800), (0.7, 0.5, 50), (0.2, None, 60), (0, None, 40)]
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0, None, 40)
    newest = api_runs(base, key)[0]
    assert newest["input"]["options"] == {"temperature": 0, "maxOutputTokens": 40}


def test_a_sampling_option_out_of_its_range_is_refused_naming_the_field(
    serve_stub: Callable[..., tuple[str, str]], stub_provider: StubProvider
) -> None:
    base, key = serve_stub()
    client = client_for(base, key)
    chat: Any = client.chat.completions.create
    responses: Any = client.responses.create
    refused = [
        ("temperature", lambda: chat(model="demo", messages=USER, temperature=2.5)),
        ("top_p", lambda: chat(model="demo", messages=USER, top_p=-0.1)),
        ("max_tokens", lambda: chat(model="demo", messages=USER, max_tokens=0)),
        (
            "max_completion_tokens",
            lambda: chat(model="demo", messages=USER, max_completion_tokens=1.5),
        ),
        ("temperature", lambda: responses(model="demo", input="x", temperature="0.5")),
        ("max_output_tokens", lambda: responses(model="demo", input="x", max_output_tokens=0)),
    ]

    for field, call in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.param == field, error_message(caught.value)
        assert error_message(caught.value).startswith(f"{field}: ")

    assert api_runs(base, key) == [] and stub_provider.requests == []


def test_a_temperature_an_anthropic_link_of_the_agent_cannot_take_is_refused(
    serve_stub: Callable[..., tuple[str, str]], stub_provider: StubProvider
) -> None:
    base, key = serve_stub(fallback={"provider": "claude", "model": "claude-model"})
    client = client_for(base, key)

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=USER, temperature=1.5)
    client.chat.completions.create(model="demo", messages=USER, temperature=1)

    assert caught.value.param == "temperature"
    assert "between 0 and 1 (got 1.5)" in error_message(caught.value)
    assert "anthropic provider 'claude'" in error_message(caught.value)
    assert [body["temperature"] for body in stub_provider.requests] == [1]


def test_system_and_developer_messages_follow_the_agents_instructions(
    serve_stub: Callable[..., tuple[str, str]], stub_provider: StubProvider
) -> None:
    base, key = serve_stub()
    client = client_for(base, key)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "developer", "content": "answer in French"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "salut"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "where is A-1?"},
    ]

    client.chat.completions.create(model="demo", messages=messages)
    client.responses.create(model="demo", input="hi", instructions="be brief")

    chat, response = (body["messages"] for body in stub_provider.requests)
    assert chat == [
        {"role": "system", "content": "test agent"},
        {"role": "system", "content": "answer in French"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "salut"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "where is A-1?"},
    ]
    assert response == [
        {"role": "system", "content": "test agent"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


# -- every other field of OpenAI's request --------------------------------------------------

CHAT_ASKS_FOR_MORE: list[tuple[str, dict[str, Any]]] = [
    ("n", {"n": 2}),
    ("logprobs", {"logprobs": True}),
    ("top_logprobs", {"top_logprobs": 3}),
    ("store", {"store": False}),
    ("service_tier", {"service_tier": "flex"}),
    ("moderation", {"moderation": {"model": "omni-moderation-latest"}}),
    ("prediction", {"prediction": {"type": "content", "content": "It shipped."}}),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("web_search_options", {"web_search_options": {}}),
    (
        "stream_options.include_obfuscation",
        {"stream": True, "stream_options": {"include_obfuscation": True}},
    ),
    ("prompt_cache_options.prewarm", {"prompt_cache_options": {"prewarm": True}}),
    (
        "prompt_cache_options.comparison_response_id",
        {"prompt_cache_options": {"comparison_response_id": "resp_1"}},
    ),
]
RESPONSES_ASK_FOR_MORE: list[tuple[str, dict[str, Any]]] = [
    ("background", {"background": True}),
    ("background_options", {"background_options": {"completion_window": "2h"}}),
    ("conversation", {"conversation": "conv_1"}),
    ("previous_response_id", {"previous_response_id": "resp_1"}),
    ("include", {"include": ["message.output_text.logprobs"]}),
    ("max_tool_calls", {"max_tool_calls": 1}),
    ("prompt", {"prompt": {"id": "pmpt_1"}}),
    ("truncation", {"truncation": "auto"}),
    ("context_management", {"context_management": [{"type": "compaction"}]}),
    ("image", {"image": {"context_compression": "enabled"}}),
    ("access_programs", {"access_programs": {"cyber": "standard"}}),
    ("reasoning.summary", {"reasoning": {"summary": "auto"}}),
    ("reasoning.generate_summary", {"reasoning": {"generate_summary": "concise"}}),
    ("reasoning.context", {"reasoning": {"context": "all_turns"}}),
    ("reasoning.mode", {"reasoning": {"mode": "pro"}}),
    ("store", {"store": False}),
    ("service_tier", {"service_tier": "priority"}),
    ("top_logprobs", {"top_logprobs": 5}),
    (
        "stream_options.include_obfuscation",
        {"stream": True, "stream_options": {"include_obfuscation": True}},
    ),
]


def test_a_field_a_run_cannot_honour_is_refused_at_any_value_that_asks_for_something(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    client = client_for(base, key)
    chat: Any = client.chat.completions.create
    responses: Any = client.responses.create
    calls: list[tuple[str, Callable[..., Any]]] = [
        (field, lambda extra=extra: chat(model="demo", messages=USER, **as_sent(chat, extra)))
        for field, extra in CHAT_ASKS_FOR_MORE
    ] + [
        (field, lambda extra=extra: responses(model="demo", input="x", **as_sent(responses, extra)))
        for field, extra in RESPONSES_ASK_FOR_MORE
    ]

    messages = {}
    for field, call in calls:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert (caught.value.param, caught.value.code) == (field, "unsupported_parameter")
        assert error_message(caught.value).startswith(f"{field}: only ")
        messages[field] = error_message(caught.value)

    assert {field for field, _ in calls} == set(NEUTRAL)  # each of them is tried
    assert messages["n"].endswith("n: only null or 1 (got 2): a run gives one answer")
    assert "every run is recorded, readable at GET /api/runs/{id}" in messages["store"]
    assert api_runs(base, key) == []


def test_the_values_that_ask_for_nothing_and_the_bookkeeping_fields_are_served_unsent(
    serve_stub: Callable[..., tuple[str, str]], stub_provider: StubProvider
) -> None:
    base, key = serve_stub()
    client: Any = client_for(base, key)  # fields the SDK's types leave out, or type narrowly
    shared: dict[str, Any] = {
        "user": "user-1",
        "safety_identifier": "hash-1",
        "prompt_cache_key": "support",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m", "prewarm": False},
        "parallel_tool_calls": False,
        "store": True,
        "service_tier": "auto",
        "top_logprobs": 0,
        "tools": [],
        "tool_choice": "auto",
    }

    chat = client.chat.completions.create(
        model="demo",
        messages=USER,
        n=1,
        logprobs=False,
        modalities=["text"],
        stop=[],
        logit_bias={},
        **shared,
    )
    response = client.responses.create(
        model="demo",
        input="x",
        background=False,
        include=[],
        truncation="disabled",
        context_management=[],
        reasoning={"context": "auto", "mode": "standard", "summary": None},
        text={"format": None, "verbosity": None},
        **shared,
    )
    chunks = client.chat.completions.create(
        model="demo",
        messages=USER,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        service_tier="default",
    )

    assert chat.choices[0].message.content == "stub reply"
    assert response.output_text == "stub reply"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "stub reply"
    sent = stub_provider.requests
    assert len(sent) == 3
    for body in sent:  # what the model is sent is the agent's own, as with no such field
        assert set(body) <= {
            "model",
            "messages",
            "temperature",
            "max_tokens",
            "stream",
            "stream_options",
        }
    assert all(run["input"].keys() == {"message", "messages"} for run in api_runs(base, key))


def test_stop_seed_penalties_bias_effort_verbosity_and_format_of_a_request_reach_the_model(
    serve_stub: Callable[..., tuple[str, str]], stub_provider: StubProvider
) -> None:
    base, key = serve_stub()
    client: Any = client_for(base, key)
    schema = {"type": "object", "properties": {"where": {"type": "string"}}}

    client.chat.completions.create(
        model="demo",
        messages=USER,
        stop="END",
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-1,
        logit_bias={"50256": -100},
        reasoning_effort="low",
        verbosity="high",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "where", "schema": schema, "strict": True},
        },
    )
    response = client.responses.create(
        model="demo",
        input="x",
        text={
            "format": {"type": "json_schema", "name": "where", "schema": schema},
            "verbosity": "low",
        },
        reasoning={"effort": "minimal"},
    )

    chat_sent, response_sent = stub_provider.requests
    honoured = ["stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias"]
    honoured += ["reasoning_effort", "verbosity", "response_format"]
    assert {name: chat_sent.get(name) for name in honoured} == {
        "stop": ["END"],
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "logit_bias": {"50256": -100},
        "reasoning_effort": "low",
        "verbosity": "high",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "where", "schema": schema, "strict": True},
        },
    }
    assert response_sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "where", "schema": schema},
    }
    assert (response_sent["verbosity"], response_sent["reasoning_effort"]) == ("low", "minimal")
    assert "stop" not in response_sent and "seed" not in response_sent
    response_run, chat_run = api_runs(base, key)
    assert chat_run["input"]["options"] == {
        "stop": ["END"],
        "seed": 7,
        "presencePenalty": 0.5,
        "frequencyPenalty": -1,
        "logitBias": {"50256": -100},
        "reasoningEffort": "low",
        "verbosity": "high",
        "responseFormat": chat_sent["response_format"],
    }
    assert response.id == f"resp_{response_run['id']}"


def test_a_requests_response_format_replaces_the_agents_and_text_asks_for_none(
    serve_stub: Callable[..., tuple[str, str]], stub_provider: StubProvider
) -> None:
    base, key = serve_stub(responseFormat={"type": "json_object"})
    client = client_for(base, key)

    client.chat.completions.create(model="demo", messages=USER)
    client.chat.completions.create(model="demo", messages=USER, response_format={"type": "text"})
    client.responses.create(model="demo", input="x", text={"format": {"type": "text"}})

    formats = [body.get("response_format") for body in stub_provider.requests]
    assert formats == [{"type": "json_object"}, None, None]


def test_an_anthropic_link_takes_stop_as_stop_sequences_and_refuses_what_it_has_none_of(
    serve_stub: Callable[..., tuple[str, str]], stub_provider: StubProvider
) -> None:
    base, key = serve_stub(provider="claude")
    client = client_for(base, key)
    chat: Any = client.chat.completions.create
    responses: Any = client.responses.create
    refused: list[tuple[str, Callable[..., Any]]] = [
        (field, lambda extra=extra: chat(model="demo", messages=USER, **extra))
        for field, extra in [
            ("seed", {"seed": 0}),
            ("presence_penalty", {"presence_penalty": 0.5}),
            ("frequency_penalty", {"frequency_penalty": -0.5}),
            ("logit_bias", {"logit_bias": {"50256": 5}}),
            ("reasoning_effort", {"reasoning_effort": "high"}),
            ("verbosity", {"verbosity": "low"}),
            ("response_format", {"response_format": {"type": "json_object"}}),
            ("stop", {"stop": ["END", " \n"]}),
        ]
    ] + [
        (field, lambda extra=extra: responses(model="demo", input="x", **extra))
        for field, extra in [
            ("reasoning.effort", {"reasoning": {"effort": "low"}}),
            ("text.verbosity", {"text": {"verbosity": "high"}}),
            ("text.format", {"text": {"format": {"type": "json_object"}}}),
        ]
    ]

    for field, call in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert (caught.value.param, caught.value.code) == (field, "unsupported_parameter")
        assert error_message(caught.value).startswith(f"{field}: an anthropic ")
        assert "the agent 'demo' calls the anthropic provider 'claude'" in error_message(
            caught.value
        )
    assert api_runs(base, key) == [] and stub_provider.requests == []

    chat(model="demo", messages=USER, stop=["END", "STOP"], presence_penalty=0, logit_bias={})

    [sent] = stub_provider.requests
    assert sent["stop_sequences"] == ["END", "STOP"]
    assert not sent.keys() & {"stop", "seed", "presence_penalty", "logit_bias"}


def test_an_anthropic_fallback_link_refuses_a_seed_before_any_run_is_made(
    serve_stub: Callable[..., tuple[str, str]], stub_provider: StubProvider
) -> None:
    base, key = serve_stub(fallback={"provider": "claude", "model": "claude-model"})

    with pytest.raises(openai.BadRequestError) as caught:
        client_for(base, key).chat.completions.create(model="demo", messages=USER, seed=3)

    assert caught.value.param == "seed" and "anthropic provider 'claude'" in error_message(
        caught.value
    )
    assert api_runs(base, key) == [] and stub_provider.requests == []


def test_metadata_is_kept_with_the_run_and_shown_on_its_response(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    client = client_for(base, key)
    metadata = {"ticket": "T-1", "team": "ops"}

    response = client.responses.create(model="demo", input="x", metadata=metadata)
    client.chat.completions.create(model="demo", messages=USER, metadata={"ticket": "T-2"})
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="demo", input="x", metadata={f"k{i}": "v" for i in range(17)})

    assert response.metadata == metadata
    chat_run, response_run = api_runs(base, key)
    assert chat_run["input"]["metadata"] == {"ticket": "T-2"}
    assert response_run["input"]["metadata"] == metadata
    assert caught.value.param == "metadata"


def test_a_field_the_route_does_not_have_is_refused_as_an_unknown_parameter(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    client = client_for(base, key)
    chat: Any = client.chat.completions.create
    responses: Any = client.responses.create
    unknown: list[tuple[str, Callable[[], Any]]] = [
        ("top_k", lambda: chat(model="demo", messages=USER, extra_body={"top_k": 40})),
        ("input", lambda: chat(model="demo", messages=USER, extra_body={"input": "x"})),
        ("seed", lambda: responses(model="demo", input="x", extra_body={"seed": 1})),
        (
            "stream_options.include_usage",
            lambda: responses(
                model="demo", input="x", stream=True, stream_options={"include_usage": True}
            ),
        ),
        (
            "response_format.json_schema.schemas",
            lambda: chat(
                model="demo",
                messages=USER,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schemas": {}},
                },
            ),
        ),
        (
            "text.format.json_schema",
            lambda: responses(
                model="demo", input="x", text={"format": {"type": "text", "json_schema": {}}}
            ),
        ),
        ("reasoning.budget", lambda: responses(model="demo", input="x", reasoning={"budget": 9})),
    ]

    for field, call in unknown:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert (caught.value.param, caught.value.code) == (field, "unknown_parameter")
        assert error_message(caught.value).startswith(f"{field}: unknown parameter")

    assert api_runs(base, key) == []


def test_an_option_of_the_wrong_shape_is_refused_naming_the_field(
    serve: Callable[..., tuple[Runtime, str, str]],
) -> None:
    _, base, key = serve()
    client = client_for(base, key)
    chat: Any = client.chat.completions.create
    responses: Any = client.responses.create
    refused: list[tuple[str, Callable[[], Any]]] = [
        ("stop", lambda: chat(model="demo", messages=USER, stop=["a", "b", "c", "d", "e"])),
        ("stop.0", lambda: chat(model="demo", messages=USER, stop=[""])),
        ("seed", lambda: chat(model="demo", messages=USER, seed=1.5)),
        ("presence_penalty", lambda: chat(model="demo", messages=USER, presence_penalty=2.5)),
        ("logit_bias.x.[key]", lambda: chat(model="demo", messages=USER, logit_bias={"x": 1})),
        ("logit_bias.1", lambda: chat(model="demo", messages=USER, logit_bias={"1": 101})),
        ("reasoning_effort", lambda: chat(model="demo", messages=USER, reasoning_effort="most")),
        (
            "response_format",
            lambda: chat(model="demo", messages=USER, response_format={"type": "json_schema"}),
        ),
        (
            "text.format",
            lambda: responses(
                model="demo", input="x", text={"format": {"type": "json_schema", "name": "a"}}
            ),
        ),
        ("text.verbosity", lambda: responses(model="demo", input="x", text={"verbosity": "max"})),
    ]

    for field, call in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.param == field, error_message(caught.value)
        assert error_message(caught.value).startswith(f"{field}: ")

    assert api_runs(base, key) == []
