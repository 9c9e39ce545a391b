"""Which run events become which webhook messages, about what, and who wants them: pure
functions of the event and of configuration."""

from __future__ import annotations

from typing import Any

import pytest

from tracon_jobs.settings import Settings
from tracon_jobs.webhooks.events import EVENT_TYPES
from tracon_jobs.webhooks.outbox import KEPT, is_quota_failure, message_type, subject_of
from tracon_jobs.webhooks.subscriptions import SLACK_EVENTS, Wanted, configured


@pytest.mark.parametrize(
    ("event_type", "data", "expected"),
    [
        ("RunCompleted", {"status": "Completed"}, "run.completed"),
        ("RunFailed", {"status": "Failed"}, "run.failed"),
        ("RunCanceled", {"status": "Canceled"}, "run.canceled"),
        ("ApprovalRequested", {"approvalId": "a-1"}, "approval.requested"),
        ("ApprovalDecided", {"approvalId": "a-1", "outcome": "approved"}, "approval.decided"),
        ("ApprovalDecided", {"approvalId": "a-1", "outcome": "rejected"}, "approval.decided"),
        ("ApprovalDecided", {"approvalId": "a-1", "outcome": "expired"}, "approval.expired"),
        ("ApprovalDecided", {"approvalId": "a-1", "outcome": "canceled"}, None),
        ("RunWaiting", {"request": "approve-reply#1"}, "workflow.waiting"),
        ("RunWaiting", {"approvals": ["a-1"]}, None),
        ("RunQueued", {"agent": "demo"}, None),
        ("RunStarted", {"owner": "w"}, None),
        ("ModelCallCompleted", {}, None),
        ("WorkflowRequestCreated", {"node": "n", "payload": {}}, None),
    ],
)
def test_each_event_becomes_its_message_type_or_none(
    event_type: str, data: dict[str, Any], expected: str | None
) -> None:
    assert message_type(event_type, data) == expected


def test_every_type_written_is_a_known_event_type_with_what_it_keeps() -> None:
    assert set(KEPT) <= set(EVENT_TYPES)
    assert "output" not in KEPT["run.completed"] and "arguments" not in KEPT["approval.requested"]


def test_an_approval_message_is_about_the_approval_the_others_about_the_run() -> None:
    assert subject_of("approval.decided", "r-1", {"approvalId": "a-1"}) == "a-1"
    assert subject_of("run.completed", "r-1", {"approvalId": "a-1"}) == "r-1"
    assert subject_of("workflow.waiting", "r-1", {"request": "n"}) == "r-1"


def test_only_a_failure_for_the_tenants_quota_is_a_quota_failure() -> None:
    quota = {"status": "Failed", "error": {"type": "tenant_quota_exceeded"}}
    budget = {"status": "Failed", "error": {"type": "run_budget_exceeded"}}
    assert is_quota_failure("RunFailed", quota)
    assert not is_quota_failure("RunFailed", budget)
    assert not is_quota_failure("RunCanceled", quota)
    assert not is_quota_failure("RunFailed", {"status": "Failed"})


def test_wanted_by_a_tenants_endpoint_is_gated_wanted_of_everyone_is_not() -> None:
    wanted = Wanted({"run.completed": frozenset({"acme"})}, frozenset({"run.failed"}))

    assert wanted.wants("run.completed") and wanted.wants("run.failed")
    assert not wanted.wants("run.canceled")
    assert wanted.wants_of("acme", "run.completed")
    assert not wanted.wants_of("globex", "run.completed")
    assert wanted.wants_of("globex", "run.failed")
    assert wanted.gated("run.completed") and not wanted.gated("run.failed")


def test_configuration_wants_the_operators_events_and_slacks_approvals() -> None:
    assert configured(Settings.model_validate({})) == frozenset()
    operator = {"Url": "https://ops.example/hook", "SecretEnv": "OPS"}
    default = Settings.model_validate({"Webhooks": {"Operator": operator}})
    assert configured(default) == {"circuit.opened", "circuit.closed", "webhook.disabled"}
    listed = Settings.model_validate(
        {
            "Webhooks": {"Operator": {**operator, "Events": ["run.failed"]}},
            "Integrations": {"Slack": {"BotTokenEnv": "T", "SigningSecretEnv": "S"}},
        }
    )
    assert configured(listed) == {"run.failed", *SLACK_EVENTS}
