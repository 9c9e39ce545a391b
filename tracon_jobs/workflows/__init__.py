"""Durable workflows: Python functions whose nodes are checkpointed, which can wait for a
person, for a time, for an event or for branches run at once without holding a worker, and
which resume from their checkpoints after an operator's resume or a crash."""

from tracon_jobs.workflows.context import TIMED_OUT, WorkflowContext
from tracon_jobs.workflows.fanout import Branch, BranchFailed, OnFailure
from tracon_jobs.workflows.registry import WorkflowRegistry, WorkflowSpec, registry, workflow

__all__ = [
    "TIMED_OUT",
    "Branch",
    "BranchFailed",
    "OnFailure",
    "WorkflowContext",
    "WorkflowRegistry",
    "WorkflowSpec",
    "registry",
    "workflow",
]
