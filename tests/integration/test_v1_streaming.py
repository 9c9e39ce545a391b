"""`/v1/chat/completions` and `/v1/responses` with `stream=True`, as the official openai
client asks for them: the answer's content arrives delta by delta while the model writes it
(a streaming provider: the stub through the real client), then the usage and the end."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from openai import OpenAI
from werkzeug.serving import BaseWSGIServer, make_server

from tests.helpers import MakeRuntime, ThreadWorker, scripted_agent
from tests.stub_provider import Reply, StubProvider
from tracon_jobs.runtime import Runtime
from web import create_app

ANSWER = " ".join(f"token{i}" for i in range(24))
CHUNKS = 12
CHUNK_DELAY = 0.2  # 2.4 s in all: a loaded machine's start-up stays a small part of it


@pytest.fixture
def served(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    thread_worker: ThreadWorker,
    stub_provider: StubProvider,
) -> Iterator[tuple[Runtime, OpenAI]]:
    config = scripted_agent([])
    config["Providers"] = {"typist": {"Kind": "openai", "BaseUrl": stub_provider.base_url}}
    config["Agents"]["demo"]["Model"] = {"provider": "typist", "model": "typist-model"}
    runtime = make_runtime(sqlite_url, **config)
    runtime.send_runs_with(thread_worker.sender(runtime))
    app = create_app(runtime, {"TESTING": True})
    server: BaseWSGIServer = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    client = OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key=key)
    yield runtime, client
    client.close()
    server.shutdown()
    thread.join(5)


def test_chat_completions_stream_the_answer_as_it_is_written(
    served: tuple[Runtime, OpenAI], stub_provider: StubProvider
) -> None:
    _runtime, client = served
    stub_provider.enqueue(Reply(ANSWER, chunks=CHUNKS, chunk_delay=CHUNK_DELAY))
    started = time.monotonic()
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "count"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    arrivals: list[tuple[float, str]] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                arrivals.append((time.monotonic() - started, choice.delta.content))
    text = "".join(piece for _, piece in arrivals)
    assert text == ANSWER
    assert len(arrivals) >= 3, f"the answer came in {len(arrivals)} deltas"
    provider_time = CHUNKS * CHUNK_DELAY
    # written as the provider wrote it, over its 2.4 s, not at once when the call ended (on a
    # loaded machine the run may start late: the spread is what says it, not the first delta)
    spread = arrivals[-1][0] - arrivals[0][0]
    assert spread > provider_time * 0.4, (
        f"the deltas came within {spread:.2f} s of each other, of a {provider_time:.1f} s answer"
    )
    assert usage is not None and usage.completion_tokens > 0


def test_responses_stream_output_text_deltas(
    served: tuple[Runtime, OpenAI], stub_provider: StubProvider
) -> None:
    _runtime, client = served
    stub_provider.enqueue(Reply(ANSWER, chunks=CHUNKS, chunk_delay=CHUNK_DELAY))
    deltas: list[str] = []
    completed = None
    with client.responses.stream(model="demo", input="count") as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                completed = event.response
    assert "".join(deltas) == ANSWER
    assert len(deltas) >= 3, f"the answer came in {len(deltas)} deltas"
    assert completed is not None and completed.output_text == ANSWER
