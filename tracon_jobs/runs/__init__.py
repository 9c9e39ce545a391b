"""Runs: their lifecycle, the tool-call loop that executes them, and their Celery tasks."""
