"""tracon-jobs: a reliability control plane for LLM agent runs on Celery."""

from tracon_jobs.agents.tools import ToolContext, tool

__version__ = "0.1.0"

__all__ = ["ToolContext", "__version__", "tool"]
