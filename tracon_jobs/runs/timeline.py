"""A tenant's runs over time: runs, tokens and cost per hour or day, by agent or by model.

The bucket is computed by the database (`date_trunc` on PostgreSQL, `strftime` on SQLite),
so one grouped query answers however many runs there are; buckets without runs are filled
in here, so a plot has one point per bucket of the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import func, literal_column, select
from sqlalchemy.sql.elements import ColumnElement

from tracon_jobs.db import Database
from tracon_jobs.db.models import Run


class Bucket(StrEnum):
    HOUR = "hour"
    DAY = "day"

    @property
    def width(self) -> timedelta:
        return timedelta(hours=1) if self is Bucket.HOUR else timedelta(days=1)

    def floor(self, moment: datetime) -> datetime:
        hour = moment.replace(minute=0, second=0, microsecond=0)
        return hour if self is Bucket.HOUR else hour.replace(hour=0)


class GroupBy(StrEnum):
    AGENT = "agent"
    MODEL = "model"


@dataclass(frozen=True)
class SeriesPoint:
    """What the runs created in one bucket used, for one agent or model (None: no model
    answered them)."""

    start: datetime
    key: str | None
    runs: int
    input_tokens: int
    output_tokens: int
    cost: float

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class Series:
    """Every bucket of a window, oldest first, and each key's point in it."""

    bucket: Bucket
    group_by: GroupBy
    starts: list[datetime]
    keys: list[str | None]
    points: dict[tuple[datetime, str | None], SeriesPoint]

    def point(self, start: datetime, key: str | None) -> SeriesPoint:
        empty = SeriesPoint(start, key, 0, 0, 0, 0.0)
        return self.points.get((start, key), empty)


class RunTimeline:
    """Grouped reads of the `runs` table along `created_at`, one tenant at a time."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def series(
        self, tenant_id: str, *, until: datetime, buckets: int, bucket: Bucket, group_by: GroupBy
    ) -> Series:
        """The last `buckets` buckets up to `until` (naive UTC), the bucket of `until` last."""
        last = bucket.floor(until)
        starts = [last - bucket.width * i for i in reversed(range(buckets))]
        key = Run.agent if group_by is GroupBy.AGENT else Run.model_id
        start = self._bucket_start(bucket).label("bucket_start")
        query = (
            select(
                start,
                key,
                func.count(),
                func.sum(Run.input_tokens),
                func.sum(Run.output_tokens),
                func.sum(Run.cost_amount),
            )
            .where(Run.tenant_id == tenant_id, Run.created_at >= starts[0])
            .group_by(start, key)
        )
        with self.db.read() as session:
            rows = session.execute(query).all()
        points = {}
        for moment, name, runs, inputs, outputs, cost in rows:
            point = SeriesPoint(
                _as_datetime(moment),
                name,
                runs,
                int(inputs or 0),
                int(outputs or 0),
                float(cost or 0),
            )
            points[(point.start, name)] = point
        keys = sorted({name for _, name in points}, key=lambda name: (name is None, name or ""))
        return Series(bucket, group_by, starts, keys, points)

    def _bucket_start(self, bucket: Bucket) -> ColumnElement[Any]:
        """Literals, not bind parameters: the grouped expression must be the selected one."""
        if self.db.is_sqlite:
            pattern = "%Y-%m-%d %H:00:00" if bucket is Bucket.HOUR else "%Y-%m-%d 00:00:00"
            return func.strftime(literal_column(f"'{pattern}'"), Run.created_at)
        return func.date_trunc(literal_column(f"'{bucket.value}'"), Run.created_at)


def _as_datetime(value: datetime | str) -> datetime:
    """SQLite answers the bucket as text, PostgreSQL as a timestamp."""
    return value if isinstance(value, datetime) else datetime.fromisoformat(value)
