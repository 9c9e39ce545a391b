"""A run whose provider streams: its text goes out live while the call is in flight
(coalesced, in order, by byte offset), the stored conversation keeps only the completed
answer, a call cut mid-answer withdraws what it sent before the fallback link answers, and
the turn text is gone once the answer is written. The real openai client against the
streaming stub, live text in real Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.helpers import MakeRuntime, run_once, scripted_agent
from tests.stub_provider import Reply, StubProvider, stream_then_drop
from tracon_jobs.coordination.live_text import TextDelta

ANSWER = "The quick brown fox jumps over the lazy dog, and then it naps in the sun."


@pytest.fixture
def backup() -> Iterator[StubProvider]:
    with StubProvider() as server:
        yield server


def sections(primary: StubProvider, secondary: StubProvider | None = None) -> dict:
    config = scripted_agent([])
    config["Providers"] = {"a": {"Kind": "openai", "BaseUrl": primary.base_url}}
    model: dict = {"provider": "a", "model": "gpt-a"}
    if secondary is not None:
        config["Providers"]["b"] = {"Kind": "openai", "BaseUrl": secondary.base_url}
        model["fallbacks"] = [{"provider": "b", "model": "gpt-b"}]
    config["Agents"]["demo"]["Model"] = model
    return config


class Deltas:
    """Every delta the runtime's live text publishes, with when it arrived."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[float, TextDelta]] = []

    def __call__(self, delta: TextDelta) -> None:
        with self.lock:
            self.seen.append((time.monotonic(), delta))

    def of(self, run_id: str) -> list[TextDelta]:
        with self.lock:
            return [d for _, d in self.seen if d.run_id == run_id]


def test_a_streamed_answer_goes_out_live_in_order_and_is_stored_whole(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = make_runtime(sql_url, **sections(stub_provider))
    deltas = Deltas()
    listening = runtime.live_text.listen(deltas, lambda: None)
    try:
        stub_provider.enqueue(Reply(ANSWER, chunks=12, chunk_delay=0.05))
        run = run_once(runtime)
        ended = time.monotonic()
        time.sleep(0.2)  # the last publications on their way
    finally:
        listening.close()

    assert run.status == "Completed" and run.output == {"text": ANSWER}
    mine = deltas.of(run.id)
    assert len(mine) >= 3, f"the answer went out in {len(mine)} deltas"
    assert len(mine) <= 12, "more publications than the provider's chunks"
    offset = 0
    for delta in mine:  # contiguous, in order, nothing twice
        assert delta.offset == offset and not delta.withdrawn
        offset += len(delta.text)
    assert b"".join(d.text for d in mine) == ANSWER.encode()
    # out as the provider wrote its 12 chunks over 0.55 s, not at once when the call ended (the
    # spread says it: on a loaded machine the run itself may start late)
    times = [at for at, d in deltas.seen if d.run_id == run.id]
    assert max(times) - min(times) > 0.2, "the deltas went out at once"
    assert min(times) < ended
    events = runtime.runs.events(run.id)
    started_call = next(e for e in events if e.type == "ModelCallStarted")
    assert {d.call_seq for d in mine} == {started_call.seq}
    completed = next(e for e in events if e.type == "ModelCallCompleted")
    assert completed.data["text"] == ANSWER
    assert runtime.live_text.snapshot(run.id) is None, "the turn text outlived its answer"


def test_a_call_cut_mid_answer_withdraws_its_text_and_the_fallback_streams(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider, backup: StubProvider
) -> None:
    runtime = make_runtime(sql_url, **sections(stub_provider, backup))
    deltas = Deltas()
    listening = runtime.live_text.listen(deltas, lambda: None)
    try:
        stub_provider.enqueue(stream_then_drop("half an answer that never ends", 4))
        backup.enqueue(Reply("the fallback's answer", chunks=4, chunk_delay=0.05))
        run = run_once(runtime)
        time.sleep(0.2)
    finally:
        listening.close()

    assert run.status == "Completed" and run.output == {"text": "the fallback's answer"}
    calls = [e.seq for e in runtime.runs.events(run.id) if e.type == "ModelCallStarted"]
    assert len(calls) == 2
    mine = deltas.of(run.id)
    first = [d for d in mine if d.call_seq == calls[0]]
    assert first and first[-1].withdrawn, "the cut call's text was not withdrawn"
    assert any(d.text for d in first[:-1]), "the cut call sent no text before it failed"
    second = [d for d in mine if d.call_seq == calls[1]]
    assert b"".join(d.text for d in second) == b"the fallback's answer"
    assert not any(d.withdrawn for d in second)
    assert [m.get("content") for m in run.messages or [] if m["role"] == "assistant"] in (
        [],
        ["the fallback's answer"],
    ), "the stored conversation holds the withdrawn text"


def test_a_provider_set_not_to_stream_publishes_nothing(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    config = sections(stub_provider)
    config["Providers"]["a"]["Stream"] = False
    runtime = make_runtime(sql_url, **config)
    deltas = Deltas()
    listening = runtime.live_text.listen(deltas, lambda: None)
    try:
        stub_provider.enqueue(Reply(ANSWER, chunks=12, chunk_delay=0.01))
        run = run_once(runtime)
        time.sleep(0.1)
    finally:
        listening.close()
    assert run.status == "Completed" and run.output == {"text": ANSWER}
    assert deltas.of(run.id) == []
    assert stub_provider.requests[-1].get("stream") in (None, False)
