"""The Slack messages of an approval, as Block Kit: the request with its Approve / Reject
buttons, and the same message once decided (who, when; the buttons gone).

Pure functions of the approval and its run's agent and tenant, so the post, the update after
a click and the update of a delivery all write the same message for the same state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from tracon_jobs.db.models import Approval

APPROVE: Final = "tracon_approve"
REJECT: Final = "tracon_reject"
ACTIONS: Final = {APPROVE: True, REJECT: False}
"""`action_id` of each button -> whether it approves; the button's `value` is the approval id."""

ARGUMENTS_SHOWN: Final = 1500
"""Characters of the call's arguments (JSON) shown; a section holds at most 3000."""

PENDING: Final = "Pending"
OUTCOMES: Final = {
    "Approved": ":white_check_mark: *Approved*",
    "Rejected": ":no_entry: *Rejected*",
    "Expired": ":hourglass: *Expired* (nobody decided in time)",
    "Canceled": ":heavy_multiplication_x: *Canceled* (its run was canceled)",
}

Blocks = list[dict[str, Any]]


@dataclass(frozen=True)
class Asked:
    """An approval with what its message names besides it: the run's agent and tenant."""

    approval: Approval
    agent: str
    tenant: str

    @property
    def final(self) -> bool:
        return self.approval.status != PENDING


def message(asked: Asked) -> tuple[str, Blocks]:
    """(notification text, blocks) of the approval in its present state."""
    return outcome(asked) if asked.final else request(asked)


def request(asked: Asked) -> tuple[str, Blocks]:
    approval = asked.approval
    buttons = {
        "type": "actions",
        "block_id": "tracon_decision",
        "elements": [
            _button("Approve", APPROVE, approval.id, "primary"),
            _button("Reject", REJECT, approval.id, "danger"),
        ],
    }
    text = f"Approval requested: {approval.tool} (run {approval.run_id})"
    return text, [*_about(asked), buttons, _footer(approval)]


def outcome(asked: Asked) -> tuple[str, Blocks]:
    approval = asked.approval
    said = OUTCOMES.get(approval.status, f"*{escape(approval.status)}*")
    if approval.decided_by:
        said += f" by {escape(approval.decided_by)}"
    if approval.decided_at is not None:
        said += f" {_date(approval.decided_at)}"
    if approval.comment:
        said += f"\n> {escape(approval.comment)}"
    text = f"{approval.tool}: {approval.status.lower()} (run {approval.run_id})"
    return text, [*_about(asked), _section(said), _footer(approval)]


def note(approval: Approval) -> str:
    """What a person who clicked a decided approval is told (only they see it)."""
    said = f"This approval is already {approval.status.lower()}"
    if approval.decided_by:
        said += f" by {escape(approval.decided_by)}"
    return said + "; your click changed nothing."


def _about(asked: Asked) -> Blocks:
    approval = asked.approval
    fields = [
        f"*Tool*\n`{escape(approval.tool)}`",
        f"*Agent*\n{escape(asked.agent)}",
        f"*Run*\n`{approval.run_id}`",
        f"*Tenant*\n{escape(asked.tenant)}",
        f"*Expires*\n{_date(approval.expires_at)}",
    ]
    return [
        {
            "type": "header",
            "text": {"type": "plain_text", "text": f"Approval: {approval.tool}"[:150]},
        },
        {"type": "section", "fields": [{"type": "mrkdwn", "text": f} for f in fields]},
        _section(f"*Arguments*\n```{escape(shown_arguments(approval.arguments))}```"),
    ]


def shown_arguments(arguments: dict[str, Any]) -> str:
    """The arguments as indented JSON, cut to `ARGUMENTS_SHOWN` characters."""
    text = json.dumps(arguments, indent=2, ensure_ascii=False, sort_keys=True, default=str)
    if len(text) <= ARGUMENTS_SHOWN:
        return text
    return text[: ARGUMENTS_SHOWN - 1] + "…"


def escape(text: str) -> str:
    """Slack's control characters as the entities it asks for: no mention or link can be
    smuggled in through a tool's arguments or a decider's name."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _button(label: str, action: str, value: str, style: str) -> dict[str, Any]:
    return {
        "type": "button",
        "text": {"type": "plain_text", "text": label},
        "action_id": action,
        "value": value,
        "style": style,
    }


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def _footer(approval: Approval) -> dict[str, Any]:
    return {
        "type": "context",
        "elements": [{"type": "mrkdwn", "text": f"approval `{approval.id}`"}],
    }


def _date(moment: datetime) -> str:
    """A time each reader sees in their own time zone, with a UTC fallback text."""
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    fallback = aware.strftime("%Y-%m-%d %H:%M UTC")
    return f"<!date^{int(aware.timestamp())}^{{date_short_pretty}} {{time}}|{fallback}>"
