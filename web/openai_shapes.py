"""A run rendered as OpenAI's objects: `chat.completion` and its chunks, `response` and its
typed `response.*` stream events, and an agent as a `model`. Pure functions of the run row
(and, for streams, of the text of its model turns); the `/v1` views in `web.openai_compat`
decide when to send what.

In a stream, each model turn's text goes out in pieces as it streams, a blank line apart from
the turn before (`TURN_SEPARATOR`); a run that streamed no text sends its output once at its
end. A piece of text already sent cannot be withdrawn from an OpenAI client, so a model call
that fails after streaming some ends the stream with an error (`withdrawn_error`).

The ids carry the run id (`chatcmpl-<run id>`, `resp_<run id>`), so any answer leads back to
`GET /api/runs/{id}`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC
from typing import Any

from tracon_jobs.db.models import Run
from tracon_jobs.runs.request_options import run_options

TURN_SEPARATOR = "\n\n"
METADATA_KEY = "metadata"
"""The run input's key of a `/v1` request's `metadata`, shown on its response object."""


def created(run: Run) -> int:
    return int(run.created_at.replace(tzinfo=UTC).timestamp())


def run_text(run: Run) -> str:
    return str((run.output or {}).get("text") or "")


def error_body(
    message: str, type_: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def run_error(run: Run) -> dict[str, Any]:
    message = run.error_message or f"the run ended {run.status}"
    return error_body(message, "server_error", run.error_type or run.status.lower())


WITHDRAWN_CODE = "stream_text_withdrawn"


def withdrawn_error(run_id: str, call_seq: int) -> dict[str, Any]:
    """A stream's end when the model call whose text it sent failed: the text is void."""
    message = (
        f"run {run_id}: the model call (event {call_seq}) whose text was streamed failed, so "
        f"that text is withdrawn; the run goes on, read its output at /api/runs/{run_id}"
    )
    return error_body(message, "server_error", WITHDRAWN_CODE)


def turn_separated(text: str, after_another: bool) -> str:
    """A turn's text as a delta: a blank line first when an earlier turn's text was sent."""
    return TURN_SEPARATOR + text if after_another else text


# -- models ---------------------------------------------------------------------------


def model_object(agent: str, created_at: int) -> dict[str, Any]:
    """An agent as OpenAI's `model`."""
    return {"id": agent, "object": "model", "created": created_at, "owned_by": "tracon"}


# -- chat completions -----------------------------------------------------------------


def chat_id(run: Run) -> str:
    return f"chatcmpl-{run.id}"


def chat_usage(run: Run) -> dict[str, int]:
    return {
        "prompt_tokens": run.input_tokens,
        "completion_tokens": run.output_tokens,
        "total_tokens": run.input_tokens + run.output_tokens,
    }


def chat_completion(run: Run, model: str) -> dict[str, Any]:
    """A finished run as `chat.completion`; `choices` is empty while the run is still going."""
    choices = []
    if run.status == "Completed":
        message = {"role": "assistant", "content": run_text(run), "refusal": None}
        choices = [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}]
    body = {
        "id": chat_id(run),
        "object": "chat.completion",
        "created": created(run),
        "model": model,
        "choices": choices,
        "usage": chat_usage(run),
        "system_fingerprint": None,
    }
    if not choices:
        body["status"] = "in_progress"  # a 202: the run outlived Runs.BufferedWaitTimeout
    return body


def chat_chunk(
    run: Run, model: str, delta: dict[str, Any], finish: str | None = None
) -> dict[str, Any]:
    return {
        "id": chat_id(run),
        "object": "chat.completion.chunk",
        "created": created(run),
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }


def chat_usage_chunk(run: Run, model: str) -> dict[str, Any]:
    """The extra last chunk `stream_options.include_usage` asks for: no choices, the usage."""
    chunk = chat_chunk(run, model, {})
    chunk.update(choices=[], usage=chat_usage(run))
    return chunk


def data_frame(payload: dict[str, Any] | str) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n"


def chat_final_frames(
    run: Run, model: str, include_usage: bool, *, streamed: bool = False
) -> Iterator[str]:
    """Everything after the role chunk and the turns' text deltas, once the run ended: the
    run's output as one delta when no turn streamed any (`streamed`), then the end."""
    if run.status == "Completed":
        if not streamed:
            yield data_frame(chat_chunk(run, model, {"content": run_text(run)}))
        yield data_frame(chat_chunk(run, model, {}, finish="stop"))
        if include_usage:
            yield data_frame(chat_usage_chunk(run, model))
    else:
        yield data_frame(run_error(run))
    yield data_frame("[DONE]")


# -- responses ------------------------------------------------------------------------


def response_id(run: Run) -> str:
    return f"resp_{run.id}"


def message_id(run: Run) -> str:
    return f"msg_{run.id}"


RESPONSE_STATUS = {"Completed": "completed", "Failed": "failed", "Canceled": "cancelled"}


def response_status(run: Run) -> str:
    return RESPONSE_STATUS.get(run.status, "in_progress")


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_message(run: Run, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "message",
        "id": message_id(run),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def response_usage(run: Run) -> dict[str, Any]:
    return {
        "input_tokens": run.input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": run.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": run.input_tokens + run.output_tokens,
    }


def response_object(
    run: Run, model: str, status: str | None = None, text: str | None = None
) -> dict[str, Any]:
    """The run as a `response`; pass `status` to show an earlier moment of a stream, and
    `text` for the message a stream sent (else the run's output)."""
    status = status or response_status(run)
    output = []
    if status == "completed":
        said = run_text(run) if text is None else text
        output = [output_message(run, "completed", [output_text_part(said)])]
    error = None
    if status in ("failed", "cancelled"):
        error = {"code": run.error_type or "server_error", "message": run.error_message or ""}
    options = run_options(run.input)  # what the request asked for (null: the agent's own)
    return {
        "id": response_id(run),
        "object": "response",
        "created_at": created(run),
        "status": status,
        "model": model,
        "output": output,
        "error": error,
        "incomplete_details": None,
        "instructions": None,
        "metadata": (run.input or {}).get(METADATA_KEY) or {},
        "parallel_tool_calls": True,
        "temperature": options.get("temperature"),
        "top_p": options.get("topP"),
        "max_output_tokens": options.get("maxOutputTokens"),
        "tool_choice": "auto",
        "tools": [],
        "usage": response_usage(run) if status != "in_progress" else None,
    }


class ResponseEvents:
    """Typed `response.*` stream events, each numbered by `sequence_number`.

    One output message carries the text: opened at the first turn's text (or at the end,
    for a run that streamed none), a `response.output_text.delta` per turn, closed at the end.
    """

    def __init__(self, run: Run, model: str) -> None:
        self.run = run
        self.model = model
        self.sequence = 0
        self.text: str | None = None  # what the message said so far; None until it opens

    def frame(self, type_: str, **data: Any) -> str:
        payload = {"type": type_, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {type_}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def opening(self) -> Iterator[str]:
        response = response_object(self.run, self.model, "in_progress")
        yield self.frame("response.created", response=response)
        yield self.frame("response.in_progress", response=response)

    def where(self) -> dict[str, Any]:
        return {"item_id": message_id(self.run), "output_index": 0, "content_index": 0}

    def turn_text(self, text: str) -> Iterator[str]:
        """A whole model turn's text as a delta of the message (opening it at the first)."""
        yield from self.text_delta(turn_separated(text, bool(self.text)))

    def text_delta(self, delta: str) -> Iterator[str]:
        """A piece of the message's text, as it streams (opening the message at the first)."""
        if self.text is None:
            self.text = ""
            empty = output_message(self.run, "in_progress", [])
            yield self.frame("response.output_item.added", output_index=0, item=empty)
            part = output_text_part("")
            yield self.frame("response.content_part.added", **self.where(), part=part)
        self.text += delta
        yield self.frame("response.output_text.delta", **self.where(), delta=delta, logprobs=[])

    def withdrawn(self, call_seq: int) -> Iterator[str]:
        """The stream's end when text it sent was withdrawn (see `withdrawn_error`)."""
        if self.text is not None:
            yield from self.message_done("incomplete")
        response = response_object(self.run, self.model, "failed")
        error = withdrawn_error(self.run.id, call_seq)["error"]
        response["error"] = {"code": error["code"], "message": error["message"]}
        yield self.frame("response.failed", response=response)

    def closing(self, run: Run) -> Iterator[str]:
        """After the run ended: the message's text (the run's output when no turn streamed
        any), the message closed, then the final event."""
        self.run = run
        if response_status(run) != "completed":
            if self.text is not None:
                yield from self.message_done("incomplete")
            yield self.frame("response.failed", response=response_object(run, self.model))
            return
        if self.text is None:
            yield from self.turn_text(run_text(run))
        yield from self.message_done("completed")
        response = response_object(run, self.model, text=self.text)
        yield self.frame("response.completed", response=response)

    def message_done(self, status: str) -> Iterator[str]:
        text = self.text or ""
        where = self.where()
        yield self.frame("response.output_text.done", **where, text=text, logprobs=[])
        yield self.frame("response.content_part.done", **where, part=output_text_part(text))
        done = output_message(self.run, status, [output_text_part(text)])
        yield self.frame("response.output_item.done", output_index=0, item=done)
