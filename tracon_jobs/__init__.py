"""tracon-jobs: a reliability control plane for LLM agent runs on Celery."""

from tracon_jobs.agents.tools import ToolContext, tool
from tracon_jobs.workflows import TIMED_OUT, Branch, BranchFailed, WorkflowContext, workflow

__version__ = "0.2.0"

__all__ = [
    "TIMED_OUT",
    "Branch",
    "BranchFailed",
    "ToolContext",
    "WorkflowContext",
    "__version__",
    "tool",
    "workflow",
]
