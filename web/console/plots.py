"""Stacked bar charts of a run series, laid out here and drawn as SVG by a template macro:
one bar per bucket, one segment per agent or model, a rounded scale and a legend."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from tracon_jobs.runs.timeline import Bucket, Series, SeriesPoint
from web.console.money import money

WIDTH, HEIGHT = 420, 210
LEFT, RIGHT, TOP, BOTTOM = 52, 8, 10, 26
MAX_X_LABELS = 6
TICKS = 4
PALETTE_SIZE = 8


@dataclass(frozen=True)
class Metric:
    name: str
    value: Callable[[SeriesPoint], float]
    label: Callable[[float], str]
    whole: bool  # counted in whole units: no scale step below 1


def _count(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:.3g}M"
    if value >= 1_000:
        return f"{value / 1_000:.3g}k"
    return f"{value:.3g}"


METRICS = {
    "runs": Metric("Runs", lambda p: p.runs, _count, whole=True),
    "tokens": Metric("Tokens", lambda p: p.total_tokens, _count, whole=True),
    "cost": Metric("Cost", lambda p: p.cost, money, whole=False),
}


@dataclass(frozen=True)
class Segment:
    x: float
    y: float
    width: float
    height: float
    color: int
    tip: str


@dataclass(frozen=True)
class Label:
    x: float
    y: float
    text: str


@dataclass(frozen=True)
class Chart:
    title: str
    width: int
    height: int
    segments: list[Segment]
    y_ticks: list[Label]
    x_labels: list[Label]
    legend: list[tuple[int, str]]
    total: str
    plot_left: int = LEFT
    plot_right: int = WIDTH - RIGHT


def stacked_chart(series: Series, metric_key: str, unit: str = "") -> Chart:
    metric = METRICS[metric_key]
    totals = [sum(metric.value(series.point(s, k)) for k in series.keys) for s in series.starts]
    step = nice_step(max(totals, default=0) / TICKS, metric.whole)
    top = step * max(1, math.ceil(max(totals, default=0) / step - 1e-9))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(1, len(series.starts))
    segments = []
    for index, start in enumerate(series.starts):
        base = 0.0
        for color, key in enumerate(series.keys):
            value = metric.value(series.point(start, key))
            if value <= 0:
                continue
            height = plot_h * value / top
            y = TOP + plot_h - base - height
            tip = f"{key or 'no model'} · {_when(start, series.bucket)} · {metric.label(value)}"
            segments.append(
                Segment(LEFT + index * slot + slot * 0.15, y, slot * 0.7, height, color, tip)
            )
            base += height
    count = round(top / step)
    ticks = [
        Label(LEFT - 6, TOP + plot_h - plot_h * i / count, metric.label(step * i))
        for i in range(count + 1)
    ]
    step = max(1, math.ceil(len(series.starts) / MAX_X_LABELS))
    x_labels = [
        Label(LEFT + (i + 0.5) * slot, HEIGHT - 8, _when(start, series.bucket))
        for i, start in enumerate(series.starts)
        if i % step == 0
    ]
    legend = [(color % PALETTE_SIZE, key or "no model") for color, key in enumerate(series.keys)]
    segments = [
        Segment(s.x, s.y, s.width, s.height, s.color % PALETTE_SIZE, s.tip) for s in segments
    ]
    total = f"{metric.label(sum(totals))}{unit}"
    return Chart(metric.name, WIDTH, HEIGHT, segments, ticks, x_labels, legend, total)


def nice_step(value: float, whole: bool) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at or above `value`: a scale step
    that reads well (at least 1 for whole units; 1 for nothing at all)."""
    if value <= 0 or (whole and value <= 1):
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    factors = (1, 2, 5, 10) if whole and power == 1 else (1, 2, 2.5, 5, 10)
    return float(next(f * power for f in factors if value <= f * power + 1e-12))


def _when(start: datetime, bucket: Bucket) -> str:
    return start.strftime("%H:%M") if bucket is Bucket.HOUR else start.strftime("%b %d")
