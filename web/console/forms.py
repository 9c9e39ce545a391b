"""What the console's forms and query strings may say, read leniently: a page with a bad
filter shows everything and says so, it never fails."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flask import request

from tracon_jobs.runs.approvals import ApprovalStatus
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import RunFilter
from tracon_jobs.runs.timeline import Bucket, GroupBy
from web.problems import Problem
from web.runs import decode_cursor

RUN_STATUSES = [status.value for status in RunStatus]
APPROVAL_STATUSES = [status.value for status in ApprovalStatus]
PAGE = 50
MAX_COMMENT = 2000
MAX_ANSWER = 65_536
"""Characters of a workflow answer typed in the console."""


@dataclass(frozen=True)
class RunsQuery:
    filters: RunFilter
    cursor: tuple[datetime, str] | None
    first_page: bool


def runs_query() -> RunsQuery:
    status = request.args.get("status") or None
    return RunsQuery(
        RunFilter(
            status if status in RUN_STATUSES else None,
            request.args.get("agent") or None,
            (request.args.get("session") or "").strip() or None,
        ),
        _cursor(),
        not request.args.get("cursor"),
    )


def approvals_status() -> str | None:
    """The inbox's status tab: Pending unless another (or `all`) is asked for."""
    status = request.args.get("status", ApprovalStatus.PENDING.value)
    return status if status in APPROVAL_STATUSES else None


def approvals_cursor() -> tuple[datetime, str] | None:
    return _cursor()


def schedules_cursor() -> tuple[datetime, str] | None:
    """Where the schedules list goes on from (**More schedules →**); none, a bad one: the top."""
    return _cursor()


def _cursor() -> tuple[datetime, str] | None:
    try:
        return decode_cursor(request.args.get("cursor"))
    except Problem:
        return None


@dataclass(frozen=True)
class Decision:
    approve: bool
    comment: str | None


def decision_form() -> Decision | None:
    choice = request.form.get("decision")
    if choice not in {"approve", "reject"}:
        return None
    comment = (request.form.get("comment") or "").strip()[:MAX_COMMENT] or None
    return Decision(choice == "approve", comment)


@dataclass(frozen=True)
class Answer:
    """A workflow answer as typed (`text`): its JSON `value`, or why it is not one."""

    text: str
    value: Any = None
    error: str | None = None


def answer_form() -> Answer:
    """The answer to a workflow's `ask`: any JSON, as `POST .../respond` takes it."""
    return json_form("answer", 'Write an answer: any JSON, such as {"text": "send it"}.')


def payload_form() -> Answer:
    """An event's payload: any JSON, as `POST .../events/{name}` takes it (none is null)."""
    return json_form("payload", None)


def json_form(field: str, when_empty: str | None) -> Answer:
    """The JSON typed in `field`, at most `MAX_ANSWER` characters; empty is the error
    `when_empty`, or null when that is None."""
    text = (request.form.get(field) or "").strip()
    if not text:
        return Answer(text) if when_empty is None else Answer(text, error=when_empty)
    if len(text) > MAX_ANSWER:
        return Answer(text, error=f"The {field} is longer than {MAX_ANSWER:,} characters.")
    try:
        return Answer(text, json.loads(text))
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        return Answer(
            text, error=f"The {field} is not JSON ({exc.msg} at {where}); text goes in quotes."
        )


@dataclass(frozen=True)
class Window:
    """A statistics window: how many buckets of which width, up to now."""

    key: str
    label: str
    bucket: Bucket
    buckets: int


WINDOWS = {
    "24h": Window("24h", "Last 24 hours", Bucket.HOUR, 24),
    "7d": Window("7d", "Last 7 days", Bucket.DAY, 7),
    "30d": Window("30d", "Last 30 days", Bucket.DAY, 30),
}
GROUPINGS = [GroupBy.AGENT, GroupBy.MODEL]


def statistics_window() -> Window:
    return WINDOWS.get(request.args.get("window", ""), WINDOWS["24h"])
