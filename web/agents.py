"""`GET /api/agents`: the configured agents, as a caller of `POST /api/agents/{name}/run` sees
them: the model binding with its fallback links, the tools with their side-effect class and
approval gate, the sub-agents. Instructions (the system message) are not shown."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify

from tracon_jobs.agents.tools import ToolRegistry
from tracon_jobs.settings.sections import AgentSettings, ModelBinding
from web.auth import require_tenant
from web.extensions import runtime

bp = Blueprint("agents", __name__, url_prefix="/api")
require_tenant(bp)


@bp.get("/agents")
def list_agents() -> Response:
    rt = runtime()
    items = [agent_json(name, agent, rt.tools) for name, agent in rt.settings.agents.items()]
    return jsonify({"items": items})


def agent_json(name: str, agent: AgentSettings, tools: ToolRegistry) -> dict[str, Any]:
    return {
        "name": name,
        "model": binding_json(agent.model),
        "tools": [tool_json(tool, agent, tools) for tool in agent.tools],
        "subAgents": list(agent.sub_agents),
        "requireApproval": list(agent.require_approval),
        "parameters": agent.parameters,
    }


def binding_json(binding: ModelBinding) -> dict[str, Any]:
    return {
        "provider": binding.provider,
        "model": binding.model,
        "fallbacks": [{"provider": f.provider, "model": f.model} for f in binding.fallbacks],
        "temperature": binding.temperature,
        "topP": binding.top_p,
        "maxOutputTokens": binding.max_output_tokens,
    }


def tool_json(name: str, agent: AgentSettings, tools: ToolRegistry) -> dict[str, Any]:
    """One tool of the agent; `requiresApproval` is whether its calls wait for a person here
    (registered `requires_approval=True`, or named in the agent's `RequireApproval`)."""
    spec = tools.get(name)
    if spec is None:  # startup checks every agent's tools; a registry changed since
        return {"name": name, "description": None, "sideEffect": None, "requiresApproval": None}
    return {
        "name": name,
        "description": spec.description,
        "sideEffect": spec.side_effect,
        "idempotent": spec.idempotent,
        "requiresApproval": spec.requires_approval or name in agent.require_approval,
    }
