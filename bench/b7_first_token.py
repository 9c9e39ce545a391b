"""B7: time to first token through tracon, against the same model called directly.

A local OpenAI-compatible model (its own process) answers every `stream: true` chat
completion with its first chunk at 100 ms, then 20 more chunks 10 ms apart, then a usage
chunk and `data: [DONE]`. In one invocation, `--rounds` times, one after the other:

- **direct**: `--streams` concurrent streaming calls to the model with the official `openai`
  client (`OpenAI(base_url=<model>).chat.completions.create(..., stream=True)`, one thread
  each);
- **through tracon**: the same number of concurrent streaming calls with the same client to
  tracon's `/v1/chat/completions` (`model` = an agent bound to an `openai` provider whose
  `BaseUrl` is the model), one follower each: the streaming request itself.

Each call is timed from just before `create` to its first non-empty content delta; the
overhead is tracon's figure minus the direct one, at p50 and at p99. Every stream's deltas
must arrive in order and add up to the model's answer. The model logs when each request
reaches it (the stream's tag is its user message), so each side's time to a first delta is
split into "to the model's request" and "its first chunk to the client". The CPU each side
costs a stream is read too, every process apart (the web's and the worker's process groups,
the model's, this process's client threads, and Redis from its own `INFO cpu`): it says what
a burst of streams asks of the machine's CPUs before the last of them can start. See
bench/README.md for how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import redis
from openai import OpenAI

from bench.b1_throughput import child_env, choose_redis, issue_api_key
from bench.harness import (
    CLI,
    SSE_HEAD,
    STARTUP_TIMEOUT,
    GroupCpu,
    commands,
    completion_chunk,
    content_length,
    met,
    percentile,
    run_benchmark,
    sse_data,
    sse_end,
    start_server,
    start_web,
)
from tracon_jobs.cli.supervisor import Supervisor, wait_until
from tracon_jobs.embedded_redis import free_port

AGENT = "bench"
MODEL = "bench-model"
GOAL_P50_MS = 15.0
GOAL_P99_MS = 60.0
FIRST_CHUNK_SECONDS = 0.1
MORE_CHUNKS = 20
CHUNK_EVERY_SECONDS = 0.01
PIECES = [f"w{index:02d} " for index in range(MORE_CHUNKS + 1)]
ANSWER = "".join(PIECES)
"""What the model streams: one piece a chunk, the first at 100 ms."""
STREAM_TIMEOUT = 60.0
LATE_SECONDS = 2.0


@dataclass(frozen=True)
class Options:
    streams: int
    rounds: int
    worker_concurrency: int
    database: str | None
    redis: str | None
    keep: bool


@dataclass
class Stream:
    """One streaming call as the client saw it (seconds from just before `create`)."""

    first: float | None = None
    last: float | None = None
    deltas: list[str] = field(default_factory=list)
    problem: str = ""
    run_id: str = ""  # tracon's X-Tracon-Run-Id, to look a wrong stream up
    tag: str = ""  # in the user message, to find the model's request (the model logs it)
    started_at: float = 0.0  # wall clock, to set beside the model's log

    @property
    def whole(self) -> bool:
        """Every delta in order, none lost or doubled: the running text always a prefix of
        the answer, and the whole answer at the end."""
        text = ""
        for delta in self.deltas:
            text += delta
            if not ANSWER.startswith(text):
                return False
        return text == ANSWER and not self.problem


# -- the model: its own process, asyncio, chunked SSE ------------------------------------------


def serve_model(port: int, arrivals: str) -> None:
    """Serve `/v1/chat/completions` on 127.0.0.1:`port` until killed; each request's arrival
    (wall clock, then its last user message) is a line of the file `arrivals`."""
    with open(arrivals, "a", buffering=1) as log:
        asyncio.run(_serve_forever(port, log))


async def _serve_forever(port: int, log: TextIO) -> None:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _connection(reader, writer, log)

    server = await asyncio.start_server(connection, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


async def _connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: TextIO
) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            body = await reader.readexactly(content_length(head))
            await _answer(head, body, writer, log)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


async def _answer(head: bytes, body: bytes, writer: asyncio.StreamWriter, log: TextIO) -> None:
    if not head.startswith(b"POST ") or b"/chat/completions" not in head.split(b"\r\n", 1)[0]:
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        return
    request = json.loads(body or b"{}")
    users = [m for m in request.get("messages", []) if m.get("role") == "user"]
    if users:
        log.write(f"{time.time():.6f} {users[-1].get('content')}\n")
    if not request.get("stream"):
        await asyncio.sleep(FIRST_CHUNK_SECONDS + MORE_CHUNKS * CHUNK_EVERY_SECONDS)
        answer = json.dumps(_completion()).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(answer)}\r\n\r\n".encode()
            + answer
        )
        await writer.drain()
        return
    writer.write(SSE_HEAD)
    await writer.drain()
    started = time.monotonic()
    for index, piece in enumerate(PIECES):
        due = started + FIRST_CHUNK_SECONDS + index * CHUNK_EVERY_SECONDS
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        delta = {"role": "assistant", "content": piece} if index == 0 else {"content": piece}
        await _send(writer, _chunk(delta, None))
    await _send(writer, _chunk({}, "stop"))
    options = request.get("stream_options") or {}
    if options.get("include_usage"):
        await _send(writer, {**_chunk({}, None), "choices": [], "usage": _usage()})
    writer.write(sse_end())
    await writer.drain()


async def _send(writer: asyncio.StreamWriter, chunk: dict[str, object]) -> None:
    writer.write(sse_data(chunk))
    await writer.drain()


def _chunk(delta: dict[str, str], finish: str | None) -> dict[str, object]:
    return completion_chunk(MODEL, delta, finish, ident="chatcmpl-b7")


def _completion() -> dict[str, object]:
    message = {"role": "assistant", "content": ANSWER}
    return {
        "id": "chatcmpl-b7",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        "usage": _usage(),
    }


def _usage() -> dict[str, int]:
    return {"prompt_tokens": 10, "completion_tokens": len(PIECES), "total_tokens": 10 + len(PIECES)}


def start_model(children: Supervisor, env: dict[str, str], arrivals: Path) -> str:
    port = free_port()
    code = f"from bench.b7_first_token import serve_model; serve_model({port}, {str(arrivals)!r})"
    start_server(children, "model", [sys.executable, "-c", code], env, port)
    return f"http://127.0.0.1:{port}/v1"


# -- the clients -------------------------------------------------------------------------------


def one_stream(client: OpenAI, model: str, gate: threading.Barrier, index: int) -> Stream:
    stream = Stream(tag=f"stream {index} {uuid.uuid4().hex}")
    gate.wait(timeout=STREAM_TIMEOUT)
    stream.started_at = time.time()
    started = time.perf_counter()
    try:
        chunks = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": stream.tag}],
            stream=True,
        )
        stream.run_id = chunks.response.headers.get("x-tracon-run-id", "")
        for chunk in chunks:
            for choice in chunk.choices:
                text = choice.delta.content
                if text:
                    now = time.perf_counter() - started
                    if stream.first is None:
                        stream.first = now
                    stream.last = now
                    stream.deltas.append(text)
    except Exception as exc:  # a failed stream is reported, not raised
        stream.problem = f"{type(exc).__name__}: {exc}"
    return stream


def measure(client: OpenAI, model: str, count: int) -> list[Stream]:
    """`count` streaming calls at once (a barrier lets every thread start together)."""
    gate = threading.Barrier(count)
    with ThreadPoolExecutor(count, thread_name_prefix="b7-stream") as pool:
        futures = [pool.submit(one_stream, client, model, gate, i) for i in range(count)]
        return [future.result() for future in futures]


def openai_client(base_url: str, api_key: str) -> OpenAI:
    """The official client as an application makes it (its pool holds 1000 connections)."""
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=STREAM_TIMEOUT)


# -- the whole benchmark -----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.b7_first_token", description=__doc__)
    parser.add_argument("--streams", type=int, default=100, help="concurrent streams, each side")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each side")
    parser.add_argument("--worker-concurrency", type=int, default=100, help="worker threads")
    parser.add_argument("--database", help="SQL URL (default: a fresh SQLite file)")
    parser.add_argument("--redis", help="Redis URL, flushed (default: a private server)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir and its logs")
    args = parser.parse_args(argv)
    if min(args.streams, args.rounds, args.worker_concurrency) < 1:
        parser.error("--streams, --rounds and --worker-concurrency must be at least 1")
    return Options(**vars(args))


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    return run_benchmark("b7", options.keep, lambda *context: benchmark(options, *context))


def write_config(workdir: Path, model_url: str, options: Options) -> Path:
    config = {
        "Providers": {"model": {"Kind": "openai", "BaseUrl": model_url, "ApiKey": "bench"}},
        "Agents": {
            AGENT: {
                "Instructions": "benchmark agent",
                "Model": {"Provider": "model", "Model": MODEL},
                "Tools": [],
            }
        },
        "Pricing": {"Models": {MODEL: {"InputPerMillion": 1, "OutputPerMillion": 2}}},
        "Worker": {"Concurrency": options.worker_concurrency},
        "Web": {"MaxStreamsPerTenant": options.streams * 4},
    }
    path = workdir / "tracon.json"
    path.write_text(json.dumps({"Tracon": config}, indent=2))
    return path


def benchmark(options: Options, workdir: Path, children: Supervisor, cleanup: ExitStack) -> int:
    redis_url = choose_redis(options.redis, workdir, cleanup)
    database = options.database or f"sqlite:///{workdir / 'tracon.db'}"
    redis.Redis.from_url(redis_url).flushdb()
    plain = child_env()
    arrivals = workdir / "model-arrivals.log"
    model_url = start_model(children, plain, arrivals)
    config = write_config(workdir, model_url, options)
    env = child_env(
        TRACON_CONFIG=str(config), TRACON_DATABASE_URL=database, TRACON_REDIS_URL=redis_url
    )
    api_key = issue_api_key(env)
    base = start_web(children, env, workers=2, threads=32)
    worker = children.start("worker", [*CLI, "worker", "-n", "b7@%h"], env)
    wait_until(
        lambda: " ready." in worker.text(),
        what="worker ready",
        timeout=STARTUP_TIMEOUT,
        watch=children.running(),
    )
    direct = cleanup.enter_context(openai_client(model_url, "bench"))
    tracon = cleanup.enter_context(openai_client(f"{base}/v1", api_key))
    # warm-up, not timed: connections, the web's and the worker's threads and pools
    warm = measure(direct, MODEL, options.streams) + measure(tracon, AGENT, options.streams)
    if any(not one.whole for one in warm):
        failed = next(one for one in warm if not one.whole)
        raise RuntimeError(f"warm-up streams failed: {failed.problem or failed.deltas}")
    counter = redis.Redis.from_url(redis_url)
    cleanup.callback(counter.close)
    direct_streams: list[Stream] = []
    tracon_streams: list[Stream] = []
    redis_commands = 0
    cpu = {"direct": Cpu(), "through tracon": Cpu()}
    for _ in range(options.rounds):
        with cpu["direct"].counting(children, counter):
            direct_streams += measure(direct, MODEL, options.streams)
        before = commands(counter)
        with cpu["through tracon"].counting(children, counter):
            tracon_streams += measure(tracon, AGENT, options.streams)
            time.sleep(0.5)  # the runs' last writes (the run ends after its stream's last frame)
        redis_commands += commands(counter) - before - 1
    children.check_alive()
    return report(
        options, direct_streams, tracon_streams, redis_commands, read_arrivals(arrivals), cpu
    )


@dataclass
class Cpu:
    """CPU seconds one side spent, by process, over its rounds."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def counting(self, children: Supervisor, client: redis.Redis) -> Iterator[None]:
        groups = GroupCpu({child.name: child.popen.pid for child in children.running()})
        mine, server = _own_cpu(), _redis_cpu(client)
        yield
        groups.stop()
        found = {**groups.seconds, CLIENT: _own_cpu() - mine, "redis": _redis_cpu(client) - server}
        for name, seconds in found.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds


CLIENT = "bench client"
CPU_ORDER = ("web", "worker", "model", "redis", CLIENT)


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def _redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def read_arrivals(path: Path) -> dict[str, float]:
    """The model's log: when each request (by its stream's tag) reached it."""
    arrivals = {}
    for line in path.read_text().splitlines():
        at, _, tag = line.partition(" ")
        arrivals[tag] = float(at)
    return arrivals


# -- report ------------------------------------------------------------------------------------


def report(
    options: Options,
    direct: list[Stream],
    tracon: list[Stream],
    redis_commands: int,
    arrivals: dict[str, float],
    cpu: dict[str, Cpu],
) -> int:
    print(
        f"B7: time to first token, {options.streams} concurrent streams, {options.rounds} "
        f"round(s) each side; the model's first chunk at {FIRST_CHUNK_SECONDS * 1000:.0f} ms, "
        f"then {MORE_CHUNKS} every {CHUNK_EVERY_SECONDS * 1000:.0f} ms"
    )
    print(
        f"\n  {'measure':<26} {'N':>5} {'first p50':>10} {'first p99':>10} "
        f"{'first max':>10} {'last p50':>10}"
    )
    figures = {}
    for label, streams in (("direct (openai client)", direct), ("through tracon (/v1)", tracon)):
        firsts = [1000 * s.first for s in streams if s.first is not None]
        lasts = [1000 * s.last for s in streams if s.last is not None]
        figures[label] = (percentile(firsts, 0.5), percentile(firsts, 0.99))
        print(
            f"  {label:<26} {len(streams):>5} {figures[label][0]:>7.1f} ms "
            f"{figures[label][1]:>7.1f} ms {max(firsts, default=0):>7.1f} ms "
            f"{percentile(lasts, 0.5):>7.1f} ms"
        )
    (direct_p50, direct_p99), (tracon_p50, tracon_p99) = figures.values()
    overhead_p50, overhead_p99 = tracon_p50 - direct_p50, tracon_p99 - direct_p99
    deltas = sum(len(s.deltas) for s in tracon) / max(1, len(tracon))
    late = sum(1 for s in tracon if s.first is not None and s.first > LATE_SECONDS)
    print()
    print(
        f"  overhead p50 {overhead_p50:.1f} ms (goal <= {GOAL_P50_MS:.0f} ms: "
        f"{met(overhead_p50 <= GOAL_P50_MS)})"
    )
    print(
        f"  overhead p99 {overhead_p99:.1f} ms (goal <= {GOAL_P99_MS:.0f} ms: "
        f"{met(overhead_p99 <= GOAL_P99_MS)})"
    )
    wrong = [s for s in direct + tracon if not s.whole]
    whole = len(direct) + len(tracon) - len(wrong)
    print(
        f"  streams with every delta in order and the whole answer: {whole} of "
        f"{len(direct) + len(tracon)} (goal all: {met(not wrong)})"
    )
    print(f"  deltas a stream through tracon: {deltas:.1f} (the model sends {len(PIECES)})")
    print(f"  streams through tracon whose first delta came after {LATE_SECONDS:.0f} s: {late}")
    if tracon:
        print(
            f"  Redis commands a streamed run (every process): {redis_commands / len(tracon):.1f}"
        )
    if tracon and deltas <= 1:
        print(
            "  note: one delta a stream through tracon: the answer reached the client only "
            "once the model call had ended"
        )
    print("  where a first delta's time goes, p50 / p99 (the model's log, the client's clock):")
    for label, streams in (("direct", direct), ("through tracon", tracon)):
        before, after = stages(streams, arrivals)
        print(
            f"    {label:<15} to the model's request {percentile(before, 0.5):>6.1f} / "
            f"{percentile(before, 0.99):>6.1f} ms; its first chunk to the client "
            f"{percentile(after, 0.5):>6.1f} / {percentile(after, 0.99):>6.1f} ms"
        )
    print("  CPU a stream, ms (each process, all its threads, over the side's rounds):")
    totals = {}
    for (label, side), streams in zip(cpu.items(), (direct, tracon), strict=True):
        per = {
            name: 1000 * side.seconds.get(name, 0.0) / max(1, len(streams)) for name in CPU_ORDER
        }
        totals[label] = sum(per.values())
        parts = ", ".join(f"{name} {ms:.2f}" for name, ms in per.items())
        print(f"    {label:<15} {parts}; all {totals[label]:.2f}")
    added = totals["through tracon"] - totals["direct"]
    cpus = os.cpu_count() or 1
    print(
        f"    through tracon a stream costs {added:.2f} ms of CPU more: {options.streams} "
        f"streams at once ask {options.streams * added / cpus:.0f} ms more of each of the "
        f"machine's {cpus} CPUs"
    )
    for stream in wrong[:5]:
        shown = stream.problem or f"deltas {stream.deltas!r}"
        print(f"    FAILED stream {stream.run_id or '(direct)'}: {shown}", file=sys.stderr)
    print(
        f"SUMMARY B7 direct_p50_ms={direct_p50:.1f} tracon_p50_ms={tracon_p50:.1f} "
        f"overhead_p50_ms={overhead_p50:.1f} overhead_p99_ms={overhead_p99:.1f} ok={not wrong}"
    )
    return 0 if not wrong else 1


def stages(streams: list[Stream], arrivals: dict[str, float]) -> tuple[list[float], list[float]]:
    """For each stream with a first delta: from `create` to the model's request, and from the
    model's first chunk (its request's arrival + 100 ms) to the client's first delta, in ms."""
    before, after = [], []
    for stream in streams:
        arrived = arrivals.get(stream.tag)
        if arrived is None or stream.first is None:
            continue
        before.append(1000 * (arrived - stream.started_at))
        first_chunk = arrived + FIRST_CHUNK_SECONDS
        after.append(1000 * (stream.started_at + stream.first - first_chunk))
    return before, after


if __name__ == "__main__":
    sys.exit(main())
