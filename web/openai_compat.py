"""OpenAI-compatible `/v1/chat/completions`, `/v1/responses` and `/v1/models`: `model`
names an agent.

Each request starts an ordinary run (recorded, listed under `/api/runs`, cancellable)
whose input is the conversation: `{"message": <last user text>, "messages": [...]}`, and
every answer to it names the run in `X-Tracon-Run-Id`. Without `stream` the answer is
buffered (the contract's status mapping, in OpenAI's error shape on failure); with
`stream: true` it follows the run's events (`web.sse.live_stream`): each model turn's text is
sent as it streams (the live text's deltas, `web.live_turn`), in OpenAI's chunk or
typed-event format, and what the live text missed follows from the turn's
`ModelCallCompleted`, never twice. Every error on `/v1` uses OpenAI's shape.

A model call that fails after some of its text went out (it is retried, or the run fails)
cannot take that text back from an OpenAI client: the stream ends there with an error in
OpenAI's shape (`code: "stream_text_withdrawn"`, naming the run; for `/v1/responses` a
`response.failed`), so a client never shows a withdrawn text as the answer. The run goes on;
its output stays readable at `GET /api/runs/{id}`.

A streaming client that goes away leaves its run running, unless `Runs.CancelOnDisconnect`
is on: then its run is canceled (as `POST /api/runs/{id}/cancel` does).

The agent is configured on the server, and a request says only what it can honour
(`web.openai_request`, field by field): its model options (`temperature`, `top_p`, the output
limit, `stop`, `seed`, ...) replace or add to the agent's for the run (kept in the run's input,
`runs.request_options`), its system and developer messages follow the agent's instructions,
and a field the run cannot honour, tools of its own among them, is a 400 naming the field,
never a run whose answer silently ignored it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from flask import Blueprint, Response, g, jsonify
from werkzeug.exceptions import HTTPException

from tracon_jobs.db.models import Run
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.request_options import OPTIONS_KEY
from tracon_jobs.runs.store import Event, NewRun
from web.auth import require_tenant, tenant_id
from web.buffered import ending, run_location, run_view, wait_for_end
from web.extensions import runtime
from web.idempotency import idempotent, remember_run
from web.live_turn import LiveDelta, LiveItem
from web.openai_request import AgentRequest, ChatRequest, ResponsesRequest, check_request
from web.openai_shapes import (
    METADATA_KEY,
    ResponseEvents,
    chat_chunk,
    chat_completion,
    chat_final_frames,
    data_frame,
    error_body,
    model_object,
    response_object,
    turn_separated,
    withdrawn_error,
)
from web.preferences import prefers_async
from web.problems import Problem, bad_request, kept_headers
from web.quota import refuse_when_spent
from web.runs import parse_body, priority_header, submit
from web.streams import live_stream, place_for_stream

bp = Blueprint("openai", __name__, url_prefix="/v1")
require_tenant(bp)
refuse_when_spent(bp, {"openai.chat_completions", "openai.responses"})

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = {"text", "input_text", "output_text"}
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
ERROR_CODES = {401: "invalid_api_key", 404: "not_found"}
RUN_ID_HEADER = "X-Tracon-Run-Id"
SHOULD_RETRY = "x-should-retry"
"""The header OpenAI's SDKs obey over their own retry rules (`false`: raise at once)."""
STARTED = int(time.time())  # `created` of every model: agents carry no creation time

Shape = Callable[[Run, str], dict[str, Any]]
Answer = tuple[Response, int, dict[str, str]]


# -- routes ---------------------------------------------------------------------------


@bp.get("/models")
def list_models() -> Response:
    """The agents, in OpenAI's model-list shape (`client.models.list()`)."""
    agents = runtime().settings.agents
    return jsonify({"object": "list", "data": [model_object(name, STARTED) for name in agents]})


@bp.get("/models/<path:model>")
def get_model(model: str) -> Response:
    """One agent as an OpenAI model (`client.models.retrieve(name)`)."""
    if model not in runtime().settings.agents:
        raise unknown_model(model)
    return jsonify(model_object(model, STARTED))


@bp.post("/chat/completions")
@idempotent()
def chat_completions() -> Response | Answer:
    body: ChatRequest = parse_body(ChatRequest)
    turns = [(message.role, message.content) for message in body.messages]
    with place_for_stream(body.stream) as place:
        run = start_run(body, conversation(turns, "messages"))
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        follow = ChatFrames(run, body.model, usage, cancels_on_disconnect())
        return live_stream(follow, 0, place, Location=run_location(run.id))
    return answer(run, body.model, chat_completion)


@bp.post("/responses")
@idempotent()
def responses() -> Response | Answer:
    body: ResponsesRequest = parse_body(ResponsesRequest)
    with place_for_stream(body.stream) as place:
        run = start_run(body, conversation(response_turns(body), "input"))
    if body.stream:
        follow = ResponseFrames(run, body.model, cancels_on_disconnect())
        return live_stream(follow, 0, place, Location=run_location(run.id))
    return answer(run, body.model, response_object)


def cancels_on_disconnect() -> bool:
    return runtime().settings.runs.cancel_on_disconnect


# -- input ----------------------------------------------------------------------------


def response_turns(body: ResponsesRequest) -> list[tuple[str, Any]]:
    turns: list[tuple[str, Any]] = [("system", body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return [*turns, ("user", body.input)]
    for index, item in enumerate(body.input):
        if item.get("type", "message") != "message" or "role" not in item:
            raise bad_request(f"input[{index}]: only message items are supported", field="input")
        turns.append((str(item["role"]), item.get("content")))
    return turns


def conversation(turns: list[tuple[str, Any]], field: str) -> dict[str, Any]:
    """The run input: every turn as a text message, and the last user text as `message`."""
    messages = [
        message_of(role, content, f"{field}[{i}]") for i, (role, content) in enumerate(turns)
    ]
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise bad_request(f"{field}: at least one user message is required", field=field)
    return {"message": users[-1], "messages": messages}


def message_of(role: str, content: Any, where: str) -> dict[str, str]:
    if role not in ROLES:
        raise bad_request(f"{where}.role: '{role}' is not supported here", field=f"{where}.role")
    return {"role": ROLES[role], "content": text_of(content, where)}


def text_of(content: Any, where: str) -> str:
    """A string, null, or a list of text parts (`{"type": "text", "text": str}`); else 400."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list) or not all(is_text_part(part) for part in content):
        raise bad_request(f"{where}.content: only text parts are supported", field=where)
    return "".join(part["text"] for part in content)


def is_text_part(part: Any) -> bool:
    kind = part.get("type") if isinstance(part, dict) else None
    return isinstance(kind, str) and kind in TEXT_PARTS and isinstance(part.get("text"), str)


def start_run(body: AgentRequest, run_input: dict[str, Any]) -> Run:
    """The run of a request the agent can honour (`web.openai_request`): its input keeps the
    request's model options and its `metadata`."""
    rt = runtime()
    agent = rt.settings.agents.get(body.model)
    if agent is None:
        raise unknown_model(body.model)
    options = check_request(body, agent, rt.settings.providers)
    kept = {OPTIONS_KEY: options, METADATA_KEY: body.metadata}
    new = NewRun(
        tenant_id(),
        body.model,
        {**run_input, **{key: value for key, value in kept.items() if value}},
        currency=rt.settings.pricing.currency,
        priority=priority_header(),
    )
    g.tracon_run_id = new.id  # from here on every answer names the run, a 503 included
    run = submit(new)
    remember_run(run.id)
    return run


def unknown_model(model: str) -> Problem:
    return Problem(
        404,
        "Not Found",
        f"The model '{model}' does not exist: a model names an agent",
        code="model_not_found",
        field="model",
    )


@bp.after_request
def _name_the_run(response: Response) -> Response:
    """`X-Tracon-Run-Id` on every answer of a request that made a run (errors included)."""
    run_id: str | None = g.get("tracon_run_id")
    if run_id is not None:
        response.headers[RUN_ID_HEADER] = run_id
    return response


# -- answers --------------------------------------------------------------------------


def answer(run: Run, model: str, shape: Shape) -> Answer:
    """202 at once under `Prefer: respond-async`; otherwise the buffered end of the run."""
    if prefers_async():
        headers = {"Location": run_location(run.id), "Preference-Applied": "respond-async"}
        return jsonify(shape(run, model)), 202, headers
    run = wait_for_end(run.id)
    if run.status == RunStatus.WAITING.value:
        raise waiting_for_approval(run)
    end = ending(run)
    if not end.ok:
        message = run.error_message or f"the run ended {run.status}"
        title = HTTPStatus(end.status).phrase
        headers = {**end.headers, **not_retried(end.status)}
        raise Problem(end.status, title, message, headers=headers, code=run.error_type)
    return jsonify(shape(run, model)), end.status, end.headers


def not_retried(status: int) -> dict[str, str]:
    """`x-should-retry: false` on a run's end that a retry would only repeat with a new run
    (OpenAI's SDKs retry 409, 429 and 5xx twice by default, and obey this header). A `503`
    (an open circuit refused the run before any provider call) is left to `Retry-After`."""
    return {} if status == 503 else {SHOULD_RETRY: "false"}


def waiting_for_approval(run: Run) -> Problem:
    """A run that waits for a person: a `409` that names it and its approvals, which an SDK
    raises (an OpenAI object only exists once the run ends, and nobody can tell when that is)
    and does not retry (a retry would start another run)."""
    location = run_location(run.id)
    pending = run_view(run)["pendingApprovals"]
    return Problem(
        409,
        "Conflict",
        f"run {run.id} waits for approval {', '.join(pending) or '(none pending)'}: decide it "
        f"with POST /api/approvals/{{id}}/decision, then read the run's output at {location}",
        headers={"Location": location, SHOULD_RETRY: "false"},
        code="run_waiting_for_approval",
    )


class ChatFrames:
    """A run as chat completion chunks: the role, then each model turn's text as it streams
    (a blank line between turns), then the end (`chat_final_frames`); a withdrawn text ends
    the stream with an error (see the module's docstring)."""

    shared = False
    live_shared = False
    needs_run = True

    def __init__(
        self, run: Run, model: str, include_usage: bool, cancel_on_disconnect: bool = False
    ) -> None:
        self.run_id = run.id
        self.run = run
        self.model = model
        self.include_usage = include_usage
        self.cancel_on_disconnect = cancel_on_disconnect
        self.turns = TurnJoin()
        self.done = False

    @property
    def streamed(self) -> bool:
        return self.turns.streamed

    def opening(self) -> str:
        return data_frame(chat_chunk(self.run, self.model, {"role": "assistant", "content": ""}))

    def frames(self, event: Event) -> str:
        return ""  # a turn's text comes as live items (its tail too, before ModelCallCompleted)

    def live(self, item: LiveItem) -> str:
        if self.done:
            return ""
        if isinstance(item, LiveDelta):
            delta = {"content": self.turns.piece(item)}
            return data_frame(chat_chunk(self.run, self.model, delta))
        self.done = True
        return data_frame(withdrawn_error(self.run_id, item.call_seq)) + data_frame("[DONE]")

    def closing(self, run: Run | None) -> str:
        assert run is not None
        final = chat_final_frames(run, self.model, self.include_usage, streamed=self.streamed)
        return "".join(final)

    def follow_on(self, run_id: str) -> None:
        self.run_id = run_id  # its answer ends the completion (the chunks keep their id)


class ResponseFrames:
    """A run as the Responses API's typed events (`ResponseEvents`)."""

    shared = False
    live_shared = False
    needs_run = True

    def __init__(self, run: Run, model: str, cancel_on_disconnect: bool = False) -> None:
        self.run_id = run.id
        self.events = ResponseEvents(run, model)
        self.cancel_on_disconnect = cancel_on_disconnect
        self.turns = TurnJoin()
        self.done = False

    def opening(self) -> str:
        return "".join(self.events.opening())

    def frames(self, event: Event) -> str:
        return ""

    def live(self, item: LiveItem) -> str:
        if self.done:
            return ""
        if isinstance(item, LiveDelta):
            return "".join(self.events.text_delta(self.turns.piece(item)))
        self.done = True
        return "".join(self.events.withdrawn(item.call_seq))

    def closing(self, run: Run | None) -> str:
        assert run is not None
        return "".join(self.events.closing(run))

    def follow_on(self, run_id: str) -> None:
        self.run_id = run_id  # its answer ends the response (whose id stays)


class TurnJoin:
    """The pieces of the turns' text as one answer: a blank line before the first piece of
    a turn that follows another's text."""

    def __init__(self) -> None:
        self.streamed = False
        self.call: int | None = None

    def piece(self, item: LiveDelta) -> str:
        first = item.call_seq != self.call
        self.call = item.call_seq
        text = turn_separated(item.text, self.streamed) if first else item.text
        self.streamed = True
        return text


# -- errors in OpenAI's shape ---------------------------------------------------------


def openai_error(
    status: int, message: str, code: str | None, param: str | None, type_: str | None = None
) -> Response:
    default = "invalid_request_error" if status < 500 else "server_error"
    body = error_body(message, type_ or ERROR_TYPES.get(status, default), code, param)
    response = jsonify(body)
    response.status_code = status
    return response


@bp.errorhandler(Problem)
def _problem(problem: Problem) -> Response:
    code = problem.extra.get("code") or ERROR_CODES.get(problem.status)
    response = openai_error(
        problem.status,
        problem.detail,
        code,
        problem.extra.get("field"),
        problem.extra.get("openai_type"),
    )
    response.headers.update(problem.headers)
    return response


@bp.errorhandler(HTTPException)
def _http_exception(exc: HTTPException) -> Response:
    status = exc.code or 500
    response = openai_error(status, exc.description or exc.name, ERROR_CODES.get(status), None)
    response.headers.update(kept_headers(exc))
    return response
