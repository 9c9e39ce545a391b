"""The import graph points one way: no circle among the modules of `tracon_jobs`, `web` and
`beat_schedules`; every module sits in a layer (`LAYERS`, bottom to top) and imports nothing
of a higher one; nothing below `web` imports `web`, the command line or `beat_schedules`;
domain code never takes the composition root; `coordination` is Redis-only.

Read from the source with `ast` (every import, function-local and `TYPE_CHECKING` ones
included), so a lazy import cannot hide a circle or an upward arrow."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tracon_jobs", "web", "beat_schedules")
DOMAIN = (
    "tracon_jobs.runs",
    "tracon_jobs.resilience",
    "tracon_jobs.limits",
    "tracon_jobs.coordination",
    "tracon_jobs.providers",
    "tracon_jobs.db",
)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (`from pkg import mod` counts as `pkg.mod`)."""
    targets: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[: len(package) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            subs = {f"{base}.{alias.name}" for alias in node.names}
            targets.update(sub for sub in subs if sub in known)
            if not subs <= known.keys():
                targets.add(base)
    return {resolved for t in targets if (resolved := _owner(t, known)) and resolved != name}


def _owner(target: str, known: dict[str, Path]) -> str | None:
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "leaves",  # import nothing of the project
        (
            "tracon_jobs.errors",
            "tracon_jobs.timers",
            "tracon_jobs.per_process",
            "tracon_jobs.leaving",
            "tracon_jobs.abort",
            "tracon_jobs.numbers",
            "tracon_jobs.startup",
            "tracon_jobs.handoff",
            "tracon_jobs.drain_file",
            "tracon_jobs.embedded_redis",
        ),
    ),
    # the process's tracer (the SDK only when asked for), and log lines that carry its ids
    ("traces and logs", ("tracon_jobs.tracing", "tracon_jobs.logs")),
    ("switches", ("tracon_jobs.fast_paths",)),
    ("stores", ("tracon_jobs.coordination", "tracon_jobs.db")),
    ("models and tools", ("tracon_jobs.providers", "tracon_jobs.agents")),
    (
        "what the domain reads",  # settings name the providers' capabilities
        (
            "tracon_jobs.settings",
            "tracon_jobs.redis_clients",  # Redis clients and the broker's URL, from settings
            "tracon_jobs.metrics",
            "tracon_jobs.pricing",
            "tracon_jobs.idempotency",
            "tracon_jobs.tracing.genai",  # the spans of a run: named by providers' types
            # what a webhook is and how it is signed and sent: no run in them
            "tracon_jobs.webhooks.events",
            "tracon_jobs.webhooks.signing",
            "tracon_jobs.webhooks.addresses",
            "tracon_jobs.webhooks.sender",
        ),
    ),
    # the providers' guards; the spend limits: tree budgets and tenant quotas
    ("guards and limits", ("tracon_jobs.resilience", "tracon_jobs.limits")),
    ("runs", ("tracon_jobs.runs",)),
    (
        "built on runs",
        (
            "tracon_jobs.workflows",
            "tracon_jobs.tenants",
            "tracon_jobs.webhooks",  # the outbox reaches `runs` through a Protocol of theirs
            "tracon_jobs.integrations",
            "tracon_jobs.schedules",  # runs started at the slots of a cron or an interval
        ),
    ),
    ("the Python surface", ("tracon_jobs", "tracon_jobs.demo")),  # `tracon_jobs`: its __init__
    ("Celery", ("tracon_jobs.worker",)),
    ("composition root", ("tracon_jobs.runtime",)),
    ("periodic tasks", ("beat_schedules",)),
    ("entry points", ("web", "tracon_jobs.cli")),
)
"""Bottom to top: a module may import its own layer and those below it. An entry names a
module or a package with everything in it (the longest entry wins); `tracon_jobs` names only
the package's `__init__`, so a new top-level module must be placed here."""


def ranks(
    names: Iterable[str], layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS
) -> dict[str, int]:
    """Each name's layer (its index in `layers`); a name no entry covers is left out."""
    found = {}
    for name in names:
        matches = [
            (len(entry), index)
            for index, (_, entries) in enumerate(layers)
            for entry in entries
            if name == entry or (entry != "tracon_jobs" and name.startswith(entry + "."))
        ]
        if matches:
            found[name] = max(matches)[1]
    return found


def upward(
    edges: dict[str, set[str]], layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS
) -> list[str]:
    """Every import of a module of a higher layer, as `importer (layer) -> imported (layer)`."""
    rank = ranks(edges, layers)
    return sorted(
        f"{name} ({layers[rank[name]][0]}) -> {target} ({layers[rank[target]][0]})"
        for name, targets in edges.items()
        for target in targets
        if name in rank and target in rank and rank[target] > rank[name]
    )


def test_every_module_has_a_layer() -> None:
    edges = graph()
    assert sorted(set(edges) - ranks(edges).keys()) == []


def test_no_module_imports_a_higher_layer() -> None:
    assert upward(graph()) == []


def test_the_reader_sees_an_upward_arrow_when_there_is_one() -> None:
    layers = (("low", ("b",)), ("high", ("a",)))
    edges = {"a.x": {"b", "a.y"}, "a.y": set(), "b": {"a.y"}}
    assert upward(edges, layers) == ["b (low) -> a.y (high)"]
    assert ranks(["a", "a.x", "c"], layers) == {"a": 1, "a.x": 1}


def test_no_import_circle() -> None:
    assert cycles(graph()) == []


def test_nothing_below_the_entry_points_imports_them() -> None:
    upward = {
        name: sorted(
            t for t in targets if t.startswith(("web", "beat_schedules", "tracon_jobs.cli"))
        )
        for name, targets in graph().items()
        if name.startswith("tracon_jobs") and not name.startswith("tracon_jobs.cli")
    }
    assert {name: found for name, found in upward.items() if found} == {}


def test_domain_code_never_takes_the_composition_root() -> None:
    bag = [
        name
        for name, targets in graph().items()
        if name.startswith(DOMAIN) and "tracon_jobs.runtime" in targets
    ]
    assert bag == []


SWITCHES = {"tracon_jobs.fast_paths"}
"""Read by every layer: the process's own switches, importing nothing but `errors`."""


def test_coordination_is_redis_only() -> None:
    leaves = set(LAYERS[0][1])  # they import nothing of the project (a timer thread)
    outside = {
        name: sorted(
            t
            for t in targets
            if not t.startswith("tracon_jobs.coordination")
            and t not in SWITCHES
            and t not in leaves
        )
        for name, targets in graph().items()
        if name.startswith("tracon_jobs.coordination")
    }
    assert {name: found for name, found in outside.items() if found} == {}


def test_the_switches_import_nothing_but_errors() -> None:
    edges = graph()
    assert {name: sorted(edges[name]) for name in SWITCHES} == {
        name: ["tracon_jobs.errors"] for name in SWITCHES
    }
    assert edges["tracon_jobs.errors"] == set()


def test_the_reader_sees_a_circle_when_there_is_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
