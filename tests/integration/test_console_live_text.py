"""The console's live text route, which the run page polls while a call streams: the
tenant's own runs only (404 otherwise), null while no call streams, the text so far while
one does, null again once the call ended (its text is in `ModelCallCompleted`)."""

from __future__ import annotations

from typing import Any

from flask.testing import FlaskClient

from tests.console_client import signed_in
from tests.helpers import MakeRuntime, claim_run, scripted_agent
from tracon_jobs.runs.store import NewRun


def text_of(client: FlaskClient, run_id: str) -> Any:
    answer = client.get(f"/console/live/runs/{run_id}/text")
    return answer.status_code, answer.get_json(silent=True)


def test_the_live_text_route_shows_a_streaming_call_to_its_tenant_only(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = make_runtime(sql_url, **scripted_agent([{"Text": "ok"}]))
    ours, theirs = signed_in(runtime, "acme"), signed_in(runtime, "other")
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.runs.create(NewRun(tenant, "demo", {})).id
    nothing = {"callSeq": None, "text": None}

    assert text_of(ours, run_id) == (200, nothing)
    claim = claim_run(runtime, run_id, "w1")
    assert claim is not None
    call = runtime.runs.append(claim, "ModelCallStarted", {"turn": 0})
    runtime.live_text.append(run_id, call.seq, "The answer so ")
    runtime.live_text.append(run_id, call.seq, "far")

    assert text_of(ours, run_id) == (200, {"callSeq": call.seq, "text": "The answer so far"})
    assert text_of(theirs, run_id)[0] == 404
    assert text_of(ours, "no-such-run")[0] == 404
    # a call that ended while its text is still in Redis (its worker died before forgetting)
    claim = runtime.runs.settle(claim)
    runtime.runs.append(claim, "ModelCallCompleted", {"turn": 0, "text": "The answer so far"})
    assert text_of(ours, run_id) == (200, nothing)
