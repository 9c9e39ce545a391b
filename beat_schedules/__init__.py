"""The beat schedule and the thin periodic task bodies around `scan_once(now)` passes."""

from beat_schedules.schedule import build_schedule

__all__ = ["build_schedule"]
