"""Console-internal JSON the page script polls while something is still going: the rendered
rows of the runs list, and the rendered body of a run page with its status.

Authenticated by the console session (an EventSource or a fetch from the page cannot send
the API's Authorization header), so these routes live here and not under `/api`.
"""

from __future__ import annotations

from flask import Response, jsonify, render_template
from werkzeug.exceptions import NotFound

from tracon_jobs.runs.lifecycle import RunStatus
from web.console.blueprint import bp
from web.console.session import current_tenant
from web.console.views import owned_run, run_context, runs_context
from web.extensions import runtime
from web.live_turn import KEEPS_OPEN


@bp.get("/console/live/runs")
def live_runs() -> Response:
    context = runs_context()
    html = render_template("console/_runs_rows.html", **context)
    return jsonify({"html": html, "count": len(context["runs"])})


@bp.get("/console/live/runs/<run_id>")
def live_run(run_id: str) -> Response:
    run = owned_run(run_id)
    context = run_context(run)
    html = render_template("console/_run_live.html", **context)
    terminal = RunStatus(run.status).is_terminal
    asks = context["question"] is not None  # the page shows the question once it reloads
    return jsonify({"status": run.status, "terminal": terminal, "asks": asks, "html": html})


@bp.get("/console/live/runs/<run_id>/text")
def live_text(run_id: str) -> Response:
    """The text of the run's model call while it streams (`text` null when no call streams):
    the page polls it a few times a second, so a turn's answer grows as it arrives."""
    rt = runtime()
    if not rt.runs.exists(run_id, current_tenant()):  # the tenant's only: an index lookup
        raise NotFound(f"There is no run {run_id} in this tenant.")
    found = rt.live_text.snapshot(run_id)  # none while no call streams: no more reads
    if found is not None:
        later = rt.runs.events(run_id, found.call_seq, limit=50)
        if any(event.type not in KEEPS_OPEN for event in later):
            found = None  # the call ended (its text is in its ModelCallCompleted), or failed
    if found is None:
        return jsonify({"callSeq": None, "text": None})
    return jsonify({"callSeq": found.call_seq, "text": found.text.decode(errors="replace")})
