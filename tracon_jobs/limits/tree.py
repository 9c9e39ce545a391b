"""The budget of the tree a run belongs to, as the executor uses it.

Opening seeds the shared totals from SQL (the tree's runs, and the runs a continuation
continues, so a chain does not get its ceiling again). A store that cannot be reached
lets work through and says so in the log: a lost budget store must not stop every run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, cast

import redis
from sqlalchemy import CTE, Row, Select, Table, bindparam, func, literal, select

from tracon_jobs.db import Database
from tracon_jobs.db.models import Run
from tracon_jobs.db.outages import retry_outages
from tracon_jobs.limits.budget_store import (
    BUDGET_EXCEEDED,
    BudgetStore,
    Gate,
    Limits,
    OutputAsk,
    Refusal,
    Totals,
    Verdict,
    refusal_message,
)
from tracon_jobs.limits.tenant_quotas import OwnQuota, Quotas, TenantQuota
from tracon_jobs.pricing import MILLION, Price
from tracon_jobs.providers.base import Message

log = logging.getLogger(__name__)

DEFAULT_OUTPUT_RESERVE = 256
MAX_CHAIN = 128


@dataclass
class TreeBudget:
    store: BudgetStore
    limits: Limits
    root: str
    currency: str
    db: Database
    quota: TenantQuota | None = None  # the tenant's cost quota, checked at the same gates
    seed: Totals | None = None  # a fresh tree's: its first gate opens the budget with it

    def gate_model_call(
        self, messages: list[Message], max_output: int | None, price: Price | None
    ) -> ModelGate:
        """Refuse the call, or reserve its tokens and cap its output at the room the tree
        has left (the tokens under `MaxTotalTokens`; what the cost left under
        `MaxTotalCost` buys at the link's `price`)."""
        ask = OutputAsk(
            estimate_tokens(messages),
            max_output,
            None if price is None else price.input_per_million / MILLION,
            None if price is None else price.output_per_million / MILLION,
            DEFAULT_OUTPUT_RESERVE,
        )
        verdict = self._gate("model", ask=ask)
        if isinstance(verdict, Refusal):
            return ModelGate(verdict, 0, None)
        if verdict is None:  # no store to ask: let it through, uncapped
            return ModelGate(None, 0, None)
        return ModelGate(None, verdict.reserve, verdict.output_cap or None)

    def reservation(self, tokens: int) -> Reservation:
        """The tokens a gate reserved for one model call, as a context manager: every way
        out of the call that does not spend them hands them back."""
        return Reservation(self, tokens)

    def refuse_tool_call(self) -> Refusal | None:
        return _refusal(self._gate("tool"))

    def refuse_node(self) -> Refusal | None:
        """A workflow function node: `MaxTotalCost` and `MaxDuration` keep it from starting."""
        return _refusal(self._gate("node"))

    def refuse_child(self, depth: int) -> Refusal | None:
        if depth > self.limits.depth:
            return Refusal(
                BUDGET_EXCEEDED,
                f"a child run at depth {depth} exceeds Tracon:AgentGraph:MaxDepth "
                f"({self.limits.depth})",
            )
        return _refusal(self._gate("child"))

    def spent(self, *, released: int, tokens: int, cost: Decimal, unknown: bool) -> None:
        try:
            if self.seed is not None:  # a spend before any gate: open the budget first
                self.store.open(self.root, self.seed)
                self.seed = None
            self.store.spend(
                self.root, released=released, tokens=tokens, cost=cost, unknown_price=unknown
            )
        except redis.RedisError as exc:
            log.warning(
                "budget store unreachable; spend of tree %s not counted: %s", self.root, exc
            )
        if self.quota is not None and cost > 0:
            self.quota.spent(cost)  # counted at once: the quota's gate has nothing unseen

    def _gate(self, kind: Gate, ask: OutputAsk | None = None) -> Verdict | Refusal | None:
        """The tenant's quota first (a refusal leaves no reservation or child behind), then
        the tree's budget: its verdict when it let the work through, None when its store
        could not be asked."""
        if self.quota is not None:
            refusal = self.quota.refuse()
            if refusal is not None:
                return refusal
        try:
            verdict = self.store.gate(self.root, kind, self.limits, seed=self.seed, ask=ask)
            self.seed = None
            if verdict.lost:
                log.warning("budget of tree %s was lost; rebuilding it from SQL", self.root)
                self.store.open(self.root, seed_totals(self.db, self.root))
                verdict = self.store.gate(self.root, kind, self.limits, ask=ask)
        except redis.RedisError as exc:
            log.warning("budget store unreachable; %s of tree %s allowed: %s", kind, self.root, exc)
            return None
        if verdict.allowed:
            return verdict
        return Refusal(BUDGET_EXCEEDED, refusal_message(verdict, self.limits, self.currency))


def _refusal(verdict: Verdict | Refusal | None) -> Refusal | None:
    return verdict if isinstance(verdict, Refusal) else None


@dataclass(frozen=True)
class ModelGate:
    """A model call's way through its tree's budget: refused, or the tokens it reserved
    and the most output it may ask for (None: as configured)."""

    refusal: Refusal | None
    reserved: int
    output_cap: int | None


@dataclass
class Reservation:
    """Tokens a model call holds in its tree's budget. Leaving the `with` block hands them
    back unless the call's spend took them over (`spent_by`): a call refused by the circuit,
    taken away, canceled or failed leaves no reservation behind, whichever way it ends."""

    budget: TreeBudget
    tokens: int
    settled: bool = False

    def spent_by(self, *, tokens: int, cost: Decimal, unknown: bool) -> None:
        """The call's spend, releasing the reservation in the same store call."""
        self.settled = True
        self.budget.spent(released=self.tokens, tokens=tokens, cost=cost, unknown=unknown)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self.settled and self.tokens:
            self.settled = True
            self.budget.spent(released=self.tokens, tokens=0, cost=Decimal(0), unknown=False)


def estimate_tokens(messages: list[Message]) -> int:
    """About four characters a token: a reservation, corrected by what the call reports."""
    return len(json.dumps(messages, default=str)) // 4


def open_budget(
    store: BudgetStore,
    db: Database,
    limits: Limits,
    run: Run,
    currency: str,
    quotas: Quotas | None = None,
    own_quota: OwnQuota | None = None,
) -> TreeBudget:
    quota = None if quotas is None else quotas.for_run(run.tenant_id, own_quota)
    fresh_root = run.id == run.root_run_id and run.continued_from_run_id is None
    if fresh_root and run.fence == 1:  # nothing spent yet: the first gate opens it
        return TreeBudget(store, limits, run.root_run_id, currency, db, quota, seed=Totals())
    seed = retry_outages(db, lambda: seed_totals(db, run.root_run_id), "seeding a budget")
    try:
        store.open(run.root_run_id, seed)
    except redis.RedisError as exc:
        log.warning("budget store unreachable when opening tree %s: %s", run.root_run_id, exc)
    return TreeBudget(store, limits, run.root_run_id, currency, db, quota)


class ChainUnreadable(Exception):
    """The runs a run continues could not all be read: it must not start with a partial
    spend (the reliability guide: it ends `Failed` before its first call or node)."""


def seed_totals(db: Database, root: str) -> Totals:
    """What the tree, and the chain of runs its root continues, already spent: one statement
    (`_CHAIN_SPEND`), a row for each run of the chain with what its tree spent; a chain longer
    than `MAX_CHAIN` runs is refused (`ChainUnreadable`), as the walk it replaced refused it."""
    tokens, cost, children, unknown, executed = 0, Decimal(0), 0, False, 0
    with db.read() as session:
        rows = session.execute(_CHAIN_SPEND, {"root": root}).all()
    if len(rows) > MAX_CHAIN or (len(rows) == MAX_CHAIN and rows[-1].next is not None):
        raise ChainUnreadable(f"the chain of run {root} is longer than {MAX_CHAIN} runs")
    for row in rows:
        tokens += int(row.tokens or 0)
        cost += Decimal(str(row.cost or 0))
        children += max(int(row.runs or 0) - 1, 0)
        unknown = unknown or row.source == "Unknown"
        executed += _executed_ms(row) if row.n > 1 else 0
    return Totals(tokens, cost, children, unknown, executed)


RUNS: Final = cast(Table, Run.__table__)


def chain_cte(start: str, position: int, *columns: str) -> CTE:
    """The runs of a chain, from the run the parameter `start` names back through the runs
    each continues, in order: `id`, `next` (the run it continues), `n` (its position in the
    chain, `position` for the first) and `columns`; no further than position `MAX_CHAIN` + 1,
    so a chain too long shows as a last row with a `next`."""
    chain = (
        select(
            RUNS.c.id,
            RUNS.c.continued_from_run_id.label("next"),
            *(RUNS.c[name] for name in columns),
            literal(position).label("n"),
        )
        .where(RUNS.c.id == bindparam(start))
        .cte("chain", recursive=True)
    )
    earlier = RUNS.alias("earlier")
    return chain.union_all(
        select(
            earlier.c.id,
            earlier.c.continued_from_run_id,
            *(earlier.c[name] for name in columns),
            chain.c.n + 1,
        ).where(earlier.c.id == chain.c.next, chain.c.n <= MAX_CHAIN)
    )


def _chain_spend() -> Select[Any]:
    """The runs of the chain from `:root` (the run it continues, and so on, up to `MAX_CHAIN`),
    in order, each with its times and what the tree rooted at it spent (the sums, the runs
    counted and the highest cost source are those of the runs whose root it is)."""
    runs = RUNS
    chain = chain_cte("root", 1)  # the root is the first of its chain
    spend = (
        select(
            runs.c.root_run_id.label("root"),
            func.sum(runs.c.input_tokens + runs.c.output_tokens).label("tokens"),
            func.sum(runs.c.cost_amount).label("cost"),
            func.count().label("runs"),
            func.max(runs.c.cost_source).label("source"),
        )
        .where(runs.c.root_run_id.in_(select(chain.c.id)))
        .group_by(runs.c.root_run_id)
        .subquery("spend")
    )
    member = runs.alias("member")
    return (
        select(
            chain.c.n,
            chain.c.next,
            member.c.started_at,
            member.c.ended_at,
            member.c.heartbeat_at,
            member.c.error_type,
            member.c.waited_ms,
            spend.c.tokens,
            spend.c.cost,
            spend.c.runs,
            spend.c.source,
        )
        .select_from(
            chain.join(member, member.c.id == chain.c.id).outerjoin(
                spend, spend.c.root == chain.c.id
            )
        )
        .order_by(chain.c.n)
    )


_CHAIN_SPEND: Final = _chain_spend()


def _executed_ms(run: Row[Any]) -> int:
    """How long a run of the chain executed (its waits for a person excluded); an orphan
    counts to its last heartbeat."""
    if run.started_at is None:
        return 0
    closed_by_recovery = run.error_type in ("orphaned", "interrupted")
    last_sign = run.heartbeat_at if closed_by_recovery else None
    end = last_sign or run.ended_at or run.heartbeat_at or run.started_at
    executed = int((end - run.started_at).total_seconds() * 1000) - (run.waited_ms or 0)
    return max(executed, 0)
