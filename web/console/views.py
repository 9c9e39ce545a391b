"""The console's pages: sign-in, runs, one run, approvals, circuits and statistics.

Every read goes through the runtime's stores, scoped to the signed-in tenant; a run or an
approval of another tenant is a 404, exactly as in the API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis
from flask import flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import BadRequest, NotFound

from tracon_jobs.db.models import Run, WorkflowNode
from tracon_jobs.resilience.views import circuits_view
from tracon_jobs.runs.approvals import ApprovalConflict, ApprovalNotFound
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.ledger import Ledger
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.timeline import RunTimeline
from tracon_jobs.runs.views import tool_call_json
from tracon_jobs.workflows.store import FanOut, RequestConflict
from web.console import forms
from web.console.blueprint import bp, safe_next
from web.console.plots import stacked_chart
from web.console.run_timeline import build_timeline
from web.console.session import (
    current_tenant,
    decided_by,
    sign_in,
    sign_out,
    signed_in_tenant,
)
from web.draining import is_draining
from web.extensions import runtime
from web.quota import max_concurrent_runs
from web.runs import keyset_page


@bp.route("/signin", methods=["GET", "POST"])
def signin() -> ResponseReturnValue:
    next_path = safe_next(request.values.get("next"))
    if request.method == "GET":
        if signed_in_tenant() is not None:
            return redirect(next_path)
        return render_template("console/signin.html", next=next_path, error=None)
    if sign_in((request.form.get("key") or "").strip()):
        return redirect(next_path)
    error = "That API key is not valid. Check it and try again."
    return render_template("console/signin.html", next=next_path, error=error), 401


@bp.post("/signout")
def signout() -> ResponseReturnValue:
    sign_out()
    return redirect(url_for("console.signin"))


@bp.get("/")
def runs() -> str:
    return render_template("console/runs.html", **runs_context())


def runs_context() -> dict[str, Any]:
    query = forms.runs_query()
    rows = runtime().runs.page(
        current_tenant(), query.filters, limit=forms.PAGE + 1, before=query.cursor
    )
    page, older = keyset_page(rows, forms.PAGE, lambda run: (run.created_at, run.id))
    return {
        "runs": page,
        "filters": query.filters,
        "first_page": query.first_page,
        "older": older,
        "statuses": forms.RUN_STATUSES,
        "agents": sorted(runtime().settings.agents),
        "live": {s.value for s in RunStatus if not s.is_terminal},
    }


@bp.get("/runs/<run_id>")
def run_page(run_id: str) -> str:
    return render_template("console/run.html", **run_context(owned_run(run_id)))


@bp.post("/runs/<run_id>/respond")
def respond(run_id: str) -> ResponseReturnValue:
    """Answer the question a workflow run waits on, as `POST /api/workflows/runs/{id}/respond`
    with `Prefer: respond-async` does; then show the run that goes on."""
    run = owned_run(run_id)
    answer = forms.answer_form()
    if answer.error is not None:  # the page again, with what was typed and why it is refused
        context = {**run_context(run), "answer": answer}
        return render_template("console/run.html", **context), 400
    if is_draining():
        flash("Not answered: this web node is draining before it stops; try again.", "error")
        return redirect(url_for("console.run_page", run_id=run.id))
    try:
        continuation = runtime().workflow_resumes.respond(run, answer.value, resumable=True)
    except RequestConflict as conflict:
        flash(f"Not answered: {conflict}.", "error")
        return redirect(url_for("console.run_page", run_id=run.id))
    flash(f"Answered. The workflow goes on in this run, after run {run.id[:8]}.", "ok")
    return redirect(url_for("console.run_page", run_id=continuation.id))


@bp.post("/runs/<run_id>/event")
def deliver_event(run_id: str) -> ResponseReturnValue:
    """Deliver an event to the chain of a workflow run, as `POST
    /api/workflows/runs/{id}/events/{name}` does; then show the run that goes on (delivered)
    or the run it is kept for (kept, for the chain's next wait for it)."""
    run = owned_run(run_id)
    if run.kind != "workflow":
        raise NotFound(f"There is no workflow run {run_id} in this tenant.")
    name = request.form.get("event") or ""
    if not 1 <= len(name) <= MAX_EVENT_NAME:
        raise BadRequest(f"An event's name is 1 to {MAX_EVENT_NAME} characters.")
    payload = forms.payload_form()
    if payload.error is not None:  # the page again, with what was typed and why it is refused
        context = {**run_context(run), "payload": payload}
        return render_template("console/run.html", **context), 400
    if is_draining():
        flash("Not delivered: this web node is draining before it stops; try again.", "error")
        return redirect(url_for("console.run_page", run_id=run.id))
    try:
        delivered = runtime().workflow_resumes.deliver(run, name, payload.value)
    except RequestConflict as conflict:
        flash(f"Not delivered: {conflict}.", "error")
        return redirect(url_for("console.run_page", run_id=run.id))
    if delivered.kept:
        flash(f"Event {name} kept: the workflow's next wait for it takes it.", "ok")
    else:
        flash(
            f"Event {name} delivered. The workflow goes on in this run, after run {run.id[:8]}.",
            "ok",
        )
    return redirect(url_for("console.run_page", run_id=delivered.run.id))


MAX_EVENT_NAME = 200
"""Characters of an event's name (as `ctx.wait_for` and the events route take it)."""


def owned_run(run_id: str) -> Run:
    run = runtime().runs.get(run_id, current_tenant())
    if run is None:
        raise NotFound(f"There is no run {run_id} in this tenant.")
    return run


def run_context(run: Run) -> dict[str, Any]:
    rt = runtime()
    live = not RunStatus(run.status).is_terminal
    calls = [tool_call_json(call) for call in Ledger(rt.runs).calls(run.id)]
    timeline = build_timeline(rt.runs.events(run.id), calls, live, run.cost_currency)
    approvals = rt.approval_store.page(
        current_tenant(), status=None, run_id=run.id, limit=50, before=None
    )
    return {
        "run": run,
        "live": live,
        "timeline": timeline,
        "now": rt.db.now(),
        "tree": nest(rt.runs.tree(run.root_run_id, current_tenant())),
        "approvals": approvals,
        "question": question_of(run),
        "fanout": fanout_of(run),
        "answer": forms.Answer(""),
        "max_answer": forms.MAX_ANSWER,
        "payload": forms.Answer(""),
    }


def question_of(run: Run) -> WorkflowNode | None:
    """What a waiting workflow run waits on, if anything: its node (`kind` `ask`: a question
    and its payload; `timer`: `due_at` its time; `event`: the event's name in `payload`,
    `due_at` the wait's timeout, or None). The page shows it (`#workflow-question`), and the
    live poll reloads the page when one appears."""
    if run.kind != "workflow" or run.status != RunStatus.WAITING.value:
        return None
    return runtime().workflow_store.request_of(run.id)


def fanout_of(run: Run) -> FanOut | None:
    """The fan-out a waiting workflow run waits on: its branches, with what each came to and
    its child run (`#workflow-fanout`)."""
    if run.kind != "workflow" or run.status != RunStatus.WAITING.value:
        return None
    return runtime().workflow_store.fanout_of(run.id)


@dataclass
class TreeNode:
    run: Run
    children: list[TreeNode] = field(default_factory=list)


def nest(runs: list[Run]) -> list[TreeNode]:
    """The tree's runs (depth first from the store) as nodes under their parents."""
    nodes = {run.id: TreeNode(run) for run in runs}
    roots: list[TreeNode] = []
    for node in nodes.values():
        parent = nodes.get(node.run.parent_run_id or "")
        (parent.children if parent else roots).append(node)
    return roots


@bp.post("/runs/<run_id>/cancel")
def cancel(run_id: str) -> ResponseReturnValue:
    rt = runtime()
    run = owned_run(run_id)
    if RunStatus(run.status).is_terminal:
        flash(f"The run had already ended ({run.status}); nothing to cancel.", "error")
    else:
        reached = cancel_tree(rt.runs, rt.cancel_bus, rt.approval_store, run, rt.dispatcher.done)
        flash(f"Cancel requested for {len(reached)} run(s) of this tree.", "ok")
    return redirect(url_for("console.run_page", run_id=run.id))


@bp.get("/approvals")
def approvals() -> str:
    status = forms.approvals_status()
    rows = runtime().approval_store.page(
        current_tenant(),
        status=status,
        run_id=None,
        limit=forms.PAGE + 1,
        before=forms.approvals_cursor(),
    )
    page, older = keyset_page(rows, forms.PAGE, lambda a: (a.requested_at, a.id))
    return render_template(
        "console/approvals.html",
        approvals=page,
        status=status,
        statuses=forms.APPROVAL_STATUSES,
        older=older,
    )


@bp.post("/approvals/<approval_id>/decision")
def decide(approval_id: str) -> ResponseReturnValue:
    decision = forms.decision_form()
    back = safe_next(request.form.get("back"))
    if decision is None:
        flash("Choose approve or reject.", "error")
        return redirect(back)
    try:
        runtime().approvals.decide(
            current_tenant(), approval_id, decision.approve, decision.comment, decided_by()
        )
    except ApprovalNotFound:
        raise NotFound(f"There is no approval {approval_id} in this tenant.") from None
    except ApprovalConflict as conflict:
        flash(f"Not decided: the approval is {conflict.approval.status} ({conflict}).", "error")
        return redirect(back)
    verb = "Approved" if decision.approve else "Rejected"
    flash(f"{verb}; the run goes on.", "ok")
    return redirect(back)


@bp.get("/circuits")
def circuits() -> tuple[str, int] | str:
    rt = runtime()
    try:
        items = circuits_view(rt.breaker, rt.slots, rt.settings.providers, rt.rate_limits)
    except redis.RedisError as exc:
        error = f"The circuit store (Redis) does not answer: {exc}"
        return render_template("console/circuits.html", items=[], error=error), 503
    return render_template(
        "console/circuits.html", items=items, enabled=rt.breaker.enabled, error=None
    )


@bp.get("/statistics")
def statistics() -> str:
    rt = runtime()
    window = forms.statistics_window()
    timeline = RunTimeline(rt.db)
    now = rt.db.now()
    groups = []
    for group_by in forms.GROUPINGS:
        series = timeline.series(
            current_tenant(),
            until=now,
            buckets=window.buckets,
            bucket=window.bucket,
            group_by=group_by,
        )
        currency = f" {rt.settings.pricing.currency}"
        charts = [stacked_chart(series, "runs"), stacked_chart(series, "tokens")]
        charts.append(stacked_chart(series, "cost", currency))
        groups.append((group_by.value, charts))
    return render_template(
        "console/statistics.html",
        window=window,
        windows=forms.WINDOWS.values(),
        groups=groups,
        totals=rt.runs.statistics(current_tenant()),
        currency=rt.settings.pricing.currency,
        dispatch=dispatch_context(),
    )


def dispatch_context() -> dict[str, Any]:
    """The signed-in tenant's runs waiting in its fair line and parked, its weight and
    concurrency limit; and the providers' rate-limit headroom (cluster-wide). A Redis that
    does not answer leaves the Redis parts None (shown as such), the rest stays."""
    rt = runtime()
    tenant = current_tenant()
    lined: int | None
    rates: list[dict[str, Any]] | None
    try:
        lined = rt.fair_store.lines().get(tenant, 0)
    except redis.RedisError:
        lined = None
    try:
        rates = [
            {"provider": name, **usage.as_json()}
            for name in sorted(rt.settings.providers)
            for usage in rt.rate_limits.usage(name)
        ]
    except redis.RedisError:
        rates = None
    return {
        "lined": lined,
        "parked": rt.runs.parked(tenant),
        "weight": rt.tenants.weight(tenant),
        "max_concurrent_runs": max_concurrent_runs(rt, tenant),
        "rates": rates,
    }
