"""A run's history as one unit, and that unit as JSON lines (`tracon-jobs runs export`, the
retention's archive).

The unit is a *group*: the run's tree (every run with its `root_run_id`) together with the
chain its trees form. A run that continues another (`continued_from_run_id`: a workflow's
answer, timer, event or resume; an agent run's continuation) begins a tree of its own, so a
chain spans several trees; the trees linked that way, in either direction, are one group.
Retention deletes a group whole or not at all, and the export writes it whole.

The lines, oldest tree first and each tree's runs by depth then creation:

    {"type": "run", ...the run JSON of GET /api/runs/{id}}
    {"type": "event", "runId", "seq", "event", "at", "data"}       its events, by seq
    {"type": "toolCall", "runId", ...}                                its tool-call ledger rows
    {"type": "workflowNode", "runId", "node", "kind", "status", ...}  its checkpoints, requests
    {"type": "approval", "runId", ...}                                its approvals
    {"type": "workflowEvent", "chainId", "name", ...}                 events kept for its chain

each run's line followed by the lines of its rows; the kept events of a chain follow the line
of the chain's first run (their `chainId`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TypeVar, cast

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from tracon_jobs.db import Database
from tracon_jobs.db.models import (
    Approval,
    Run,
    RunEvent,
    Tenant,
    ToolCallRecord,
    WorkflowEvent,
    WorkflowNode,
)
from tracon_jobs.numbers import json_text
from tracon_jobs.runs.lifecycle import TERMINAL
from tracon_jobs.runs.store import iso
from tracon_jobs.runs.views import approval_json, run_json, tool_call_json

RUNS = cast(Table, Run.__table__)

IDS_PER_STATEMENT = 100
"""The most run ids one statement names: each read and each delete of a group touches a
bounded number of rows, found through an index (`IN` over an indexed column)."""

MAX_GROUP_RUNS = 50_000
"""A group with more runs than this is neither exported whole nor deleted (`GroupTooLarge`):
one transaction must stay bounded. No tree reaches it under `AgentGraph`'s limits."""

_TERMINAL = frozenset(status.value for status in TERMINAL)

T = TypeVar("T")


class GroupTooLarge(Exception):
    """The group has more runs than `MAX_GROUP_RUNS`."""


@dataclass(frozen=True)
class Member:
    """One run of a group, as the retention judges it."""

    id: str
    tenant_id: str
    root_run_id: str
    continued_from_run_id: str | None
    status: str
    depth: int
    created_at: datetime
    ended_at: datetime | None


@dataclass(frozen=True)
class RunGroup:
    """A run tree and the trees its chain links to it, its runs in export order."""

    members: tuple[Member, ...]

    @property
    def ids(self) -> list[str]:
        return [member.id for member in self.members]

    @property
    def roots(self) -> set[str]:
        return {member.root_run_id for member in self.members}

    @property
    def first(self) -> str:
        """The id of the group's first run (a tree's root; a chain's oldest root)."""
        return self.members[0].id

    @property
    def tenant_id(self) -> str:
        return self.members[0].tenant_id

    @property
    def live(self) -> bool:
        """Whether any run of it is still `Queued`, `Running` or `Waiting`."""
        return any(member.status not in _TERMINAL for member in self.members)

    @property
    def last_ended(self) -> datetime:
        """When its last run ended (a terminal run without an end counts its creation)."""
        return max(member.ended_at or member.created_at for member in self.members)

    def expired(self, cutoff: datetime) -> bool:
        """Every run of it ended, the last before `cutoff`: the group may go."""
        return not self.live and self.last_ended < cutoff


def chunks(items: Iterable[T], size: int = IDS_PER_STATEMENT) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


_MEMBER_COLUMNS = (
    RUNS.c.id,
    RUNS.c.tenant_id,
    RUNS.c.root_run_id,
    RUNS.c.continued_from_run_id,
    RUNS.c.status,
    RUNS.c.depth,
    RUNS.c.created_at,
    RUNS.c.ended_at,
)


def find_groups(session: Session, root_ids: Iterable[str]) -> list[RunGroup]:
    """The groups of the trees `root_ids` (each once, however many of its trees are named):
    the trees' runs, then the trees linked to them by a continuation either way, until no new
    tree turns up, split into the groups the links make. Every read names at most
    `IDS_PER_STATEMENT` ids of an indexed column (`ix_runs_root`, the primary key,
    `ix_runs_continued_from`), and there are three a link away, whatever the number of
    trees. `GroupTooLarge` past `MAX_GROUP_RUNS` runs in all."""
    members: dict[str, Member] = {}
    links = _Links()
    frontier = set(root_ids)
    while frontier:
        links.add_roots(frontier)
        found: list[Member] = []
        for batch in chunks(sorted(frontier)):
            rows = session.execute(select(*_MEMBER_COLUMNS).where(RUNS.c.root_run_id.in_(batch)))
            found.extend(Member(*row) for row in rows)
        members.update((member.id, member) for member in found)
        if len(members) > MAX_GROUP_RUNS:
            raise GroupTooLarge(f"more than {MAX_GROUP_RUNS} runs linked to {min(links.roots)}")
        continued: dict[str, Member] = {}
        for member in found:
            before = member.continued_from_run_id
            if before in members:
                links.join(member.root_run_id, members[before].root_run_id)
            elif before is not None:
                continued[before] = member
        for batch in chunks(sorted(continued)):
            query = select(RUNS.c.id, RUNS.c.root_run_id).where(RUNS.c.id.in_(batch))
            for before, root in session.execute(query):
                links.join(continued[before].root_run_id, root)
        for batch in chunks(member.id for member in found):
            query = select(RUNS.c.continued_from_run_id, RUNS.c.root_run_id).where(
                RUNS.c.continued_from_run_id.in_(batch)
            )
            for before, root in session.execute(query):
                links.join(members[before].root_run_id, root)
        frontier = links.roots - links.seen
    by_group: dict[str, dict[str, Member]] = defaultdict(dict)
    for member in members.values():
        by_group[links.group_of(member.root_run_id)][member.id] = member
    return [RunGroup(_ordered(group)) for group in by_group.values()]


def find_group(session: Session, root_id: str) -> RunGroup | None:
    """The group of the tree `root_id`; None when it has no run."""
    groups = find_groups(session, [root_id])
    return groups[0] if groups else None


class _Links:
    """Trees joined by continuations (union-find over root ids)."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.seen: set[str] = set()  # roots whose runs were read

    @property
    def roots(self) -> set[str]:
        return set(self.parent)

    def add_roots(self, roots: Iterable[str]) -> None:
        for root in roots:
            self.parent.setdefault(root, root)
            self.seen.add(root)

    def group_of(self, root: str) -> str:
        self.parent.setdefault(root, root)
        while self.parent[root] != root:
            self.parent[root] = self.parent[self.parent[root]]
            root = self.parent[root]
        return root

    def join(self, a: str, b: str) -> None:
        first, second = self.group_of(a), self.group_of(b)
        if first != second:
            self.parent[max(first, second)] = min(first, second)


def _ordered(members: dict[str, Member]) -> tuple[Member, ...]:
    """Oldest tree first; in a tree, by depth, then creation."""

    def key(member: Member) -> tuple[datetime, str, int, datetime, str]:
        root = members.get(member.root_run_id, member)
        return (root.created_at, root.id, member.depth, member.created_at, member.id)

    return tuple(sorted(members.values(), key=key))


def group_of_run(db: Database, run_id: str) -> RunGroup | None:
    """The group `run_id` belongs to; None when there is no such run."""
    with db.read() as session:
        root = session.scalar(select(RUNS.c.root_run_id).where(RUNS.c.id == run_id))
        return None if root is None else find_group(session, root)


# -- the lines ------------------------------------------------------------------------------


def group_documents(db: Database, group: RunGroup) -> Iterator[dict[str, Any]]:
    """The group's lines as objects, read `IDS_PER_STATEMENT` runs at a time (a run deleted
    meanwhile has none)."""
    with db.read() as session:
        tenant = session.scalar(select(Tenant.name).where(Tenant.id == group.tenant_id))
    for batch in chunks(group.ids):
        with db.read() as session:
            rows = _rows_of(session, batch)
        for run_id in batch:
            yield from _documents(run_id, rows, tenant)


def group_lines(db: Database, group: RunGroup) -> Iterator[str]:
    """The group's JSON lines (no newline)."""
    for document in group_documents(db, group):
        yield json_text(document, indent=None)


@dataclass
class _Rows:
    runs: dict[str, Run]
    events: dict[str, list[dict[str, Any]]]
    calls: dict[str, list[ToolCallRecord]]
    nodes: dict[str, list[WorkflowNode]]
    approvals: dict[str, list[Approval]]
    kept: dict[str, list[WorkflowEvent]]


def _rows_of(session: Session, run_ids: Sequence[str]) -> _Rows:
    runs = {run.id: run for run in session.scalars(select(Run).where(Run.id.in_(run_ids)))}
    events: dict[str, list[dict[str, Any]]] = defaultdict(list)
    event_rows = session.execute(
        select(RunEvent.run_id, RunEvent.seq, RunEvent.type, RunEvent.at, RunEvent.data)
        .where(RunEvent.run_id.in_(run_ids))
        .order_by(RunEvent.run_id, RunEvent.seq)
    )
    for run_id, seq, type_, at, data in event_rows:
        events[run_id].append(
            {
                "type": "event",
                "runId": run_id,
                "seq": seq,
                "event": type_,
                "at": iso(at),
                "data": data,
            }
        )
    calls = _by_run(
        session.scalars(
            select(ToolCallRecord)
            .where(ToolCallRecord.run_id.in_(run_ids))
            .order_by(ToolCallRecord.id)
        ),
        lambda row: row.run_id,
    )
    nodes = _by_run(
        session.scalars(
            select(WorkflowNode).where(WorkflowNode.run_id.in_(run_ids)).order_by(WorkflowNode.id)
        ),
        lambda row: row.run_id,
    )
    approvals = _by_run(
        session.scalars(
            select(Approval)
            .where(Approval.run_id.in_(run_ids))
            .order_by(Approval.requested_at, Approval.id)
        ),
        lambda row: row.run_id,
    )
    kept = _by_run(
        session.scalars(
            select(WorkflowEvent)
            .where(WorkflowEvent.chain_id.in_(run_ids))
            .order_by(WorkflowEvent.id)
        ),
        lambda row: row.chain_id,
    )
    return _Rows(runs, events, calls, nodes, approvals, kept)


def _by_run(rows: Iterable[T], run_of: Any) -> dict[str, list[T]]:
    grouped: dict[str, list[T]] = defaultdict(list)
    for row in rows:
        grouped[run_of(row)].append(row)
    return grouped


def _documents(run_id: str, rows: _Rows, tenant: str | None) -> Iterator[dict[str, Any]]:
    run = rows.runs.get(run_id)
    if run is None:  # deleted meanwhile
        return
    approvals = rows.approvals.get(run_id, [])
    pending = [a.id for a in approvals if a.status == "Pending"] if run.status == "Waiting" else []
    yield {"type": "run"} | run_json(run, tenant, pending)
    yield from rows.events.get(run_id, [])
    for call in rows.calls.get(run_id, []):
        yield {"type": "toolCall", "runId": run_id} | tool_call_json(call)
    for node in rows.nodes.get(run_id, []):
        yield _node_json(node)
    for approval in approvals:
        yield {"type": "approval"} | approval_json(approval)
    for kept in rows.kept.get(run_id, []):
        yield _kept_json(kept)


def _node_json(node: WorkflowNode) -> dict[str, Any]:
    return {
        "type": "workflowNode",
        "runId": node.run_id,
        "node": node.node,
        "kind": node.kind,
        "status": node.status,
        "payload": node.payload,
        "result": node.result,
        "createdAt": iso(node.created_at),
        "answeredAt": iso(node.answered_at),
        "dueAt": iso(node.due_at),
    }


def _kept_json(event: WorkflowEvent) -> dict[str, Any]:
    return {
        "type": "workflowEvent",
        "chainId": event.chain_id,
        "id": event.id,
        "name": event.name,
        "payload": event.payload,
        "createdAt": iso(event.created_at),
        "consumedAt": iso(event.consumed_at),
        "consumedBy": event.consumed_by,
    }


def write_lines(db: Database, group: RunGroup, out: IO[str]) -> int:
    """Write the group's lines to `out`; how many."""
    count = 0
    for line in group_lines(db, group):
        out.write(line + "\n")
        count += 1
    return count


def archive_path(directory: str | Path, group: RunGroup) -> Path:
    return Path(directory) / f"{group.first}.jsonl"


class GroupChanged(Exception):
    """A run of the group was gone when its archive was written (another pass deleted it)."""


def write_archive(db: Database, directory: str | Path, group: RunGroup) -> Path:
    """Write the group to `<directory>/<first run id>.jsonl`, whole or not at all: into a
    temporary file, flushed to disk, then renamed over any earlier copy. `GroupChanged`,
    leaving any earlier copy as it was, when a run of the group is no longer there."""
    path = archive_path(directory, group)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    runs = 0
    try:
        with open(partial, "w", encoding="utf-8") as out:
            for document in group_documents(db, group):
                runs += document["type"] == "run"
                out.write(json_text(document, indent=None) + "\n")
            out.flush()
            os.fsync(out.fileno())
        if runs != len(group.members):
            raise GroupChanged(f"{len(group.members) - runs} runs of {group.first} are gone")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path
