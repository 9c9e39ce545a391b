"""A fake of Slack's Web API: a real HTTP server on 127.0.0.1 that answers `chat.postMessage`,
`chat.update` and `chat.postEphemeral` as Slack does, for the official `slack_sdk` client
(`WebClient(base_url=fake.api_url)`).

As Slack: every call needs `Authorization: Bearer <token>` (else HTTP 200 `{"ok": false,
"error": "not_authed" | "invalid_auth"}`); a post answers `{"ok": true, "channel": <id>, "ts":
...}` with a channel *id* (`#name` becomes `C…`), which `chat.update` then needs along with
the `ts`; an unknown message is `message_not_found`. Every call is recorded; `fail_next`
makes the next calls of a method fail (`ok: false`, an HTTP error, a 429 with Retry-After),
`delay` makes every answer slow.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlencode

from slack_sdk.signature import SignatureVerifier

from tests.local_server import LocalServer


@dataclass
class Call:
    method: str
    body: dict[str, Any]
    authorization: str


@dataclass
class Posted:
    """A message as the fake holds it: what was posted, then what each update made of it."""

    channel: str
    ts: str
    text: str
    blocks: list[dict[str, Any]]
    updates: int = 0


@dataclass
class Failure:
    status: int  # 200: `ok: false` with `error`; 429: rate limited; else an HTTP error
    error: str
    retry_after: int | None = None


@dataclass
class FakeSlack:
    token: str
    calls: list[Call] = field(default_factory=list)
    messages: dict[str, Posted] = field(default_factory=dict)
    failures: dict[str, list[Failure]] = field(default_factory=dict)
    unknown_channels: set[str] = field(default_factory=set)
    delay: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    _server: LocalServer | None = None
    _clock: int = 1_700_000_000_000_000

    # -- control ---------------------------------------------------------------------------

    def start(self) -> FakeSlack:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                fake._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = LocalServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def api_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/api/"

    def fail_next(
        self,
        method: str,
        count: int = 1,
        *,
        status: int = 200,
        error: str = "internal_error",
        retry_after: int | None = None,
    ) -> None:
        with self.lock:
            queue = self.failures.setdefault(method, [])
            queue.extend(Failure(status, error, retry_after) for _ in range(count))

    def calls_of(self, method: str) -> list[Call]:
        with self.lock:
            return [call for call in self.calls if call.method == method]

    def only_message(self) -> Posted:
        with self.lock:
            [posted] = self.messages.values()
            return posted

    # -- the API ---------------------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        method = handler.path.rsplit("/", 1)[-1]
        raw = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        body = _body(raw, handler.headers.get("Content-Type", ""))
        authorization = handler.headers.get("Authorization", "")
        if self.delay:
            time.sleep(self.delay)
        with self.lock:
            self.calls.append(Call(method, body, authorization))
            status, answer, headers = self._answer(method, body, authorization)
        payload = json.dumps(answer).encode() if isinstance(answer, dict) else answer.encode()
        handler.send_response(status)
        kind = "application/json" if isinstance(answer, dict) else "text/plain"
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(payload)))
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(payload)

    def _answer(
        self, method: str, body: dict[str, Any], authorization: str
    ) -> tuple[int, dict[str, Any] | str, dict[str, str]]:
        if not authorization.startswith("Bearer "):
            return 200, {"ok": False, "error": "not_authed"}, {}
        if authorization != f"Bearer {self.token}":
            return 200, {"ok": False, "error": "invalid_auth"}, {}
        queued = self.failures.get(method) or []
        if queued:
            return _failure(queued.pop(0))
        handler = {
            "chat.postMessage": self._post,
            "chat.update": self._update,
            "chat.postEphemeral": self._ephemeral,
        }.get(method)
        if handler is None:
            return 200, {"ok": False, "error": "unknown_method"}, {}
        return 200, handler(body), {}

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        channel = _channel_id(str(body.get("channel") or ""))
        if not channel or body.get("channel") in self.unknown_channels:
            return {"ok": False, "error": "channel_not_found"}
        ts = self._next_ts()
        blocks = _blocks(body)
        self.messages[ts] = Posted(channel, ts, str(body.get("text", "")), blocks)
        return {"ok": True, "channel": channel, "ts": ts, "message": {"text": body.get("text")}}

    def _update(self, body: dict[str, Any]) -> dict[str, Any]:
        posted = self.messages.get(str(body.get("ts")))
        if posted is None or posted.channel != body.get("channel"):
            return {"ok": False, "error": "message_not_found"}
        posted.text = str(body.get("text", posted.text))
        posted.blocks = _blocks(body)
        posted.updates += 1
        return {"ok": True, "channel": posted.channel, "ts": posted.ts, "text": posted.text}

    def _ephemeral(self, body: dict[str, Any]) -> dict[str, Any]:
        if not body.get("channel") or not body.get("user"):
            return {"ok": False, "error": "invalid_arguments"}
        return {"ok": True, "message_ts": self._next_ts()}

    def _next_ts(self) -> str:
        self._clock += 100
        seconds, micros = divmod(self._clock, 1_000_000)
        return f"{seconds}.{micros:06d}"


def _failure(failure: Failure) -> tuple[int, dict[str, Any] | str, dict[str, str]]:
    if failure.status == 429:
        headers = {"Retry-After": str(failure.retry_after or 1)}
        return 429, {"ok": False, "error": "ratelimited"}, headers
    if failure.status == 200:
        return 200, {"ok": False, "error": failure.error}, {}
    return failure.status, f"{failure.status} {failure.error}", {}


def _body(raw: bytes, content_type: str) -> dict[str, Any]:
    if content_type.startswith("application/json"):
        value = json.loads(raw or b"{}")
        return value if isinstance(value, dict) else {}
    return {key: values[0] for key, values in parse_qs(raw.decode()).items()}


def _blocks(body: dict[str, Any]) -> list[dict[str, Any]]:
    blocks = body.get("blocks") or []
    return json.loads(blocks) if isinstance(blocks, str) else list(blocks)


def _channel_id(channel: str) -> str:
    """Slack answers with the channel's id, whatever name the post used."""
    if not channel.startswith("#"):
        return channel
    return "C" + hashlib.sha256(channel.encode()).hexdigest()[:10].upper()


def channel_id(name: str) -> str:
    """The id the fake gives the channel `name` (`#approvals`)."""
    return _channel_id(name)


# -- what Slack sends us ---------------------------------------------------------------------


def click(
    approval_id: str,
    *,
    approve: bool = True,
    user: str = "U0ALICE",
    channel: str = "C0APPROVALS",
    serial: int = 0,
) -> bytes:
    """The form body of a `block_actions` interaction: `user` clicked Approve (or Reject)
    on the approval's message; `serial` makes each click's payload (and signature) its own,
    as Slack's `trigger_id` and `action_ts` do."""
    action = "tracon_approve" if approve else "tracon_reject"
    payload = {
        "type": "block_actions",
        "user": {"id": user, "username": user.lower()},
        "team": {"id": "T0TEAM"},
        "channel": {"id": channel},
        "container": {"type": "message", "channel_id": channel, "message_ts": "1.000100"},
        "trigger_id": f"{serial}.{time.time_ns()}",
        "response_url": "https://hooks.slack.invalid/actions/1",
        "actions": [
            {
                "type": "button",
                "action_id": action,
                "block_id": "tracon_decision",
                "value": approval_id,
                "action_ts": f"{time.time():.6f}",
            }
        ],
    }
    return urlencode({"payload": json.dumps(payload)}).encode()


def signed(secret: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The headers Slack sends with `body`, signed by slack_sdk's own `SignatureVerifier`
    (an implementation independent of ours)."""
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    signature = SignatureVerifier(secret).generate_signature(timestamp=stamp, body=body)
    assert signature is not None
    return {
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": signature,
        "Content-Type": "application/x-www-form-urlencoded",
    }
