"""B6: a thousand live followers on one web node, and the node still answers at once.

One `tracon-jobs web` (2 workers x 32 threads, as `make run` and B1 start it) serves
`--followers` SSE streams (`GET /api/runs/{id}/events`, `Accept: text/event-stream`) of
`--runs` running runs while this process appends their events through the run store, as a
worker would (fenced appends, one feed wake-up each). Midway a tenth of the followers drop
their connection and come back with `Last-Event-ID`. Measured in the same run:

- delivery latency: from just before an event's append to its frame's arrival at a
  follower (same clock, same process), every frame of every follower;
- `/healthz` latency, probed every 20 ms from a separate process during the whole test;
- the web node's resident memory (gunicorn's arbiter and its workers), at its peak;
- correctness: every follower received every event of its run, in order, none twice, across
  its reconnect, and every stream ended with the run.

With `--stream` the runs stream: each beat is one model call (`ModelCallStarted`, then
`--deltas-per-second` pieces of text published live with the worker's own `text_send`,
then `ModelCallCompleted` with the whole text), the followers get `ModelTextDelta` frames
too, and their delivery is timed from the send time each piece carries.

See bench/README.md for how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from bench.b1_throughput import choose_redis, issue_api_key, tracon_env
from bench.harness import STARTUP_TIMEOUT, met, percentile, run_benchmark, start_web
from tracon_jobs.cli.supervisor import Supervisor
from tracon_jobs.runs.lifecycle import Claim, RunStatus
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import load_settings

GOAL_DELIVERY_P99_MS = 250.0
GOAL_HEALTHZ_P99_MS = 50.0
GOAL_RSS_MB = 1024.0
PROBE_EVERY = 0.02
MAX_RECONNECTS = 5


@dataclass(frozen=True)
class Options:
    followers: int
    runs: int
    seconds: float
    events_per_second: float
    stream: bool
    deltas_per_second: float
    database: str | None
    redis: str | None
    keep: bool


@dataclass
class Follower:
    run_id: str
    seqs: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    ended: bool = False
    reconnects: int = 0
    problem: str = ""
    connections: int = 0
    delta_latencies: list[float] = field(default_factory=list)
    deltas: int = 0
    texts: dict[int, str] = field(default_factory=dict)  # call seq -> its text, as received
    text_connection: dict[int, int] = field(default_factory=dict)  # call seq -> connection


SentTimes = dict[tuple[str, int], float]
"""(run, seq) -> the time just before that event's append."""
CallTexts = dict[tuple[str, int], str]
"""(run, call seq) -> the text that call streamed."""


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.b6_streams", description=__doc__)
    parser.add_argument("--followers", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long runs emit events")
    parser.add_argument("--events-per-second", type=float, default=1.0, help="per run")
    parser.add_argument(
        "--stream", action="store_true", help="each beat a model call whose text streams"
    )
    parser.add_argument(
        "--deltas-per-second", type=float, default=10.0, help="per run, with --stream"
    )
    parser.add_argument("--database", help="SQLAlchemy URL (default: a fresh SQLite file)")
    parser.add_argument("--redis", help="Redis URL, flushed (default: a private embedded one)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir and logs")
    args = parser.parse_args(argv)
    return Options(
        args.followers,
        args.runs,
        args.seconds,
        args.events_per_second,
        args.stream,
        args.deltas_per_second,
        args.database,
        args.redis,
        args.keep,
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    return run_benchmark("b6", options.keep, lambda *context: benchmark(options, *context))


def benchmark(options: Options, workdir: Path, children: Supervisor, cleanup: ExitStack) -> int:
    redis_url = choose_redis(options.redis, workdir, cleanup)
    database = options.database or f"sqlite:///{workdir / 'tracon.db'}"
    redis.Redis.from_url(redis_url).flushdb()
    config = write_config(workdir, options.followers)
    env = tracon_env(config, database, redis_url)
    api_key = issue_api_key(env)
    base = start_web(children, env, workers=2, threads=32)
    runtime = Runtime(load_settings(config, environ=env))
    cleanup.callback(runtime.close)
    headers = {"Authorization": f"Bearer {api_key}"}
    run_ids = submit_runs(base, headers, options.runs)
    probe = start_probe(base, workdir)
    memory = MemoryWatch(children.children[0].popen.pid)
    memory.start()
    followers = [Follower(run_ids[i % len(run_ids)]) for i in range(options.followers)]
    sent: SentTimes = {}
    texts: CallTexts = {}
    started = time.monotonic()
    asyncio.run(follow_all(base, api_key, followers, options, runtime, run_ids, sent, texts))
    elapsed = time.monotonic() - started
    memory.stop()
    healthz = stop_probe(probe)
    expected = {run_id: [e.seq for e in runtime.runs.events(run_id)] for run_id in run_ids}
    return report(options, database, followers, expected, texts, healthz, memory.peak_mb, elapsed)


def write_config(workdir: Path, followers: int) -> Path:
    config = {
        "Providers": {"scripted": {"Kind": "scripted", "Script": [{"Text": "ok"}]}},
        "Agents": {
            "bench": {
                "Instructions": "benchmark agent",
                "Model": {"Provider": "scripted", "Model": "bench-model"},
                "Tools": [],
            }
        },
        "Web": {"MaxStreamsPerTenant": followers * 2},
    }
    path = workdir / "tracon.json"
    path.write_text(json.dumps({"Tracon": config}, indent=2))
    return path


def submit_runs(base: str, headers: dict[str, str], count: int) -> list[str]:
    """Runs that stay queued (no worker): this process plays their worker."""
    with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
        ids = []
        for _ in range(count):
            response = client.post(
                "/api/agents/bench/run",
                json={"message": "follow me"},
                headers={"Prefer": "respond-async"},
            )
            response.raise_for_status()
            ids.append(response.json()["runId"])
    return ids


# -- followers ---------------------------------------------------------------------------


async def follow_all(
    base: str,
    api_key: str,
    followers: list[Follower],
    options: Options,
    runtime: Runtime,
    run_ids: list[str],
    sent: SentTimes,
    texts: CallTexts,
) -> None:
    host, port = base.removeprefix("http://").split(":")
    connected = asyncio.Event()
    opened = [0]
    dropping = set(random.Random(6).sample(range(len(followers)), len(followers) // 10))
    midway = asyncio.Event()

    async def one(index: int, follower: Follower) -> None:
        await asyncio.sleep(index * 0.002)  # a thousand connects, spread over two seconds
        drop_when = midway if index in dropping else None
        on_open: Callable[[], None] | None = count_open
        while not follower.ended:
            if follower.reconnects > MAX_RECONNECTS:
                follower.problem = "the stream kept closing before the run ended"
                return
            after = follower.seqs[-1] if follower.seqs else 0
            try:
                await stream(host, int(port), api_key, follower, after, sent, drop_when, on_open)
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                follower.problem = f"{type(exc).__name__}: {exc}"
                return
            drop_when = on_open = None
            if not follower.ended:
                follower.reconnects += 1

    def count_open() -> None:
        opened[0] += 1
        if opened[0] == len(followers):
            connected.set()

    tasks = [asyncio.create_task(one(i, f)) for i, f in enumerate(followers)]
    await asyncio.wait_for(connected.wait(), timeout=STARTUP_TIMEOUT)
    target, args = (
        (produce_streams, (runtime, run_ids, options, sent, texts))
        if options.stream
        else (produce, (runtime, run_ids, options, sent))
    )
    producer = threading.Thread(target=target, args=args, name="producer", daemon=True)
    producer.start()
    await asyncio.sleep(options.seconds / 2)
    midway.set()
    while producer.is_alive():
        await asyncio.sleep(0.2)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=STARTUP_TIMEOUT)


async def stream(
    host: str,
    port: int,
    api_key: str,
    follower: Follower,
    after: int,
    sent: dict[tuple[str, int], float],
    drop_when: asyncio.Event | None,
    on_open: Callable[[], None] | None,
) -> None:
    """One connection: read chunked SSE until the stream ends, or until `drop_when`."""
    reader, writer = await asyncio.open_connection(host, port)
    lines = [
        f"GET /api/runs/{follower.run_id}/events HTTP/1.1",
        f"Host: {host}:{port}",
        "Accept: text/event-stream",
        f"Authorization: Bearer {api_key}",
    ]
    if after:
        lines.append(f"Last-Event-ID: {after}")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise ValueError(f"stream refused: {head[:60]!r}")
    if on_open is not None:
        on_open()
    follower.connections += 1
    buffer = b""
    try:
        while True:
            if drop_when is not None and drop_when.is_set():
                return  # the client goes away mid-stream; it comes back with Last-Event-ID
            size_line = await read_line(reader, drop_when)
            if size_line is None:
                return
            size = int(size_line, 16)
            if size == 0:
                follower.ended = True
                return
            chunk = await reader.readexactly(size + 2)
            buffer += chunk[:-2]
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                take(frame, follower, sent)
    finally:
        writer.close()


async def read_line(reader: asyncio.StreamReader, drop_when: asyncio.Event | None) -> bytes | None:
    if drop_when is None:
        return (await reader.readuntil(b"\r\n"))[:-2]
    line = asyncio.ensure_future(reader.readuntil(b"\r\n"))
    dropped = asyncio.ensure_future(drop_when.wait())
    done, _pending = await asyncio.wait({line, dropped}, return_when=asyncio.FIRST_COMPLETED)
    if line in done:
        dropped.cancel()
        return line.result()[:-2]
    line.cancel()
    return None


def take(frame: bytes, follower: Follower, sent: SentTimes) -> None:
    now = time.time()
    for line in frame.split(b"\n"):
        if line.startswith(b"id: "):
            seq = int(line[4:])
            follower.seqs.append(seq)
            at = sent.get((follower.run_id, seq))
            if at is not None:
                follower.latencies.append(now - at)
        elif line == b"event: ModelTextDelta":
            take_delta(frame, follower, now)
            return


def take_delta(frame: bytes, follower: Follower, now: float) -> None:
    """A live text frame: its text joins the call's (afresh on a new connection, which
    starts with the text so far), timed by the send time of its newest piece."""
    data = next(line[6:] for line in frame.split(b"\n") if line.startswith(b"data: "))
    delta = json.loads(data)["data"]
    call, text = int(delta["callSeq"]), str(delta["text"])
    follower.deltas += 1
    if follower.text_connection.get(call) != follower.connections:
        follower.text_connection[call] = follower.connections
        follower.texts[call] = ""
    follower.texts[call] += text
    pieces = text.split()
    if pieces:
        follower.delta_latencies.append(now - float(pieces[-1].partition("@")[2]))


# -- the runs' events, appended as a worker appends them --------------------------------------


def produce(runtime: Runtime, run_ids: list[str], options: Options, sent: SentTimes) -> None:
    """Claim each run, append its events on a steady beat, then finish it. The time each
    event's append starts is recorded under the sequence it will get (this process is the
    run's only writer), so a frame that arrives before `append` returns is timed too."""
    claims, last = claim_all(runtime, run_ids)
    rounds = max(1, int(options.seconds * options.events_per_second))
    interval = 1.0 / options.events_per_second
    start = time.monotonic()
    for round_ in range(rounds):
        for index, run_id in enumerate(run_ids):
            due = start + round_ * interval + interval * index / len(run_ids)
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            last[run_id] += 1
            sent[(run_id, last[run_id])] = time.time()
            event = runtime.runs.append(claims[run_id], "ModelCallCompleted", {"text": "x"})
            if event.seq != last[run_id]:
                raise RuntimeError(f"run {run_id}: seq {event.seq}, {last[run_id]} expected")
    finish_all(runtime, claims, last, sent)


def produce_streams(
    runtime: Runtime, run_ids: list[str], options: Options, sent: SentTimes, texts: CallTexts
) -> None:
    """As `produce`, each beat of a run one model call whose text streams: its
    `ModelCallStarted`, `--deltas-per-second` pieces published as the worker publishes them
    (`LiveText.append`: the `text_send` script), then its `ModelCallCompleted` with the
    whole text, the turn text forgotten. Each piece is `<index>@<time.time() just before its
    append> `, so a follower times every delta frame by the newest piece in it."""
    claims, last = claim_all(runtime, run_ids)
    rounds = max(1, int(options.seconds * options.events_per_second))
    interval = 1.0 / options.events_per_second
    pieces = max(1, round(options.deltas_per_second * interval))
    steps = pieces + 2  # started, the pieces, completed: evenly over the beat
    start = time.monotonic()
    schedule = sorted(
        (start + (round_ + index / len(run_ids) + step / steps) * interval, index, step)
        for round_ in range(rounds)
        for index in range(len(run_ids))
        for step in range(steps)
    )
    calls: dict[str, int] = {}
    for due, index, step in schedule:
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        run_id = run_ids[index]
        if step == 0 or step == steps - 1:
            last[run_id] += 1
            sent[(run_id, last[run_id])] = time.time()
            if step == 0:
                opened = {"turn": last[run_id], "provider": "model", "model": "bench-model"}
                event = runtime.runs.append(claims[run_id], "ModelCallStarted", opened)
                calls[run_id] = event.seq
                texts[(run_id, event.seq)] = ""
            else:
                text = texts[(run_id, calls[run_id])]
                event = runtime.runs.append(claims[run_id], "ModelCallCompleted", {"text": text})
                runtime.live_text.forget(run_id, calls[run_id])
            if event.seq != last[run_id]:
                raise RuntimeError(f"run {run_id}: seq {event.seq}, {last[run_id]} expected")
            continue
        piece = f"{step}@{time.time():.6f} "
        runtime.live_text.append(run_id, calls[run_id], piece)
        texts[(run_id, calls[run_id])] += piece
    finish_all(runtime, claims, last, sent)


def claim_all(runtime: Runtime, run_ids: list[str]) -> tuple[dict[str, Claim], dict[str, int]]:
    """Every run claimed by this process: the claims, and each run's last seq."""
    claims: dict[str, Claim] = {}
    last: dict[str, int] = {}
    for run_id in run_ids:
        claimed = runtime.runs.claim_and_load(run_id, "b6-producer")
        if claimed is None:
            raise RuntimeError(f"run {run_id} could not be claimed")
        claims[run_id], run = claimed
        last[run_id] = run.event_seq
    return claims, last


def finish_all(
    runtime: Runtime, claims: dict[str, Claim], last: dict[str, int], sent: SentTimes
) -> None:
    for run_id, claim in claims.items():
        last[run_id] += 1
        sent[(run_id, last[run_id])] = time.time()
        runtime.runs.finish(claim, RunStatus.COMPLETED, output={"text": "ok"})


# -- the web node while it streams -------------------------------------------------------------

PROBE = """
import sys, time, httpx
url, every, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
samples = []
with httpx.Client(timeout=10) as client:
    try:
        while True:
            started = time.perf_counter()
            status = client.get(url).status_code
            samples.append((time.perf_counter() - started) * 1000 if status == 200 else -1.0)
            time.sleep(every)
    except KeyboardInterrupt:
        pass
open(out, "w").write("\\n".join(map(str, samples)))
"""


@dataclass
class Probe:
    popen: subprocess.Popen[bytes]
    out: Path


def start_probe(base: str, workdir: Path) -> Probe:
    out = workdir / "healthz.txt"
    argv = [sys.executable, "-c", PROBE, f"{base}/healthz", str(PROBE_EVERY), str(out)]
    return Probe(subprocess.Popen(argv), out)


def stop_probe(probe: Probe) -> list[float]:
    probe.popen.send_signal(2)
    probe.popen.wait(timeout=30)
    return [float(line) for line in probe.out.read_text().split()]


class MemoryWatch(threading.Thread):
    """The peak resident memory of a process and its children, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_mb = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            total = sum(rss_kb(pid) for pid in [self.pid, *children_of(self.pid)])
            self.peak_mb = max(self.peak_mb, total / 1024)

    def stop(self) -> None:
        self.done.set()
        self.join()


def children_of(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry))
    return found


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# -- report ------------------------------------------------------------------------------------


def report(
    options: Options,
    database: str,
    followers: list[Follower],
    expected: dict[str, list[int]],
    texts: CallTexts,
    healthz: list[float],
    peak_mb: float,
    elapsed: float,
) -> int:
    wrong = [f for f in followers if f.problem or not f.ended or f.seqs != expected[f.run_id]]
    wrong_text = [f for f in followers if not text_in_order(f, texts)]
    latencies = [1000 * value for f in followers for value in f.latencies]
    answered = [value for value in healthz if value >= 0]
    delivery_p99 = percentile(latencies, 0.99)
    healthz_p99 = percentile(answered, 0.99)
    resumed = sum(1 for f in followers if f.reconnects)
    frames = sum(len(f.seqs) for f in followers)
    kind = "PostgreSQL" if database.startswith("postgresql") else "SQLite"
    print(f"B6: {len(followers)} live followers of {options.runs} runs on one web node ({kind})")
    print(f"  {frames} frames in {elapsed:.1f} s; {resumed} followers dropped and resumed")
    print(
        f"  delivery latency   p50 {percentile(latencies, 0.5):7.1f} ms   p99 "
        f"{delivery_p99:7.1f} ms   max {max(latencies, default=0):7.1f} ms   "
        f"(goal p99 < {GOAL_DELIVERY_P99_MS:.0f} ms: {met(delivery_p99 < GOAL_DELIVERY_P99_MS)})"
    )
    delta_p99 = text_lines(followers, texts) if options.stream else float("nan")
    print(
        f"  /healthz           p50 {percentile(answered, 0.5):7.1f} ms   p99 "
        f"{healthz_p99:7.1f} ms   {len(answered)} answers, {len(healthz) - len(answered)} not 200"
        f"   (goal p99 < {GOAL_HEALTHZ_P99_MS:.0f} ms: {met(healthz_p99 < GOAL_HEALTHZ_P99_MS)})"
    )
    print(
        f"  web RSS peak       {peak_mb:7.1f} MB   (goal < {GOAL_RSS_MB:.0f} MB: "
        f"{met(peak_mb < GOAL_RSS_MB)})"
    )
    print(
        f"  every event to every follower, in order, across resumes: "
        f"{'yes' if not wrong else f'NO, {len(wrong)} followers'}"
    )
    if options.stream:
        whole = sum(
            f.texts.get(call) == text
            for f in followers
            for (run, call), text in texts.items()
            if run == f.run_id
        )
        calls = sum(1 for f in followers for run, _ in texts if run == f.run_id)
        print(
            f"  every delta in order, none twice (a call's text always a prefix of its answer): "
            f"{'yes' if not wrong_text else f'NO, {len(wrong_text)} followers'}; "
            f"calls whose whole text came as deltas: {whole} of {calls}"
        )
    for follower in wrong_text[:5]:
        print(f"    FAILED text of run {follower.run_id}: {follower.texts}", file=sys.stderr)
    for follower in wrong[:5]:
        want = expected[follower.run_id]
        print(
            f"    FAILED run {follower.run_id}: got {len(follower.seqs)} of {len(want)} "
            f"ended={follower.ended} {follower.problem}",
            file=sys.stderr,
        )
    deltas = f" delta_p99_ms={delta_p99:.1f}" if options.stream else ""
    ok = not wrong and not wrong_text
    print(
        f"SUMMARY B6 delivery_p99_ms={delivery_p99:.1f}{deltas} healthz_p99_ms={healthz_p99:.1f} "
        f"rss_mb={peak_mb:.0f} ok={ok}"
    )
    return 0 if ok and len(answered) == len(healthz) else 1


def text_lines(followers: list[Follower], texts: CallTexts) -> float:
    """Print the live text's delivery; its p99 in ms."""
    latencies = [1000 * value for f in followers for value in f.delta_latencies]
    p99 = percentile(latencies, 0.99)
    frames = sum(f.deltas for f in followers)
    pieces = sum(len(text.split()) for text in texts.values())
    print(
        f"  text deltas        {frames} frames to the followers; {pieces} pieces published, "
        f"{len(texts)} calls"
    )
    print(
        f"  delta delivery     p50 {percentile(latencies, 0.5):7.1f} ms   p99 "
        f"{p99:7.1f} ms   max {max(latencies, default=0):7.1f} ms   "
        f"(goal p99 < {GOAL_DELIVERY_P99_MS:.0f} ms: {met(p99 < GOAL_DELIVERY_P99_MS)})"
    )
    return p99


def text_in_order(follower: Follower, texts: CallTexts) -> bool:
    """Each call's text as the follower joined it is a prefix of what the call streamed."""
    return all(
        texts.get((follower.run_id, call), "").startswith(text)
        for call, text in follower.texts.items()
    )


if __name__ == "__main__":
    sys.exit(main())
