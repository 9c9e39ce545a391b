"""The model of B2: an OpenAI-compatible chat completions server on 127.0.0.1 that answers
every request after a fixed delay and counts the requests it holds at once. A request with
`"stream": true` gets its answer as `STREAM_PIECES` chunks spread evenly over the same delay
(the last one at its end), then a finish chunk, a usage chunk when asked, and `[DONE]`.

It runs on its own asyncio loop in a daemon thread of the benchmark process, so a hundred
requests waiting cost it a hundred timers, not a hundred threads, and the benchmark's own
CPU stays out of the worker's way. The HTTP it speaks is the little the clients send:
HTTP/1.1 with `Content-Length`, keep-alive. Counters are touched only on the loop thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any

from bench.harness import SSE_HEAD, completion_chunk, content_length, sse_data, sse_end
from tracon_jobs.embedded_redis import free_port

MODEL = "bench-model"
COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }
).encode()
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    + f"Content-Length: {len(COMPLETION)}\r\n\r\n".encode()
    + COMPLETION
)
STREAM_PIECES = 10
PIECES = [f"w{index} " for index in range(STREAM_PIECES)]
USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": STREAM_PIECES,
    "total_tokens": 10 + STREAM_PIECES,
}
CHUNKS = [
    sse_data(completion_chunk(MODEL, {"role": "assistant", "content": PIECES[0]}, None)),
    *(sse_data(completion_chunk(MODEL, {"content": piece}, None)) for piece in PIECES[1:]),
]
FINISH = sse_data(completion_chunk(MODEL, {}, "stop"))
USAGE_CHUNK = sse_data({**completion_chunk(MODEL, {}, None), "choices": [], "usage": USAGE})
LISTEN_BACKLOG = 1024
MAX_HEADER_BYTES = 65536


class SlowModel:
    """`with SlowModel(0.2) as model:` serves at `model.base_url` until the block ends."""

    def __init__(self, delay_seconds: float) -> None:
        self.delay = delay_seconds
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="b2-stub", daemon=True)

    def __enter__(self) -> SlowModel:
        self._thread.start()
        self._on_loop(self._start())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._on_loop(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def reset(self) -> None:
        """Zero the counters between two measurements (nothing may be in flight)."""
        self._on_loop(self._reset())

    def _on_loop(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, backlog=LISTEN_BACKLOG
        )

    async def _stop(self) -> None:
        """Stop listening and hang up on every client, so no connection outlives the loop."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _reset(self) -> None:
        self.calls = self.max_in_flight = self.connections = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while await self._answer_one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read one request, hold it `delay` seconds (streamed: send its chunks over them),
        answer; False once the client is gone."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        body = await reader.readexactly(content_length(head))
        request = json.loads(body or b"{}")
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if request.get("stream"):
                await self._stream(
                    writer, bool((request.get("stream_options") or {}).get("include_usage"))
                )
                return True
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        writer.write(RESPONSE)
        await writer.drain()
        return True

    async def _stream(self, writer: asyncio.StreamWriter, usage: bool) -> None:
        writer.write(SSE_HEAD)
        await writer.drain()
        started = self._loop.time()
        for index, chunk in enumerate(CHUNKS):
            due = started + self.delay * (index + 1) / len(CHUNKS)
            await asyncio.sleep(max(0.0, due - self._loop.time()))
            writer.write(chunk)
            await writer.drain()
        writer.write(FINISH + (USAGE_CHUNK if usage else b"") + sse_end())
        await writer.drain()
