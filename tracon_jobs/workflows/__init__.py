"""Durable workflows: Python functions whose nodes are checkpointed, which can wait for a
person, and which resume from their checkpoints after an operator's resume or a crash."""

from tracon_jobs.workflows.context import WorkflowContext
from tracon_jobs.workflows.registry import WorkflowRegistry, WorkflowSpec, registry, workflow

__all__ = ["WorkflowContext", "WorkflowRegistry", "WorkflowSpec", "registry", "workflow"]
