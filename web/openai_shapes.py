"""A run rendered as OpenAI's objects: `chat.completion` and its chunks, `response` and its
typed `response.*` stream events. Pure functions of the run row (and, for streams, of the
run's text); the `/v1` views in `web.openai_compat` decide when to send what.

The ids carry the run id (`chatcmpl-<run id>`, `resp_<run id>`), so any answer leads back to
`GET /api/runs/{id}`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC
from typing import Any

from tracon_jobs.db.models import Run


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


def chat_final_frames(run: Run, model: str, include_usage: bool) -> Iterator[str]:
    """Everything after the role chunk, once the run ended."""
    if run.status == "Completed":
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


def response_object(run: Run, model: str, status: str | None = None) -> dict[str, Any]:
    """The run as a `response`; pass `status` to show an earlier moment of a stream."""
    status = status or response_status(run)
    output = []
    if status == "completed":
        output = [output_message(run, "completed", [output_text_part(run_text(run))])]
    error = None
    if status in ("failed", "cancelled"):
        error = {"code": run.error_type or "server_error", "message": run.error_message or ""}
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
        "metadata": {},
        "parallel_tool_calls": True,
        "temperature": None,
        "top_p": None,
        "tool_choice": "auto",
        "tools": [],
        "usage": response_usage(run) if status != "in_progress" else None,
    }


class ResponseEvents:
    """Typed `response.*` stream events, each numbered by `sequence_number`."""

    def __init__(self, run: Run, model: str) -> None:
        self.run = run
        self.model = model
        self.sequence = 0

    def frame(self, type_: str, **data: Any) -> str:
        payload = {"type": type_, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {type_}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def opening(self) -> Iterator[str]:
        response = response_object(self.run, self.model, "in_progress")
        yield self.frame("response.created", response=response)
        yield self.frame("response.in_progress", response=response)

    def closing(self, run: Run) -> Iterator[str]:
        """After the run ended: the message's item, part and text, then the final event."""
        self.run = run
        if response_status(run) != "completed":
            yield self.frame("response.failed", response=response_object(run, self.model))
            return
        yield from self.message_events(run_text(run))
        yield self.frame("response.completed", response=response_object(run, self.model))

    def message_events(self, text: str) -> Iterator[str]:
        where = {"item_id": message_id(self.run), "output_index": 0, "content_index": 0}
        empty = output_message(self.run, "in_progress", [])
        yield self.frame("response.output_item.added", output_index=0, item=empty)
        yield self.frame("response.content_part.added", **where, part=output_text_part(""))
        yield self.frame("response.output_text.delta", **where, delta=text, logprobs=[])
        yield self.frame("response.output_text.done", **where, text=text, logprobs=[])
        yield self.frame("response.content_part.done", **where, part=output_text_part(text))
        done = output_message(self.run, "completed", [output_text_part(text)])
        yield self.frame("response.output_item.done", output_index=0, item=done)
