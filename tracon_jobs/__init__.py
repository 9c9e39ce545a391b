"""tracon-jobs: a reliability control plane for LLM agent runs on Celery."""

from tracon_jobs.agents.tools import ToolContext, tool
from tracon_jobs.workflows import WorkflowContext, workflow

__version__ = "0.2.0"

__all__ = ["ToolContext", "WorkflowContext", "__version__", "tool", "workflow"]
