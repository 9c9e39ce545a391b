"""Runs of another kind than an agent's (today `workflow`): the executor claims them as it
claims any run, then hands each to the runner of its kind, which `runs/` knows only by this
Protocol (the composition root passes `workflows.runner.WorkflowRunner`), so nothing in
`runs/` imports what is built on it."""

from __future__ import annotations

from typing import Protocol

from tracon_jobs.abort import AbortSignal
from tracon_jobs.db.models import Run
from tracon_jobs.limits.tenant_quotas import OwnQuota
from tracon_jobs.runs.lifecycle import Claim, RunStatus


class KindRunner(Protocol):
    """A runner of another kind of run."""

    def knows(self, name: str) -> bool:
        """Whether `name` (the run's `agent`) is configured in this process; a run it does
        not know is left for another worker."""
        ...

    def run(
        self, claim: Claim, run: Run, signal: AbortSignal, own_quota: OwnQuota | None = None
    ) -> RunStatus:
        """Drive the claimed run, its claim made, to its end (its own final write);
        `own_quota`: the tenant's quota row as the claim read it."""
        ...
