"""A scriptable model server for tests, on 127.0.0.1 and an ephemeral port: OpenAI's chat
completions (`base_url`) and Anthropic's Messages API (`root_url`) both.

It speaks real HTTP so that the provider code under test runs its real client, timeouts and
connection handling. Each `POST /v1/chat/completions` or `POST /v1/messages` consumes one
queued behaviour (a reply, a tool call, an error, a hang, a dropped connection), answered in
that API's shape; when the queue is empty the default behaviour answers.

    with StubProvider() as stub:
        stub.enqueue(error(503), reply("hello"))
        ... OpenAIProvider("stub", base_url=stub.base_url, ...) ...
        assert len(stub.requests) == 2
"""

from __future__ import annotations

import itertools
import json
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import Any, Protocol

from tests.local_server import LocalServer

_ids = itertools.count(1)


class Behaviour(Protocol):
    """How the stub answers one chat completions request."""

    def respond(self, exchange: Exchange) -> None: ...


@dataclass(frozen=True)
class StubToolCall:
    name: str
    arguments: dict[str, Any]
    call_id: str | None = None


@dataclass(frozen=True)
class Reply:
    text: str | None
    tool_calls: Sequence[StubToolCall] = ()
    input_tokens: int = 10
    output_tokens: int = 5
    model: str | None = None
    cached_input_tokens: int = 0  # of input_tokens, served from the prompt cache
    chunks: int | None = None  # a streamed text in this many pieces (None: about 4 chars each)
    chunk_delay: float = 0.0
    stop_reason: str | None = None  # Anthropic's (None: tool_use with tool calls, else end_turn)
    headers: Mapping[str, str] = field(default_factory=dict)  # sent with the answer

    def respond(self, exchange: Exchange) -> None:
        headers = dict(self.headers)
        if exchange.body.get("stream"):
            events = (
                self.message_events(exchange.body)
                if exchange.api == "anthropic"
                else self.completion_chunks(exchange.body)
            )
            exchange.send_events(events, self.chunk_delay, headers=headers)
        elif exchange.api == "anthropic":
            exchange.send_json(200, self.message(exchange.body), headers)
        else:
            exchange.send_json(200, self.completion(exchange.body), headers)

    def message(self, body: dict[str, Any]) -> dict[str, Any]:
        """A Messages API `message` as Anthropic returns it."""
        content: list[dict[str, Any]] = []
        if self.text is not None:
            content.append({"type": "text", "text": self.text})
        content.extend(
            {
                "type": "tool_use",
                "id": call.call_id or f"toolu_stub_{next(_ids)}",
                "name": call.name,
                "input": call.arguments,
            }
            for call in self.tool_calls
        )
        return {
            "id": f"msg_stub_{next(_ids)}",
            "type": "message",
            "role": "assistant",
            "model": self.model or body.get("model", "stub-model"),
            "content": content,
            "stop_reason": self.stop_reason or ("tool_use" if self.tool_calls else "end_turn"),
            "stop_sequence": None,
            "usage": {  # Anthropic's input_tokens leave out the prompt cache's
                "input_tokens": self.input_tokens - self.cached_input_tokens,
                "cache_read_input_tokens": self.cached_input_tokens,
                "output_tokens": self.output_tokens,
            },
        }

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """A `chat.completion` object as OpenAI returns it."""
        return {
            "id": f"chatcmpl-stub-{next(_ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model or body.get("model", "stub-model"),
            "choices": [
                {
                    "index": 0,
                    "message": self._message(),
                    "logprobs": None,
                    "finish_reason": "tool_calls" if self.tool_calls else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": self.input_tokens,
                "completion_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_input_tokens},
            },
        }

    def pieces(self, whole: str) -> list[str]:
        count = self.chunks or max(1, len(whole) // 4)
        size = max(1, -(-len(whole) // count))
        return [whole[at : at + size] for at in range(0, len(whole), size)] or [whole]

    def completion_chunks(self, body: dict[str, Any]) -> list[str]:
        """The completion as `chat.completion.chunk` frames, then usage, then `[DONE]`."""
        whole = self.completion(body)
        message = whole["choices"][0]["message"]

        def frame(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
            chunk = {"id": whole["id"], "object": "chat.completion.chunk", "model": whole["model"]}
            return json.dumps({**chunk, "choices": choices, **extra})

        frames = [frame({"role": "assistant"})]
        if message["content"] is not None:
            frames += [frame({"content": piece}) for piece in self.pieces(message["content"])]
        for index, call in enumerate(message.get("tool_calls") or []):
            head = {"index": index, "id": call["id"], "type": "function"}
            function = {"name": call["function"]["name"], "arguments": ""}
            frames.append(frame({"tool_calls": [{**head, "function": function}]}))
            for fragment in self.pieces(call["function"]["arguments"]):
                part = {"index": index, "function": {"arguments": fragment}}
                frames.append(frame({"tool_calls": [part]}))
        frames.append(frame({}, whole["choices"][0]["finish_reason"]))
        if json.dumps(body.get("stream_options", {})).find("include_usage") >= 0:
            usage = {"id": whole["id"], "object": "chat.completion.chunk", "model": whole["model"]}
            frames.append(json.dumps({**usage, "choices": [], "usage": whole["usage"]}))
        return [f"data: {item}\n\n" for item in frames] + ["data: [DONE]\n\n"]

    def message_events(self, body: dict[str, Any]) -> list[str]:
        """The message as Messages stream events."""
        whole = self.message(body)
        usage = dict(whole["usage"])
        output_tokens = usage.pop("output_tokens")
        start = {
            **whole,
            "content": [],
            "stop_reason": None,
            "usage": {**usage, "output_tokens": 1},
        }
        events: list[tuple[str, dict[str, Any]]] = [("message_start", {"message": start})]
        for index, block in enumerate(whole["content"]):
            if block["type"] == "text":
                events.append(
                    (
                        "content_block_start",
                        {"index": index, "content_block": {"type": "text", "text": ""}},
                    )
                )
                events += [
                    (
                        "content_block_delta",
                        {"index": index, "delta": {"type": "text_delta", "text": piece}},
                    )
                    for piece in self.pieces(block["text"])
                ]
            else:
                head = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                events.append(("content_block_start", {"index": index, "content_block": head}))
                events += [
                    (
                        "content_block_delta",
                        {
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": piece},
                        },
                    )
                    for piece in self.pieces(json.dumps(block["input"]))
                ]
            events.append(("content_block_stop", {"index": index}))
        delta = {"stop_reason": whole["stop_reason"], "stop_sequence": None}
        events.append(
            ("message_delta", {"delta": delta, "usage": {"output_tokens": output_tokens}})
        )
        events.append(("message_stop", {}))
        return [
            f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"
            for name, data in events
        ]

    def _message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.call_id or f"call_stub_{next(_ids)}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
                for call in self.tool_calls
            ]
        return message


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


@dataclass(frozen=True)
class Error:
    status: int
    retry_after: str | None = None
    message: str = "stub error"
    error_type: str = "server_error"

    def respond(self, exchange: Exchange) -> None:
        body: dict[str, Any] = {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": None,
                "code": None,
            }
        }
        if exchange.api == "anthropic":
            kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error")
            body = {"type": "error", "error": {"type": kind, "message": self.message}}
        headers = {"Retry-After": self.retry_after} if self.retry_after is not None else {}
        exchange.send_json(self.status, body, headers)


@dataclass(frozen=True)
class Hang:
    """Sleep, then answer with `then`; a stopping server ends the sleep and drops instead."""

    seconds: float
    then: Behaviour = field(default_factory=lambda: Reply("late reply"))

    def respond(self, exchange: Exchange) -> None:
        deadline = time.monotonic() + self.seconds
        while (remaining := deadline - time.monotonic()) > 0:
            if exchange.stopping.wait(min(remaining, 0.05)) or exchange.client_gone():
                return
        self.then.respond(exchange)


@dataclass(frozen=True)
class Raw:
    """Answer 200 with `body` as it is (JSON or not): a provider that misbehaves."""

    body: bytes
    content_type: str = "application/json"

    def respond(self, exchange: Exchange) -> None:
        handler = exchange._handler
        handler.send_response(200)
        handler.send_header("Content-Type", self.content_type)
        handler.send_header("Content-Length", str(len(self.body)))
        handler.end_headers()
        handler.wfile.write(self.body)


@dataclass(frozen=True)
class Drop:
    """Close the connection without a response, as a crashing upstream would."""

    def respond(self, exchange: Exchange) -> None:
        exchange.close_connection()


def reply(
    text: str | None,
    *,
    input_tokens: int = 10,
    output_tokens: int = 5,
    model: str | None = None,
) -> Reply:
    return Reply(text, input_tokens=input_tokens, output_tokens=output_tokens, model=model)


def tool_call(
    name: str,
    arguments: dict[str, Any],
    *,
    call_id: str | None = None,
    text: str | None = None,
) -> Reply:
    return Reply(text, tool_calls=(StubToolCall(name, arguments, call_id),))


def tool_calls(*calls: StubToolCall, text: str | None = None) -> Reply:
    return Reply(text, tool_calls=calls)


def error(
    status: int, *, retry_after: float | str | None = None, message: str = "stub error"
) -> Error:
    header = None if retry_after is None else _header_value(retry_after)
    return Error(status, retry_after=header, message=message)


def hang(seconds: float, then: Behaviour | None = None) -> Hang:
    return Hang(seconds, then or Reply("late reply"))


def drop() -> Drop:
    return Drop()


def _header_value(value: float | str) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class Exchange:
    """One request as a behaviour sees it: the JSON body and ways to answer."""

    def __init__(
        self,
        handler: _Handler,
        body: dict[str, Any],
        stopping: threading.Event,
        api: str = "openai",
    ):
        self._handler = handler
        self.body = body
        self.stopping = stopping
        self.api = api  # "openai" or "anthropic": the shape of the answer

    def send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        handler = self._handler
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)

    def send_events(
        self,
        events: Sequence[str],
        delay: float = 0.0,
        *,
        end: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Answer as server-sent events, one chunk per event, `delay` between them, on a
        connection kept alive (as the providers do: a client may use it again); without
        `end`, the body is left unfinished and the connection closed."""
        handler = self._handler
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Transfer-Encoding", "chunked")
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        for index, event in enumerate(events):
            if index and delay and self.stopping.wait(delay):
                handler.close_connection = True
                return
            data = event.encode()
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            handler.wfile.flush()
        if not end:
            self.close_connection()
            return
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()

    def client_gone(self) -> bool:
        """True once the client closed its end (an aborted call), so a hang can end early."""
        connection = self._handler.connection
        readable, _, _ = select.select([connection], [], [], 0)
        if not readable:
            return False
        try:
            return not connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    def close_connection(self) -> None:
        self._handler.close_connection = True


class StubProvider:
    """The server, its behaviour queue and what it received."""

    def __init__(self, default: Behaviour | None = None) -> None:
        self.default: Behaviour = default or Reply("stub reply")
        self._lock = threading.Lock()
        self._queue: deque[Behaviour] = deque()
        self._requests: list[dict[str, Any]] = []
        self._arrivals: list[float] = []
        self._headers: list[dict[str, str]] = []
        self._peers: list[tuple[str, int]] = []
        self._in_progress = 0
        self.peak_in_progress = 0
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._running_server().server_address[:2]
        return f"http://{host!s}:{port}/v1"

    @property
    def root_url(self) -> str:
        """The server's root, as Anthropic's client takes it (it adds `/v1/messages`)."""
        host, port = self._running_server().server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """The JSON bodies received so far, oldest first (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def arrivals(self) -> list[float]:
        """When each request arrived (`time.monotonic()`), oldest first (a copy)."""
        with self._lock:
            return list(self._arrivals)

    @property
    def request_headers(self) -> list[dict[str, str]]:
        with self._lock:
            return list(self._headers)

    @property
    def peers(self) -> list[tuple[str, int]]:
        """The client address of each request: one per connection the client opened."""
        with self._lock:
            return list(self._peers)

    @property
    def in_progress(self) -> int:
        with self._lock:
            return self._in_progress

    def enqueue(self, *behaviours: Behaviour) -> None:
        with self._lock:
            self._queue.extend(behaviours)

    def start(self) -> StubProvider:
        self._stopping = threading.Event()
        server = _Server(("127.0.0.1", 0), _Handler)
        server.stub = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; requests still hanging are released and dropped."""
        self._stopping.set()
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> StubProvider:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def handle(self, handler: _Handler, body: dict[str, Any], api: str) -> None:
        with self._lock:
            self._peers.append(handler.client_address[:2])
        behaviour = self._begin(body, dict(handler.headers.items()))
        try:
            behaviour.respond(Exchange(handler, body, self._stopping, api))
        except OSError:
            pass  # the client went away (an aborted call): nothing left to answer
        finally:
            with self._lock:
                self._in_progress -= 1

    def _begin(self, body: dict[str, Any], headers: dict[str, str]) -> Behaviour:
        with self._lock:
            self._requests.append(body)
            self._arrivals.append(time.monotonic())
            self._headers.append(headers)
            self._in_progress += 1
            self.peak_in_progress = max(self.peak_in_progress, self._in_progress)
            return self._queue.popleft() if self._queue else self.default

    def _running_server(self) -> _Server:
        if self._server is None:
            raise RuntimeError("StubProvider is not started")
        return self._server


class _Server(LocalServer):
    stub: StubProvider


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self._read_json()
        api = _APIS.get(self.path.rstrip("/"))
        if api is None:
            Error(404, message=f"no route {self.path}").respond(Exchange(self, body, _NEVER))
            return
        self.server.stub.handle(self, body, api)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            payload = {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}
            Exchange(self, {}, _NEVER).send_json(200, payload)
            return
        Error(404, message=f"no route {self.path}").respond(Exchange(self, {}, _NEVER))

    def _read_json(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            parsed = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            return {"_raw": raw.decode(errors="replace")}
        return parsed if isinstance(parsed, dict) else {"_json": parsed}

    def log_message(self, format: str, *args: Any) -> None:
        """Keep test output clean: the stub's requests are asserted on, not logged."""


_NEVER = threading.Event()
_APIS = {"/v1/chat/completions": "openai", "/v1/messages": "anthropic"}


@dataclass(frozen=True)
class StreamThenDrop:
    """Stream the first `after_chunks` events of `reply`, then close the connection: an
    upstream that dies mid-answer."""

    reply: Reply
    after_chunks: int = 2

    def respond(self, exchange: Exchange) -> None:
        events = (
            self.reply.message_events(exchange.body)
            if exchange.api == "anthropic"
            else self.reply.completion_chunks(exchange.body)
        )
        exchange.send_events(events[: self.after_chunks], end=False)


def stream_then_drop(text: str, after_chunks: int = 2) -> StreamThenDrop:
    return StreamThenDrop(Reply(text), after_chunks)


@dataclass(frozen=True)
class StreamThenError:
    """Stream the first `after_chunks` Messages events of `reply`, then an `event: error`
    frame: an Anthropic upstream that fails mid-answer (the Messages API only)."""

    reply: Reply
    after_chunks: int = 4
    error_type: str = "overloaded_error"
    message: str = "Overloaded"

    def respond(self, exchange: Exchange) -> None:
        events = self.reply.message_events(exchange.body)[: self.after_chunks]
        payload = {"type": "error", "error": {"type": self.error_type, "message": self.message}}
        failure = f"event: error\ndata: {json.dumps(payload)}\n\n"
        exchange.send_events([*events, failure], self.reply.chunk_delay)


def stream_then_error(
    text: str,
    after_chunks: int = 4,
    error_type: str = "overloaded_error",
    message: str = "Overloaded",
) -> StreamThenError:
    return StreamThenError(Reply(text), after_chunks, error_type, message)
