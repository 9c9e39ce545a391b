"""What tracing costs while it is off: the tracing calls a run and a POST make, timed against the
run and the POST themselves, in one process.

`python -m bench.tracing_off [--runs 300] [--posts 300] [--redis URL]`.

The goal (issue: "tracing off within 1% of today") compares the code with tracing's calls to
the code without them. Two commits cannot show 1% on a shared 2-CPU machine (bench/README.md,
"B1 with tracing off and on"), and the commits between them changed more than tracing. So this
measures the difference itself, in one process, with no `OTEL_*` variable set (tracing off):

1. **Calls.** Every function of `tracon_jobs.tracing`, `tracon_jobs.tracing.genai` and
   `web.tracing`, and the two helpers of tracing's outside them (`runs.dispatch.submission`,
   `RunExecutor._model_call_span`), is wrapped with a counter (callers reach them through the
   module, `tracing.span(...)`, `genai.model_call(...)`; a call inside another is counted in
   both, which overstates), and `--runs` executor runs (`RunExecutor.execute`, B1's agent on a
   scripted provider, SQLite file, Redis) and `--posts` web POSTs (`POST /api/agents/bench/run`
   with `Prefer: respond-async` through the WSGI app) are made: calls of each function a run
   and a POST, and the arguments of the first call of each.
2. **The calls alone.** Each function is called again 20,000 times with those arguments (a
   returned context manager entered and left, as its caller does): CPU microseconds a call.
3. **The steps alone.** The counters removed, as many runs and POSTs again: CPU microseconds a
   run and a POST.

Tracing's share = the sum of calls x microseconds a call, over a step's microseconds. It counts
the calls and what they do off, not the arguments the callers evaluate for them (names and
objects already at hand: the callers build attributes only after `tracing.on()`), nor the
`traceparent` column a run's row binds as NULL.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from bench.b1_throughput import tracon_env, write_config
from bench.instructions import WARMUP, executor_step, web_step
from tracon_jobs.embedded_redis import start_embedded

GOAL = 0.01
"""Tracing off costs at most 1% of a run's and a POST's CPU."""
REPEATS = 20_000
WORKER_CONCURRENCY = 16


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing_off", description=__doc__)
    parser.add_argument("--runs", type=int, default=300, help="executor runs per pass")
    parser.add_argument("--posts", type=int, default=300, help="web POSTs per pass")
    parser.add_argument("--redis", help="Redis URL, flushed (default: an embedded server)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="tracon-tracing-off-"))
    embedded = None
    try:
        url = args.redis
        if url is None:
            embedded = start_embedded(workdir / "redis")
            url = embedded.url
        config = write_config(workdir, WORKER_CONCURRENCY)
        os.environ.update(tracon_env(config, f"sqlite:///{workdir / 'bench.db'}", url))
        for name in [name for name in os.environ if name.startswith("OTEL_")]:
            del os.environ[name]
        return measure(workdir, args.runs, args.posts)
    finally:
        if embedded is not None:
            embedded.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def measure(workdir: Path, runs: int, posts: int) -> int:
    from tracon_jobs import tracing
    from tracon_jobs.db.migrate import upgrade
    from tracon_jobs.runs import dispatch
    from tracon_jobs.runs.executor import RunExecutor
    from tracon_jobs.settings import load_settings
    from tracon_jobs.tracing import genai
    from web import tracing as web_tracing

    assert not tracing.on(), "tracing must be off"
    owners: list[Any] = [tracing, genai, web_tracing]  # every public function of these
    owners += [(dispatch, "submission"), (RunExecutor, "_model_call_span")]  # tracing's own
    print("tracing off: its calls against the steps that make them, one process, CPU time")
    print(f"  {'step':<28} {'N':>5} {'CPU us':>9} {'tracing us':>11} {'share':>7}  calls a step")
    shares: list[str] = []
    met = True
    for part, label, count in (("executor", "executor run", runs), ("web", "web POST", posts)):
        os.environ["TRACON_DATABASE_URL"] = f"sqlite:///{workdir / part}.db"  # a tenant each
        settings = load_settings()
        upgrade(settings.database.url)
        step = executor_step(settings, 2 * count + WARMUP) if part == "executor" else web_step()
        for _ in range(WARMUP):
            step()
        calls, first = counted(owners, step, count)
        per_call = {name: call_cost(first[name]) for name in calls}
        step_us = cpu_us(step, count)
        tracing_us = sum(calls[name] / count * per_call[name] for name in calls)
        share = tracing_us / step_us
        shares.append(f"{share:.2%} of a {label.split()[-1]}")
        met = met and share <= GOAL
        shown = ", ".join(f"{name} {calls[name] / count:g}" for name in sorted(calls))
        print(
            f"  {label:<28} {count:>5} {step_us:>9.1f} {tracing_us:>11.2f} {share:>7.2%}  {shown}"
        )
        for name in sorted(calls):
            print(f"    {name:<36} {per_call[name]:.3f} us a call")
    verdict = "met" if met else "missed"
    print(f"  tracing off costs {', '.join(shares)} (goal <= {GOAL:.0%}: {verdict})")
    return 0


def counted(
    owners: Sequence[Any], step: Callable[[], None], count: int
) -> tuple[Counter[str], dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]]:
    """Calls of each function of `owners` (a module's public functions, or an
    `(owner, name)` pair) during `count` steps, and the first call's function and arguments;
    the functions restored after."""
    calls: Counter[str] = Counter()
    first: dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = {}
    saved: list[tuple[Any, str, Any]] = []

    def wrap(key: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def counting(*args: Any, **kwargs: Any) -> Any:
            calls[key] += 1
            first.setdefault(key, (function, args, kwargs))
            return function(*args, **kwargs)

        return counting

    targets: list[tuple[Any, str]] = []
    for owner in owners:
        if isinstance(owner, tuple):
            targets.append(owner)
            continue
        targets += [
            (owner, name)
            for name, value in vars(owner).items()
            if not name.startswith("_")
            and inspect.isfunction(value)
            and value.__module__ == owner.__name__
        ]
    for owner, name in targets:
        function = getattr(owner, name)
        where = owner.__name__.removeprefix("tracon_jobs.")
        saved.append((owner, name, function))
        setattr(owner, name, wrap(f"{where}.{name}", function))
    try:
        for _ in range(count):
            step()
    finally:
        for owner, name, function in saved:
            setattr(owner, name, function)
    return calls, first


def call_cost(call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]) -> float:
    """CPU microseconds one call costs, as its caller makes it (a context manager it returns
    entered and left)."""
    function, args, kwargs = call

    def once() -> None:
        made = function(*args, **kwargs)
        if isinstance(made, AbstractContextManager):
            with made:
                pass

    for _ in range(1000):
        once()
    return cpu_us(once, REPEATS)


def cpu_us(step: Callable[[], None], count: int) -> float:
    started = time.process_time()
    for _ in range(count):
        step()
    return (time.process_time() - started) / count * 1e6


if __name__ == "__main__":
    sys.exit(main())
