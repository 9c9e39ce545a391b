"""Approvals posted to Slack with Approve / Reject buttons, and their outcomes written into the
same message: the `slack` target of the webhook deliverer (`deliver`), and what the web's
interaction route calls after a click (`show_outcome`, `tell`).

- `approval.requested`: the message goes to the agent's channel (`AgentChannels`), else the
  tenant's (`TenantChannels`, by tenant name), else `Channel`; `(approval, channel, ts)` is
  recorded in `slack_messages`. A retried delivery finds the row and posts nothing. A post
  and its row are two steps: a process that dies between them (or a row the database refused)
  makes the retry post again, so a crash can give two messages, never none. An approval that
  was decided before its request got posted is posted decided, without buttons.
- `approval.decided` / `approval.expired`: `chat.update` of the recorded message to its
  outcome (who, when; buttons removed), then `updated_status` recorded.

The outcome is written once, by whoever comes first: the web right after the click, or the
delivery. Each takes a short lease on the message (`LeaseStore`) and writes only while
`updated_status` does not show the outcome yet, reading it again under the lease. A delivery
that finds the lease held waits up to `wait` seconds (the web's quick update) and then finds
nothing left to do, or fails its attempt, to be tried again; the web does not wait: it
leaves the message to the holder. A failed update records nothing, so the delivery,
retried by the deliverer, writes it later. A request posted while its decision was being
made is settled by the same rule once it is recorded.

Every outcome is an `AttemptResult`: Slack's HTTP status when it took the call, 204 when
there was nothing to send (already posted, already shown), and for a refusal an error the
deliveries list shows: Slack's own `error` (`channel_not_found`), its HTTP status, or 429
with `Retry-After`. `ok: false` comes with HTTP 200, so it is stored with no status (a 2xx
would count as delivered). The bot token is never logged: slack_sdk redacts its header,
and any error text is scrubbed of it.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any, Final, cast

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from slack_sdk.web import SlackResponse
from sqlalchemy import Table, insert, select, update
from sqlalchemy.exc import IntegrityError

from tracon_jobs.coordination.leases import LeaseStore
from tracon_jobs.db import Database
from tracon_jobs.db.engine import StatementClock
from tracon_jobs.db.models import Approval, Run, SlackMessage, Tenant
from tracon_jobs.db.outages import rides_out_outages
from tracon_jobs.integrations.slack_blocks import Asked, message, outcome
from tracon_jobs.integrations.slack_requests import SlackRequests
from tracon_jobs.settings.sections import SlackSettings
from tracon_jobs.webhooks.sender import AttemptResult

log = logging.getLogger(__name__)

SLACK_MESSAGES = cast(Table, SlackMessage.__table__)
_NOW = StatementClock()

INTERACTION_TIMEOUT_SECONDS: Final = 2.0
"""How long the web's update after a click may take: Slack wants its answer within 3 s,
and a slower update is left to the delivery."""

OUTCOME_WAIT_SECONDS: Final = INTERACTION_TIMEOUT_SECONDS + 1.0
"""How long a delivery waits for the web's update of the same message to end."""

LEASE_MARGIN_MS: Final = 5_000
"""A message's lease outlives its holder's Slack call by this much (then a crashed holder's
lease lapses, and the next try writes the outcome)."""

WAIT_POLL_SECONDS: Final = 0.05
EXCERPT_CHARS: Final = 500
NOTHING_SENT: Final = 204

OUTCOME_EVENTS: Final = frozenset({"approval.decided", "approval.expired"})


class SlackApprovals:
    """One Slack app's approval messages: posted, recorded, brought to their outcome."""

    def __init__(
        self,
        settings: SlackSettings,
        token: str,
        db: Database,
        leases: LeaseStore,
        *,
        timeout: float,
        wait: float = OUTCOME_WAIT_SECONDS,
    ) -> None:
        self.settings = settings
        self.db = db
        self.leases = leases
        self.timeout = timeout
        self.wait = wait
        self._token = token
        self.client = WebClient(
            token=token,
            base_url=settings.api_url,
            timeout=max(1, math.ceil(timeout)),
            retry_handlers=[],  # one attempt is one call: the deliverer owns the retries
        )

    def __repr__(self) -> str:  # the token stays out of logs and tracebacks
        return f"SlackApprovals(api_url={self.settings.api_url!r})"

    @cached_property
    def answering(self) -> SlackApprovals:
        """The same app for the interaction route: a quick call, no waiting for a lease."""
        return SlackApprovals(
            self.settings,
            self._token,
            self.db,
            self.leases,
            timeout=INTERACTION_TIMEOUT_SECONDS,
            wait=0.0,
        )

    # -- the deliverer's sink --------------------------------------------------------------

    def deliver(self, message_id: str, type_: str, body: dict[str, Any]) -> AttemptResult:
        """One attempt of the `slack` delivery of an approval message (`webhooks.deliverer`)."""
        started = time.monotonic()
        data = body.get("data")
        approval_id = str(data.get("id") or "") if isinstance(data, dict) else ""
        if type_ == "approval.requested":
            return self.post(approval_id)
        if type_ in OUTCOME_EVENTS:
            return self.show_outcome(approval_id)
        return _nothing(started, f"{type_} is not posted to Slack")

    def post(self, approval_id: str) -> AttemptResult:
        """The approval's message, posted once; settled at once if decided meanwhile."""
        started = time.monotonic()
        asked = self._asked(approval_id)
        if asked is None:
            return _failed(started, f"no approval '{approval_id}'")
        if self._recorded(approval_id) is not None:
            posted = _nothing(started, "already posted; this attempt posted nothing")
        else:
            posted = self._post_new(asked, started)
            if not posted.succeeded or asked.final:
                return posted
        return self._settle(approval_id, self.wait) or posted

    def show_outcome(self, approval_id: str, wait: float | None = None) -> AttemptResult:
        """The recorded message brought to the approval's outcome, unless it shows it already
        (or no message was posted, or the approval is still pending)."""
        started = time.monotonic()
        settled = self._settle(approval_id, self.wait if wait is None else wait)
        return settled or _nothing(started, "the message needs no change")

    def tell(self, channel: str, user: str, text: str) -> AttemptResult:
        """A note only `user` sees in `channel` (a click on a decided approval)."""
        started = time.monotonic()
        result, _ = self._call(
            "chat.postEphemeral",
            lambda: self.client.chat_postEphemeral(channel=channel, user=user, text=text),
            started,
        )
        return result

    def channel_for(self, agent: str, tenant: str) -> str | None:
        """Where an approval of `agent`'s run for `tenant` (its name) is posted."""
        settings = self.settings
        return (
            settings.agent_channels.get(agent)
            or settings.tenant_channels.get(tenant)
            or settings.channel
        )

    def decider(self, user: str) -> str:
        """Who decided, as the approval records it, for a Slack user id."""
        return self.settings.users.get(user) or f"slack:{user}"

    # -- steps -----------------------------------------------------------------------------

    def _post_new(self, asked: Asked, started: float) -> AttemptResult:
        channel = self.channel_for(asked.agent, asked.tenant)
        if channel is None:
            return _failed(
                started,
                f"no Slack channel for agent '{asked.agent}' of tenant '{asked.tenant}': set "
                "Integrations.Slack.Channel, AgentChannels or TenantChannels",
            )
        text, blocks = message(asked)
        result, data = self._call(
            "chat.postMessage",
            lambda: self.client.chat_postMessage(channel=channel, text=text, blocks=blocks),
            started,
        )
        if result.succeeded:
            shown = asked.approval.status if asked.final else None
            self._record(asked.approval.id, str(data.get("channel")), str(data.get("ts")), shown)
        return result

    def _settle(self, approval_id: str, wait: float) -> AttemptResult | None:
        """The outcome written into the message by this process, or None when nothing is
        (left) to write; see the module's docstring for the lease."""
        started = time.monotonic()
        asked = self._asked(approval_id)
        if asked is None or not asked.final or self._shows(approval_id, asked) is not False:
            return None
        lease, owner = f"slack-message:{approval_id}", uuid.uuid4().hex
        if not self._take(lease, owner, wait):
            busy = "another process is writing the outcome into the message"
            if self._shows(approval_id, asked) is not False:
                return None
            if wait <= 0:  # not waiting: the holder writes it, or the delivery's retry does
                return _nothing(started, busy)
            return _failed(started, busy)
        try:
            return self._update(asked, started)
        finally:
            self.leases.release(lease, owner)

    def _take(self, lease: str, owner: str, wait: float) -> bool:
        ttl = int(self.timeout * 1000) + LEASE_MARGIN_MS
        deadline = time.monotonic() + wait
        while not self.leases.acquire(lease, owner, ttl):
            if time.monotonic() >= deadline:
                return False
            time.sleep(WAIT_POLL_SECONDS)
        return True

    def _update(self, asked: Asked, started: float) -> AttemptResult | None:
        recorded = self._recorded(asked.approval.id)  # again: the last holder may have written
        if recorded is None or recorded.updated_status == asked.approval.status:
            return None
        text, blocks = outcome(asked)
        result, _ = self._call(
            "chat.update",
            lambda: self.client.chat_update(
                channel=recorded.channel, ts=recorded.ts, text=text, blocks=blocks
            ),
            started,
        )
        if result.succeeded:
            self._mark(asked.approval.id, asked.approval.status)
        return result

    def _shows(self, approval_id: str, asked: Asked) -> bool | None:
        """Whether the recorded message shows the outcome; None when there is no message."""
        recorded = self._recorded(approval_id)
        return None if recorded is None else recorded.updated_status == asked.approval.status

    def _call(
        self, method: str, call: Callable[[], SlackResponse], started: float
    ) -> tuple[AttemptResult, dict[str, Any]]:
        try:
            response = call()
        except SlackApiError as exc:
            return self._refused(method, exc.response, started), {}
        except Exception as exc:  # the network: the attempt failed, the deliverer retries
            error = self._scrub(f"{method} did not reach Slack: {type(exc).__name__}: {exc}")
            log.warning("%s", error)
            return _failed(started, error), {}
        data = response.data if isinstance(response.data, dict) else {}
        shown = {"ok": True, "channel": data.get("channel"), "ts": data.get("ts")}
        return AttemptResult(response.status_code, _ms(started), None, _excerpt(shown)), data

    def _refused(self, method: str, response: SlackResponse, started: float) -> AttemptResult:
        status = response.status_code
        data = response.data if isinstance(response.data, dict) else {}
        excerpt = self._scrub(_excerpt(data or str(response.data)))
        if status == 429:
            after = _header(response.headers, "Retry-After") or "?"
            error = f"Slack rate-limits {method}: retry after {after} s"
            return AttemptResult(429, _ms(started), error, excerpt)
        if status == 200:
            error = f"Slack refused {method}: {data.get('error', 'ok is false')}"
            return AttemptResult(None, _ms(started), error, excerpt)
        return AttemptResult(status, _ms(started), f"Slack answered {method} {status}", excerpt)

    def _scrub(self, text: str) -> str:
        return text.replace(self._token, "[bot token]") if self._token else text

    # -- SQL -------------------------------------------------------------------------------

    @rides_out_outages
    def _asked(self, approval_id: str) -> Asked | None:
        query = (
            select(Approval, Run.agent, Tenant.name)
            .join(Run, Run.id == Approval.run_id)
            .join(Tenant, Tenant.id == Approval.tenant_id)
            .where(Approval.id == approval_id)
        )
        with self.db.read() as session:
            row = session.execute(query).one_or_none()
        return None if row is None else Asked(row[0], row[1], row[2])

    @rides_out_outages
    def _recorded(self, approval_id: str) -> SlackMessage | None:
        with self.db.read() as session:
            return session.get(SlackMessage, approval_id)

    @rides_out_outages
    def _record(self, approval_id: str, channel: str, ts: str, shown: str | None) -> None:
        statement = insert(SLACK_MESSAGES).values(
            approval_id=approval_id, channel=channel, ts=ts, posted_at=_NOW, updated_status=shown
        )
        try:
            with self.db.write() as session:
                session.execute(statement, self.db.clock_params())
        except IntegrityError:  # recorded by another attempt: its row names the message kept
            log.warning(
                "approval %s was posted to Slack twice; %s is not recorded", approval_id, ts
            )

    @rides_out_outages
    def _mark(self, approval_id: str, shown: str) -> None:
        statement = (
            update(SLACK_MESSAGES)
            .where(SLACK_MESSAGES.c.approval_id == approval_id)
            .values(updated_status=shown)
        )
        with self.db.write() as session:
            session.execute(statement)


def slack_approvals(
    settings: SlackSettings | None,
    environ: Mapping[str, str],
    db: Database,
    leases: LeaseStore,
    *,
    timeout: float,
) -> SlackApprovals | None:
    """The app of `Integrations.Slack`, None when it is not configured; the token is read
    from its variable now (startup has checked that it is set)."""
    if settings is None:
        return None
    token = environ.get(settings.bot_token_env, "")
    return SlackApprovals(settings, token, db, leases, timeout=timeout)


def slack_requests(
    settings: SlackSettings | None, environ: Mapping[str, str], leases: LeaseStore
) -> SlackRequests | None:
    """The signature checks of `Integrations.Slack`'s requests, None when not configured."""
    if settings is None:
        return None
    return SlackRequests(environ.get(settings.signing_secret_env, ""), leases)


def _nothing(started: float, why: str) -> AttemptResult:
    return AttemptResult(NOTHING_SENT, _ms(started), None, why)


def _failed(started: float, error: str) -> AttemptResult:
    return AttemptResult(None, _ms(started), error, "")


def _excerpt(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:EXCERPT_CHARS]


def _header(headers: Mapping[str, Any], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name.lower():
            return str(value[0] if isinstance(value, list) else value)
    return None


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
