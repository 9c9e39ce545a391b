"""What one execution of a claimed run carries from step to step, and how it ends early.

`Execution` is the executor's working state; `RunFailure` ends the run `Failed` with a
typed error; `LinkFailed` ends one fallback link's loop. The mapping from provider errors
to run errors lives here too, so the executor and the tool calls read the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracon_jobs.abort import AbortSignal
from tracon_jobs.agents.tools import ToolSpec
from tracon_jobs.coordination.live_text import TurnWriter
from tracon_jobs.db.models import Run
from tracon_jobs.errors import ProviderError, RunCanceled, RunTakenAway
from tracon_jobs.limits.tree import TreeBudget
from tracon_jobs.providers.base import Provider
from tracon_jobs.runs.continuation import ChainLedger
from tracon_jobs.runs.lifecycle import AnyClaim, ErrorClass, RunError
from tracon_jobs.runs.live import CANCELED, TAKEN_AWAY
from tracon_jobs.settings import AgentSettings

if TYPE_CHECKING:
    from tracon_jobs.runs.store import TurnSpend


class RunFailure(Exception):
    """Ends the run `Failed` with a typed error (and a `RunContinuationBlocked` event with
    `blocked` as its data, when a continuation stops)."""

    def __init__(self, error: RunError, blocked: dict[str, Any] | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.blocked = blocked


@dataclass(frozen=True)
class Link:
    """One link of an agent's fallback chain: a provider and the model asked of it."""

    position: int
    provider_name: str
    model: str
    provider: Provider

    def label(self) -> dict[str, str]:
        return {"provider": self.provider_name, "model": self.model}


class RunWaits(Exception):
    """The run was saved `Waiting` for a person; the executor lets go of it."""

    def __init__(self, approval_ids: list[str]) -> None:
        super().__init__(", ".join(approval_ids))
        self.approval_ids = approval_ids


class RunParks(Exception):
    """The run was saved `Queued` to go on later (`RunParked`); the executor lets go of it."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"parked for {seconds:.1f}s")
        self.seconds = seconds


class LinkFailed(Exception):
    """A provider failure ended one link's loop."""

    def __init__(self, error: ProviderError, transient: bool, *, refused: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.transient = transient
        self.refused = refused  # by the link's open circuit: the provider was never called


class LinkRejected(Exception):
    """The circuit refused a link's loop (its admission read with the link's first gate)."""

    def __init__(self, error: ProviderError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Execution:
    """What one execution of a claimed run carries from step to step."""

    claim: AnyClaim  # read, then made by the run store's first write; `runs.settle` for the rest
    run: Run
    agent: AgentSettings
    tools: dict[str, ToolSpec]
    signal: AbortSignal
    first_call: int  # ledger numbering continues after earlier executions of this row
    next_call: int = 0
    attempts: list[dict[str, Any]] = field(default_factory=list)
    chain: ChainLedger = field(default_factory=ChainLedger)  # what a continued run recorded
    budget: TreeBudget | None = None
    link_first_call: int = 0  # the first ledger turn of the current fallback link
    answered: dict[int, set[str]] = field(default_factory=dict)  # link: recorded answers used
    pending_spend: tuple[TurnSpend, dict[str, Any]] | None = None  # the answer's, not yet written
    streamed: TurnWriter | None = None  # the answer's live text, forgotten once it is written

    def ensure_live(self) -> None:
        """Stop before the next model or tool call once the run is canceled or taken away."""
        if self.signal.aborted:
            raise stopped(self.signal)

    def tree_budget(self) -> TreeBudget:
        assert self.budget is not None, "the budget opens before the first call"
        return self.budget


def stopped(signal: AbortSignal) -> RunCanceled | RunTakenAway:
    """Why an aborted run stops: a cancel request, or another owner took the run."""
    if signal.reason == TAKEN_AWAY:
        return RunTakenAway("the run was taken away from this process")
    return RunCanceled("the run was canceled" if signal.reason == CANCELED else signal.reason)


_ERROR_TYPES = {
    "configuration": ("configuration_error", ErrorClass.CONFIGURATION),
    "unavailable": ("provider_unavailable", ErrorClass.PROVIDER),
    "content_blocked": ("content_blocked", ErrorClass.PROVIDER),
}


def provider_error(exc: ProviderError, message: str | None = None) -> RunError:
    type_, error_class = _ERROR_TYPES.get(exc.kind, ("provider_error", ErrorClass.PROVIDER))
    return RunError(type_, error_class, message or str(exc), retry_after=exc.retry_after)


def chain_error(failures: list[tuple[Link, ProviderError]]) -> RunError:
    """The first failure, its message naming every provider the chain tried."""
    first = failures[0][1]
    if len(failures) == 1:
        return provider_error(first)
    tried = ", ".join(f"{link.provider_name} ({link.model})" for link, _error in failures)
    return provider_error(first, f"{first} (providers tried: {tried})")


def config_failure(message: str) -> RunFailure:
    return RunFailure(RunError("configuration_error", ErrorClass.CONFIGURATION, message))
