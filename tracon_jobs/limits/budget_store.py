"""AgentGraph budgets: one budget per run tree, shared by every branch on every worker.

The totals live in a Redis hash changed only by Lua (so branches on different workers see
one total at once) and are rebuilt from SQL when Redis lost them: the runs of the tree
(and of the runs a continuation continues) carry their own tokens and cost.

Checks, in the order the reliability guide's AgentGraph section gives them: tokens, cost
and time before every model call (between two turns) and before every tool call; depth
and child count before a new child run. A model call also reserves the tokens it may use,
and the check counts the reservations of the tree's other in-flight calls, so concurrent
branches overshoot a token limit by at most what their calls spend beyond their
reservations (the AgentGraph section's "bounded amount" for concurrent branches).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Literal, Protocol

from tracon_jobs.coordination.cluster import CoordinationClient
from tracon_jobs.coordination.scripts import Scripts

if TYPE_CHECKING:
    from tracon_jobs.settings import AgentGraphSettings

log = logging.getLogger(__name__)

Gate = Literal["model", "tool", "child", "node"]  # node: a workflow function node
NANOS = Decimal(10**9)
LOST = "?"
BUDGET_TTL_MS = 7 * 24 * 3600 * 1000


@dataclass(frozen=True)
class Limits:
    depth: int
    tokens: int | None
    cost: Decimal | None
    runs: int | None
    duration: timedelta | None

    @classmethod
    def from_settings(cls, graph: AgentGraphSettings) -> Limits:
        return cls(
            graph.depth_limit,
            graph.token_limit,
            graph.cost_limit,
            graph.run_limit,
            graph.duration_limit,
        )

    def as_args(self) -> list[int]:
        return [
            -1 if self.tokens is None else self.tokens,
            -1 if self.cost is None else int(self.cost * NANOS),
            -1 if self.duration is None else int(self.duration.total_seconds() * 1000),
            -1 if self.runs is None else self.runs,
        ]


BUDGET_EXCEEDED = "run_budget_exceeded"
QUOTA_EXCEEDED = "tenant_quota_exceeded"


@dataclass(frozen=True)
class Refusal:
    """Why a gate keeps work from starting: the run's error type (`run_budget_exceeded` for
    the tree's budget, `tenant_quota_exceeded` for the tenant's quota; both of class
    `QuotaExceeded`) and a message naming the limit."""

    type: str
    message: str

    @property
    def quota(self) -> bool:
        return self.type == QUOTA_EXCEEDED

    @property
    def tool_code(self) -> str:
        """The error code a refused tool call answers the model with."""
        return "TENANT_QUOTA_EXCEEDED" if self.quota else "BUDGET_EXCEEDED"

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Totals:
    tokens: int = 0
    cost: Decimal = Decimal(0)
    children: int = 0
    unknown_price: bool = False
    executed_ms: int = 0


UNCAPPED_ROOM = 4096
"""The most room left that caps a call asking for no particular output: beyond it the
request stays as configured (a model's own output ceiling may be lower than the budget's,
and a `max_tokens` above it is refused by some providers)."""


@dataclass(frozen=True)
class OutputAsk:
    """What a model call asks its tree's budget for: its input (estimated), the output it
    wants (None: as the model decides) and the answering link's prices, a token."""

    input_tokens: int
    output_tokens: int | None
    input_price: Decimal | None = None  # None: the link's model has no price
    output_price: Decimal | None = None
    default_output: int = 256  # reserved for a call that asks for no particular output

    def as_args(self) -> list[int | str]:
        return [
            self.input_tokens,
            self.output_tokens or 0,
            self.default_output,
            UNCAPPED_ROOM,
            _nanos_arg(self.input_price),
            _nanos_arg(self.output_price),
        ]


def _nanos_arg(price: Decimal | None) -> str:
    return "-1" if price is None else str(price * NANOS)


NO_ASK: list[int | str] = [-1, 0, 0, "-1", "-1"]
"""The gate's arguments past the fixed reservation when nothing is asked (not a model
call, or a plain reservation)."""


@dataclass(frozen=True)
class Verdict:
    refused: str  # the limit's setting name, or "" when allowed
    tokens: int
    reserved: int
    cost: Decimal
    children: int
    elapsed_ms: int
    output_cap: int = 0  # a model call's: the most output tokens it may ask for (0: none)
    reserve: int = 0  # tokens this gate reserved

    @property
    def allowed(self) -> bool:
        return not self.refused

    @property
    def lost(self) -> bool:
        """The store no longer has this tree (Redis was flushed): re-seed it from SQL."""
        return self.refused == LOST


class BudgetStore(Protocol):
    def open(self, root: str, seed: Totals) -> bool: ...

    def gate(
        self,
        root: str,
        kind: Gate,
        limits: Limits,
        reserve: int = 0,
        seed: Totals | None = None,
        ask: OutputAsk | None = None,
    ) -> Verdict:
        """Check (and reserve); with `seed`, a budget that does not exist is opened with it
        first, as `open` would (a fresh tree's first gate: one call for both).

        A model call's `ask` reserves its input and output (its output capped at the room
        the tree has left: `Verdict.output_cap`) instead of `reserve`."""
        ...

    def spend(
        self, root: str, *, released: int, tokens: int, cost: Decimal, unknown_price: bool
    ) -> None: ...

    def exclude_wait(self, root: str, waited_ms: int) -> None:
        """Time a run of the tree waited for a person does not count toward MaxDuration."""
        ...


class RedisBudgetStore:
    def __init__(self, client: CoordinationClient, prefix: str = "tracon") -> None:
        self.scripts = Scripts(client)
        self.prefix = prefix

    def key(self, root: str) -> str:
        return f"{self.prefix}:budget:{{{root}}}"

    def open(self, root: str, seed: Totals) -> bool:
        return bool(self.scripts("budget_open", [self.key(root)], _seed_args(seed)))

    def gate(
        self,
        root: str,
        kind: Gate,
        limits: Limits,
        reserve: int = 0,
        seed: Totals | None = None,
        ask: OutputAsk | None = None,
    ) -> Verdict:
        asked = [reserve, *NO_ASK] if ask is None else ask.as_args()
        args = [kind, *limits.as_args(), *asked, *(_seed_args(seed) if seed else [])]
        reply = self.scripts("budget_gate", [self.key(root)], args)
        refused, tokens, reserved, cost, children, elapsed, cap, reserved_now = reply
        text = refused.decode() if isinstance(refused, bytes) else str(refused)
        return Verdict(
            text,
            int(tokens),
            int(reserved),
            Decimal(int(cost)) / NANOS,
            int(children),
            int(elapsed),
            int(cap),
            int(reserved_now),
        )

    def spend(
        self, root: str, *, released: int, tokens: int, cost: Decimal, unknown_price: bool
    ) -> None:
        args = [-released, tokens, int(cost * NANOS), "1" if unknown_price else "0"]
        self.scripts("budget_spend", [self.key(root)], args, reply=False)

    def exclude_wait(self, root: str, waited_ms: int) -> None:
        if waited_ms > 0:
            self.scripts("budget_exclude_wait", [self.key(root)], [waited_ms])


def _seed_args(seed: Totals) -> list[int | str]:
    return [
        seed.tokens,
        int(seed.cost * NANOS),
        seed.children,
        "1" if seed.unknown_price else "0",
        seed.executed_ms,
        BUDGET_TTL_MS,
    ]


class MemoryBudgetStore:
    """The same rules in one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trees: dict[str, dict[str, int]] = {}

    @staticmethod
    def _now() -> int:
        return int(time.monotonic() * 1000)

    def open(self, root: str, seed: Totals) -> bool:
        with self._lock:
            if root in self._trees:
                return False
            self._trees[root] = {
                "tokens": seed.tokens,
                "reserved": 0,
                "cost": int(seed.cost * NANOS),
                "children": seed.children,
                "unknown": int(seed.unknown_price),
                "started": self._now() - seed.executed_ms,
            }
            return True

    def gate(
        self,
        root: str,
        kind: Gate,
        limits: Limits,
        reserve: int = 0,
        seed: Totals | None = None,
        ask: OutputAsk | None = None,
    ) -> Verdict:
        if seed is not None:
            self.open(root, seed)
        with self._lock:
            tree = self._trees.get(root)
            if tree is None:
                return Verdict(LOST, 0, 0, Decimal(0), 0, 0)
            token_limit, cost_limit, duration_limit, run_limit = limits.as_args()
            elapsed = self._now() - tree["started"]
            refused = _refusal(
                kind, tree, elapsed, token_limit, cost_limit, duration_limit, run_limit
            )
            if refused:
                return Verdict(
                    refused,
                    tree["tokens"],
                    tree["reserved"],
                    Decimal(tree["cost"]) / NANOS,
                    tree["children"],
                    elapsed,
                )
            if kind == "child":
                tree["children"] += 1
            cap = 0
            if kind == "model" and ask is not None:
                cap, reserve = _output_room(tree, ask, token_limit, cost_limit)
            reserved_before = tree["reserved"]
            if kind == "model":
                tree["reserved"] += reserve
            return Verdict(
                "",
                tree["tokens"],
                reserved_before,
                Decimal(tree["cost"]) / NANOS,
                tree["children"],
                elapsed,
                cap,
                reserve if kind == "model" else 0,
            )

    def exclude_wait(self, root: str, waited_ms: int) -> None:
        with self._lock:
            tree = self._trees.get(root)
            if tree is not None:
                tree["started"] += waited_ms

    def spend(
        self, root: str, *, released: int, tokens: int, cost: Decimal, unknown_price: bool
    ) -> None:
        with self._lock:
            tree = self._trees.get(root)
            if tree is None:  # lost: the next gate re-seeds it from SQL, which has this spend
                return
            tree["reserved"] -= released
            tree["tokens"] += tokens
            tree["cost"] += int(cost * NANOS)
            tree["unknown"] |= int(unknown_price)


def _output_room(
    tree: dict[str, int], ask: OutputAsk, token_limit: int, cost_limit: int
) -> tuple[int, int]:
    """(output cap or 0, tokens to reserve) of a model call the gate let through: what
    budget_gate.lua computes."""
    bounded, room = False, 0
    if token_limit >= 0:
        bounded, room = True, token_limit - tree["tokens"] - tree["reserved"] - ask.input_tokens
    out_price = ask.output_price
    if cost_limit >= 0 and not tree["unknown"] and out_price is not None and out_price > 0:
        in_nanos = 0 if ask.input_price is None else ask.input_price * NANOS
        left = cost_limit - tree["cost"] - ask.input_tokens * in_nanos
        by_cost = int((left / (out_price * NANOS)).to_integral_value(rounding="ROUND_FLOOR"))
        if not bounded or by_cost < room:
            bounded, room = True, by_cost
    room = max(room, 1)
    wanted = ask.output_tokens or 0
    out = wanted or ask.default_output
    if bounded and ((wanted and room < wanted) or (not wanted and room <= UNCAPPED_ROOM)):
        cap = out = room
    else:
        cap = 0
    reserve = ask.input_tokens + out if token_limit >= 0 else 0
    return cap, reserve


def _refusal(
    kind: Gate,
    tree: dict[str, int],
    elapsed: int,
    token_limit: int,
    cost_limit: int,
    duration_limit: int,
    run_limit: int,
) -> str:
    if kind == "child":
        return "MaxTotalRuns" if 0 <= run_limit < tree["children"] + 1 else ""
    if kind != "node" and 0 <= token_limit <= tree["tokens"] + tree["reserved"]:
        return "MaxTotalTokens"  # a function node spends no tokens: only cost and time stop it
    if 0 <= cost_limit <= tree["cost"] and not tree["unknown"]:
        return "MaxTotalCost"
    if 0 <= duration_limit <= elapsed:
        return "MaxDuration"
    return ""


def refusal_message(verdict: Verdict, limits: Limits, currency: str) -> str:
    """Which limit was hit, and the setting that raises it."""
    if verdict.refused == "MaxTotalTokens":
        return (
            f"the run tree spent {verdict.tokens} tokens of its {limits.tokens} "
            "(raise Tracon:AgentGraph:MaxTotalTokens)"
        )
    if verdict.refused == "MaxTotalCost":
        return (
            f"the run tree spent {verdict.cost:.6f} {currency} of its {limits.cost} "
            "(raise Tracon:AgentGraph:MaxTotalCost)"
        )
    if verdict.refused == "MaxDuration":
        return (
            f"the run tree has executed for {verdict.elapsed_ms / 1000:.1f}s of its "
            f"{limits.duration} (raise Tracon:AgentGraph:MaxDuration)"
        )
    return (
        f"the run tree already has {verdict.children} child runs of its {limits.runs} "
        "(raise Tracon:AgentGraph:MaxTotalRuns)"
    )
