"""Approvals decided where people are: Slack's button clicks and one-time links.

No API key on these routes: Slack's request signature is the credential of the first (see
`tracon_jobs.integrations.slack_requests`), the link's own signature of the others (see
`tracon_jobs.integrations.links`). Both decide through the approvals' once-only path
(`Approvals.decide`, as `POST /api/approvals/{id}/decision` does), so any number of clicks,
posts and API calls make one decision, and the run is resumed once.

Slack is answered 200 as soon as the decision is made, with an empty body: Slack ignores the
body of a `block_actions` acknowledgment, so the message is brought to its outcome with
`chat.update` right after the answer is sent (`call_on_close`), or a click on a decided
approval gets an ephemeral note. Where that call fails, the `approval.decided` delivery
writes the outcome later; the two never both write it (`integrations.slack`).

A link's `GET` only shows the approval and a form: link scanners and prefetchers open links
before people do. Its `POST` decides. The pages are plain HTML without scripts, readable in a
phone's mail client; every value shown is escaped by the template.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import parse_qs

from flask import Blueprint, Response, render_template, request

from tracon_jobs.db.models import Approval
from tracon_jobs.integrations.links import ApprovalLinks, LinkExpired, LinkRefused
from tracon_jobs.integrations.slack import SlackApprovals
from tracon_jobs.integrations.slack_blocks import ACTIONS, note, shown_arguments
from tracon_jobs.integrations.slack_requests import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    RequestRefused,
)
from tracon_jobs.runs.approvals import ApprovalConflict, ApprovalNotFound, ApprovalStatus
from tracon_jobs.runtime import Runtime
from web.extensions import runtime
from web.problems import Problem, bad_request, not_found

log = logging.getLogger(__name__)

bp = Blueprint("integrations", __name__, template_folder="console/templates")

APPROVAL_ID: Final = re.compile(r"[0-9A-Za-z-]{1,36}")
MAX_COMMENT: Final = 2000
LINK_DECIDER: Final = "link"
PAGE_HEADERS: Final = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",  # the token is in the URL: never send it on
    "X-Robots-Tag": "noindex, nofollow",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
}


# -- Slack -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Click:
    """A click on an approval's Approve or Reject button."""

    approval_id: str
    approve: bool
    user: str
    channel: str | None


@bp.post("/integrations/slack/interactions")
def slack_interactions() -> Response:
    rt = runtime()
    slack, checks = rt.slack, rt.slack_requests
    if slack is None or checks is None:
        raise not_found("Integrations.Slack is not configured")
    body = request.get_data()
    headers = {name: request.headers.get(name, "") for name in (TIMESTAMP_HEADER, SIGNATURE_HEADER)}
    try:
        checks.check(headers, body, time.time())
    except RequestRefused as refused:
        raise Problem(401, "Unauthorized", str(refused)) from None
    answer = Response(status=200)
    click = parse_click(body)
    if click is not None:
        answer.call_on_close(decide_click(rt, slack.answering, click))
    return answer


def parse_click(body: bytes) -> Click | None:
    """The click of a `block_actions` payload; None for any other interaction (answered 200
    and ignored); 400 naming `payload` for a form that is not Slack's."""
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=20)
        payload = json.loads(fields.get("payload", [""])[0])
    except (UnicodeDecodeError, ValueError):
        raise bad_request("payload: must be a form field holding JSON", field="payload") from None
    if not isinstance(payload, dict) or payload.get("type") != "block_actions":
        return None
    user = _text(payload.get("user"), "id")
    for action in payload.get("actions") or []:
        value = _text(action, "value")
        if _text(action, "action_id") in ACTIONS and APPROVAL_ID.fullmatch(value) and user:
            channel = _text(payload.get("channel"), "id") or _text(
                payload.get("container"), "channel_id"
            )
            return Click(value, ACTIONS[_text(action, "action_id")], user, channel or None)
    return None


def decide_click(rt: Runtime, slack: SlackApprovals, click: Click) -> Callable[[], None]:
    """Decide now; what to tell Slack once the answer is sent (the outcome, or a note)."""
    approval = rt.approval_store.get(click.approval_id)
    if approval is None:
        return lambda: None  # not ours (another installation's message): nothing to say
    try:
        rt.approvals.decide(
            approval.tenant_id, approval.id, click.approve, decided_by=slack.decider(click.user)
        )
    except ApprovalNotFound:
        return lambda: None
    except ApprovalConflict as conflict:
        decided = conflict.approval  # the name `conflict` ends with the except block
        return lambda: _tell_decided(slack, click, decided)
    return lambda: _follow_up(slack.show_outcome(approval.id), "outcome", approval.id)


def _tell_decided(slack: SlackApprovals, click: Click, approval: Approval) -> None:
    if click.channel is not None:
        _follow_up(slack.tell(click.channel, click.user, note(approval)), "note", approval.id)
    _follow_up(slack.show_outcome(approval.id), "outcome", approval.id)  # stale buttons too


def _follow_up(result: Any, what: str, approval_id: str) -> None:
    if not result.succeeded:
        log.warning("slack %s of approval %s not written: %s", what, approval_id, result.error)


def _text(value: Any, key: str) -> str:
    found = value.get(key) if isinstance(value, dict) else None
    return found if isinstance(found, str) else ""


# -- one-time links -----------------------------------------------------------------------


@bp.get("/approvals/links/<token>")
def link_page(token: str) -> tuple[str, int, dict[str, str]]:
    """What the link decides, and the form that decides it; never a decision."""
    rt = runtime()
    found = _linked(rt, token)
    if isinstance(found, tuple):
        return found
    if found.status != ApprovalStatus.PENDING.value:
        return _page(found, f"Already {found.status.lower()}", "Nothing is left to decide.")
    return _page(found, "Approve or reject", None, ask=True)


@bp.post("/approvals/links/<token>")
def link_decision(token: str) -> tuple[str, int, dict[str, str]]:
    rt = runtime()
    found = _linked(rt, token)
    if isinstance(found, tuple):
        return found
    decision = request.form.get("decision", "")
    comment = request.form.get("comment", "").strip() or None
    if decision not in ("approve", "reject") or len(comment or "") > MAX_COMMENT:
        rule = "decision: must be approve or reject"
        if decision in ("approve", "reject"):
            rule = f"comment: at most {MAX_COMMENT} characters"
        return _page(found, "Not decided", rule, ask=True, status=400)
    try:
        decided = rt.approvals.decide(
            found.tenant_id, found.id, decision == "approve", comment, LINK_DECIDER
        )
    except ApprovalNotFound:
        return _gone("Not found", "This link is not valid.", 404)
    except ApprovalConflict as conflict:
        now = conflict.approval
        return _page(now, f"Already {now.status.lower()}", "Your answer changed nothing.", 409)
    outcome = decided.approval.status
    return _page(decided.approval, outcome, f"{outcome}. The run goes on; thank you.")


def _linked(rt: Runtime, token: str) -> Approval | tuple[str, int, dict[str, str]]:
    """The approval a genuine, unexpired link names, or the page that says why not."""
    links: ApprovalLinks | None = rt.approval_links
    if links is None:
        return _gone("Not found", "One-time links are not configured here.", 404)
    try:
        approval_id = links.verify(token, datetime.now(UTC))
    except LinkRefused:
        return _gone("Not found", "This link is not valid.", 404)
    except LinkExpired as expired:
        approval = rt.approval_store.get(expired.approval_id)
        if approval is not None and approval.status != ApprovalStatus.PENDING.value:
            return _page(approval, f"Already {approval.status.lower()}", "The link has expired.")
        return _gone("Expired", "This link has expired, and the approval with it.", 410)
    approval = rt.approval_store.get(approval_id)
    if approval is None:
        return _gone("Not found", "This link is not valid.", 404)
    return approval


def _page(
    approval: Approval,
    title: str,
    message: str | None,
    status: int = 200,
    *,
    ask: bool = False,
) -> tuple[str, int, dict[str, str]]:
    expires = approval.expires_at.replace(tzinfo=UTC)
    html = render_template(
        "console/approval_link.html",
        title=title,
        message=message,
        approval=approval,
        arguments=shown_arguments(approval.arguments),
        expires_iso=expires.isoformat(timespec="seconds"),
        expires_text=expires.strftime("%Y-%m-%d %H:%M UTC"),
        ask=ask,
        max_comment=MAX_COMMENT,
    )
    return html, status, PAGE_HEADERS


def _gone(title: str, message: str, status: int) -> tuple[str, int, dict[str, str]]:
    html = render_template(
        "console/approval_link.html", title=title, message=message, approval=None, ask=False
    )
    return html, status, PAGE_HEADERS
