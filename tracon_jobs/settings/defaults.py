"""Every default value of tracon-jobs, once, each with the reason it has that value, so that the
section models, code without a settings object and the settings reference all share one source.

Unless a docstring says otherwise, a value is the default the Tracon reliability guide gives; the
docstrings are the descriptions `reference.py` prints in docs/configuration.md.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Final, Literal

# --- CircuitBreaker ------------------------------------------------------------------------

CIRCUIT_BREAKER_ENABLED: Final = True
"""On by default: failing fast on a sick provider is cheaper than queueing calls behind it."""

FAILURE_THRESHOLD: Final = 5
"""Consecutive counted failures that open a provider's circuit; one blip must not open it."""

BREAK_DURATION: Final = timedelta(seconds=30)
"""How long an open circuit rejects calls before a probe may test recovery."""

HALF_OPEN_MAX_PROBES: Final = 1
"""Calls let through at once after the break; one probe is enough to learn the provider's health
without sending a burst to a provider that may still be down (tracon-jobs addition)."""

ON_STORE_UNAVAILABLE: Final[Literal["allow", "reject"]] = "allow"
"""When Redis (the breaker's store) is unreachable, calls go through: losing the breaker must not
take every provider down with it (tracon-jobs addition)."""

# --- Idempotency ---------------------------------------------------------------------------

IDEMPOTENCY_ENABLED: Final = True
"""On here (the reliability guide's default is off): the `Idempotency-Key` header costs nothing when
a request does not send it, and a client that sends it expects it honoured rather than a `501`."""

MAX_IDEMPOTENCY_KEY_LENGTH: Final = 255
"""Longer keys get `400`; bounds the stored key and the index that looks it up."""

# --- SingletonExecution --------------------------------------------------------------------

SINGLETON_EXECUTION_ENABLED: Final = False
"""Off, the reliability guide's default: one process needs no election; a cluster turns it on with
shared state."""

LEASE_DURATION: Final = timedelta(seconds=60)
"""Lease of a periodic service's owner; renewed at a third of it, so two renewals may fail
before another process can take over."""

OWNER_ID: Final = ""
"""Empty means "hostname/pid/random suffix", unique per process without any configuration."""

# --- RunReconciliation ---------------------------------------------------------------------

RUN_RECONCILIATION_ENABLED: Final = False
"""Off, the reliability guide's default: closing runs as `orphaned` is a decision an operator opts
into."""

HEARTBEAT_INTERVAL: Final = timedelta(seconds=30)
"""How often live runs prove they are alive; ten beats fit in the orphan threshold."""

ORPHAN_THRESHOLD: Final = timedelta(minutes=5)
"""Silence after which a `Running` run is closed as `orphaned`; long enough to ride out a
database pause or a deploy handoff."""

SCAN_INTERVAL: Final = timedelta(minutes=1)
"""How often the orphan scan runs; a crash is noticed within threshold plus one interval."""

MAX_RUNS_PER_SCAN: Final = 100
"""Bounds one scan so a mass crash is closed in several short passes, not one long transaction."""

# --- RunContinuation -----------------------------------------------------------------------

RUN_CONTINUATION_ENABLED: Final = False
"""Off, the reliability guide's default: re-running a turn is only safe once tools declare their
side effects."""

MAX_CONTINUATION_ATTEMPTS: Final = 1
"""Continuations per interruption chain; a run that keeps killing its process stops after one."""

# --- Workflows -----------------------------------------------------------------------------

ENABLE_CHECKPOINTING: Final = False
"""Off, the reliability guide's default: checkpoints cost a write per step."""

RESUME_INTERRUPTED_RUNS: Final = False
"""Off, the reliability guide's default: an interrupted workflow step runs again when resumed, which
only the workflow's author can declare safe."""

TIMER_SCAN_INTERVAL: Final = timedelta(seconds=1)
"""How often beat continues the workflows whose timer (`ctx.sleep`) or event wait's timeout is
due; each pass also answers those due before the next tick, each at its time."""

BUFFER_EVENTS: Final = True
"""On: an event delivered to a workflow before it waits for it is kept until `ctx.wait_for` takes
it; off, such a delivery is refused (`409`)."""

MAX_RESUME_ATTEMPTS: Final = 1
"""Continuations of one interrupted workflow chain before its job fails."""

MAX_RESUME_ATTEMPTS_LIMIT: Final = 100
"""Upper bound of `Workflows.MaxResumeAttempts` (the reliability guide's range is 0 to 100)."""

# --- AsyncRun ------------------------------------------------------------------------------

ASYNC_RUN_MAX_ATTEMPTS: Final = 1
"""Attempts of a queued workflow run's job while `Workflows.ResumeInterruptedRuns` is off: an
interrupted attempt with one left starts the workflow again as a new run from its first node,
the last fails `tracon.job.attempts-exhausted`; answers and operator resumes are no attempts.
One, because a second attempt repeats the nodes that already ran. An orphaned agent run's next
attempt is `RunContinuation`'s (its session, its tool ledger, its `MaxAttempts`): one owner."""

# --- AgentGraph ----------------------------------------------------------------------------

MAX_DEPTH: Final = 3
"""Deepest child run of a tree (the root is depth zero); stops runaway agent recursion."""

MAX_TOTAL_TOKENS: Final[int | None] = 200_000
"""Tokens one run tree may spend; on by default so a looping tree has a ceiling."""

MAX_TOTAL_COST: Final[Decimal | None] = None
"""No cost ceiling by default: prices are configuration, and unknown prices cannot be enforced."""

MAX_TOTAL_RUNS: Final[int | None] = 25
"""Child runs one tree may start; bounds fan-out."""

MAX_DURATION: Final[timedelta | None] = None
"""No wall-clock ceiling by default: long legitimate runs must not be cut off silently."""

# --- ModelConcurrency ----------------------------------------------------------------------

MAX_CONCURRENT_CALLS_PER_PROVIDER: Final[int | None] = None
"""Unlimited by default; a limit only helps once it is sized to the provider's own quota."""

SLOT_LEASE: Final = timedelta(seconds=30)
"""How long a crashed holder keeps a concurrency slot; live holders renew every third."""

PROBE_LEASE: Final = timedelta(seconds=60)
"""How long a half-open probe may run before another caller may probe instead."""

# --- Drain ---------------------------------------------------------------------------------

DRAIN_ENABLED: Final = False
"""Off, the reliability guide's default: a stop signal ends the process at once, and reconciliation
recovers."""

DRAIN_TIMEOUT: Final = timedelta(seconds=30)
"""Longest a graceful stop waits for in-flight runs; a stuck run must not block a deploy."""

# --- Agents.<name>.Cache ---------------------------------------------------------------------

RESPONSE_CACHE_ENABLED: Final = False
"""Off: every model call goes to the provider."""

RESPONSE_CACHE_TTL: Final = timedelta(hours=1)
"""How long a cached model response answers an identical request."""

RESPONSE_CACHE_MAX_ENTRIES: Final = 10_000
"""The most responses one agent keeps cached; the oldest go first."""

# --- Approvals -----------------------------------------------------------------------------

APPROVAL_TIMEOUT: Final = timedelta(days=1)
"""How long a person has to decide; past it the call is answered `approval_expired`."""

APPROVAL_EXPIRY_SCAN_INTERVAL: Final = timedelta(seconds=30)
"""How often beat expires overdue approvals (a decision after `expiresAt` is refused anyway)."""

# --- ToolLoop ------------------------------------------------------------------------------

ALLOW_CONCURRENT_TOOL_CALLS: Final = False
"""Tools of one turn run one after another, so a spent budget can stop the next one."""

# --- Retention -----------------------------------------------------------------------------

RETENTION_ENABLED: Final = False
"""Off, the reliability guide's default: deleting records is a decision an operator makes."""

IDEMPOTENCY_RETENTION: Final = timedelta(days=1)
"""Age after which idempotency records are deleted once retention is on; a day covers any
reasonable client retry window."""

# --- Tenants (tracon-jobs additions) -------------------------------------------------------

QUOTA_PERIOD: Final[Literal["day", "month"]] = "day"
"""A quota counts what a tenant spent in the current UTC day, so a runaway day is stopped the
same day; `month` counts the calendar month."""

QUOTA_COST_LIMIT: Final[Decimal | None] = None
"""No quota by default: what a tenant may spend is a business decision, not a default."""

# --- Runs (tracon-jobs additions) ----------------------------------------------------------

REQUEUE_AFTER: Final = timedelta(seconds=60)
"""A `Queued` run nobody claimed for this long, and that no live worker holds, is sent again (a
process can die between writing a run and sending it). A run a killed worker held is sent again
as soon as the worker's liveness ends (10 s), whatever this says
([architecture](architecture.md))."""

BUFFERED_WAIT_TIMEOUT: Final = timedelta(minutes=10)
"""How long a buffered HTTP response waits for its run before answering `202` with `Location`."""

MAX_TURNS: Final = 16
"""Model turns per run; stops a model that keeps calling tools forever."""

PARK_AFTER: Final = timedelta(seconds=5)
"""A model call that would wait longer than this for its provider's rate limits, or that has
waited this long for a concurrency slot, is parked: its run is queued again to go on once it
may (the rate limit has room; the slots' expected wait), and its worker thread is free."""

PARK_ON_OPEN_CIRCUIT: Final = False
"""Whether a run whose every link is refused by an open circuit is parked until the first of
them may take a probe, instead of failing with the first refusal (the spec's fail-fast)."""

CANCEL_ON_DISCONNECT: Final = False
"""Whether a `/v1` streaming answer's run is canceled when its client goes away before the end.
Off by default: the run is durable and its result stays readable at `/api/runs/{id}`."""

RUN_RETENTION: Final[timedelta | None] = None
"""How long a run tree (with the workflow chain it belongs to) is kept once its last run ended;
then beat's `tracon.runs.retention` deletes it with its events, tool-call ledger, checkpoints,
approvals and idempotency records, never while any run of it is live. Null keeps every run
forever: deleting history is a decision an operator makes (`tracon-jobs tenants retention`
sets a tenant's own)."""

RUN_RETENTION_BATCH: Final = 200
"""Run trees deleted in one transaction. A pass deletes batch after batch until nothing is due
or its time is up, so a backlog goes in many short transactions, never one long one."""

RUN_RETENTION_SCAN_INTERVAL: Final = timedelta(minutes=10)
"""How often beat sends `tracon.runs.retention` while some retention is set; a tree goes within
about this much after its retention ends. A pass stops after half of it, to go on at the next."""

SCHEDULES_ENABLED: Final = True
"""On: beat sends `tracon.schedules.fire` and the tenants' schedules fire. Off: nothing fires;
schedules can still be created and changed, and fire again once it is on (their slots in
between are caught up by their own `catchUp` policy)."""

SCHEDULE_SCAN_INTERVAL: Final = timedelta(seconds=1)
"""How often beat sends `tracon.schedules.fire`: a slot fires within about this much of its
time."""

SCHEDULE_MAX_CATCH_UP: Final = 100
"""The most missed slots of one schedule a pass fires under `catchUp: all` (the newest ones;
older ones are recorded `missed`)."""

SCHEDULE_MAX_CATCH_UP_LIMIT: Final = 10_000
"""The largest `Schedules.MaxCatchUp` accepted."""

SCHEDULE_MISFIRE_GRACE: Final = timedelta(minutes=1)
"""How late a slot may be fired and still count as on time; an older slot was missed (beat or
the workers were down) and its schedule's `catchUp` policy decides whether it fires."""

RUN_ARCHIVE_DIRECTORY: Final[str | None] = None
"""Null: a tree past its retention is deleted without a copy. A folder (created if missing;
relative to the worker's working directory): each tree, or chain, is written there first as
`<id of its first run>.jsonl`, the lines `tracon-jobs runs export` prints; nothing is deleted
when the file cannot be written."""

# --- Worker (tracon-jobs additions) --------------------------------------------------------

WORKER_CONCURRENCY: Final = 16
"""Runs a worker executes at once from the fair lines (its slots); its pool has
`Worker.FairReserve` threads more. Runs wait on providers most of the time, so threads are
cheap."""

WORKER_FAIR_RESERVE: Final = 1
"""Threads a worker keeps beyond `Worker.Concurrency` for runs of tenants without a line:
while other tenants' runs wait in their lines, a tenant whose turn it is starts its run on
one at once instead of waiting for a slot to free (fair dispatch, docs/reliability.md).
Lined runs never get them, so a worker runs at most Concurrency + FairReserve runs at once.
0: none (a returning tenant waits for the next slot to free, about one run's time)."""

WORKER_PREFETCH_MULTIPLIER: Final = 1
"""1: on Redis a worker takes a message only for an idle thread, so a busy worker never holds a
run another worker could start (a message is acknowledged as its task starts, which on its own
would let a worker whose threads are all busy take more). 2 or more: Celery's prefetch, that
many messages a thread waiting beside the running ones. On RabbitMQ, Celery's prefetch at any
value: up to that many messages a thread may wait in a busy worker. A killed worker's held
messages go to the others once its liveness ends (Redis) or at once (RabbitMQ)."""

# --- Web (tracon-jobs additions) -----------------------------------------------------------

MAX_REQUEST_BYTES: Final = 1024 * 1024
"""Largest request body the web process reads (chunked bodies included); a larger one gets
`413`. A mebibyte holds any conversation worth sending in one request and bounds the memory one
request can take."""

MAX_STREAMS_PER_TENANT: Final = 100
"""Live event streams one tenant may hold open at once, over all web processes; the next one
gets `429`. A follower costs a socket and a little memory, not a thread, but one tenant must
not be able to take a node's sockets from the others."""

WEB_KEEP_ALIVE: Final = timedelta(seconds=75)
"""How long the web keeps an idle HTTP/1.1 connection open for the client's next request. Longer
than clients and load balancers keep theirs (httpx 5 s, an AWS load balancer 60 s): the side
that closes an idle connection must be the client, or a request it sends just as the server
closes is lost with the connection. An idle connection costs a socket, not a thread."""

# --- Stores and providers (tracon-jobs additions) ------------------------------------------

DATABASE_URL: Final = "sqlite:///var/tracon.db"
"""SQLite in `var/` so a checkout runs with no service; production sets PostgreSQL
(`postgresql://user:password@db1:5432/tracon`, always through psycopg 3). Several hosts, for a
failover: `postgresql://user:password@/tracon?host=db1:5432&host=db2:5432&target_session_attrs=read-write`
(or `?host=db1,db2&port=5432,5432`, or libpq's `postgresql://user:password@db1:5432,db2:5432/tracon`):
each new connection tries the hosts in order and skips one that is down or a standby, so after
a promotion the next connection reaches the new primary
([failover](reliability.md#a-database-that-stops-answering)). Hosts and ports that do not pair
up, or an unknown `target_session_attrs`, fail at startup."""

DATABASE_OUTAGE_RETRY: Final = timedelta(seconds=30)
"""How long an executing run's SQL reads and writes retry a database that stopped answering
(a restart, a failover) before the run gives up; its claim is kept all along."""

DATABASE_MAX_CONNECTIONS: Final = 10
"""The most database connections one process (a web process, a worker, beat, a command) opens;
each is opened when a thread first needs it and kept. A thread that needs one beyond the cap
waits for one (up to 30 s, then fails naming this setting). A run holds a connection only for
the milliseconds of each statement, not while its model answers, so 10 serve a worker's 17
threads (`Worker.Concurrency` and `Worker.FairReserve`). The cluster holds at most
MaxConnections x (web processes + workers + beat + Flower) + commands running, where web
processes = web nodes x `--workers`; PostgreSQL's `max_connections`, or the pooler in front
of it, must cover that ([the budget](operations.md#connections))."""

DATABASE_PREPARED_STATEMENTS: Final = True
"""PostgreSQL: psycopg prepares a statement a connection has run five times (one parse fewer
each time after). `false` behind a pooler in transaction mode that cannot keep prepared
statements (PgBouncer before 1.21, or without `max_prepared_statements`): the next transaction
may run on another server session, where the statement was never prepared.
`?prepare_threshold=none` in `Url` (psycopg's own option) does the same
([PgBouncer](operations.md#pgbouncer))."""

REDIS_URL: Final = "redis://127.0.0.1:6379/0"
"""The local Redis every development setup (and compose) offers."""

REDIS_SENTINEL_MASTER: Final = "mymaster"
"""The name under which the sentinels of a `sentinel://` `Url` monitor the Redis master
(Sentinel's own example name); ignored with a one-server URL."""

REDIS_CLUSTER_URL: Final[str | None] = None
"""Null: the coordination state is on `Url` with everything else. A Redis Cluster's startup
nodes, `redis://host:port,host:port` (`rediss://` for TLS, `user:password@` before the nodes,
database 0 only), put it on the cluster: circuits, concurrency slots, rate-limit windows, tree
budgets, tenant quotas and running places, live-stream places, singleton leases and the
response cache. The broker, the fair lines, the held runs' records and pub/sub stay on `Url`
([Redis Cluster](reliability.md#redis-cluster))."""

BROKER_URL: Final[str | None] = None
"""Null: Celery's messages go through `Redis:Url`, the Redis of the coordination state. For
teams that outgrow Redis as a queue, `amqp://user:password@host:5672/vhost` (or `amqps://`)
puts them on RabbitMQ, in quorum queues with publisher confirms, while the coordination state
stays on Redis ([RabbitMQ as the broker](reliability.md#rabbitmq-as-the-broker)). A Redis URL
other than `Redis:Url` is a Redis of the messages' own (one server; a Sentinel group must be
`Redis:Url`'s)."""

PROVIDER_TIMEOUT_SECONDS: Final = 60.0
"""Per-call timeout of a provider; long enough for a slow completion, short enough that a hung
connection counts as a failure for the breaker."""

SCRIPT_INPUT_TOKENS: Final = 10
"""Input tokens a scripted step reports when it does not say, so budgets and cost see a spend."""

SCRIPT_OUTPUT_TOKENS: Final = 5
"""Output tokens a scripted step reports when it does not say, so budgets and cost see a spend."""

SCRIPT_DELAY_SECONDS: Final = 0.0
"""Scripted steps answer at once unless a test needs a slow provider."""

CURRENCY: Final = "USD"
"""Currency of configured prices; reported amounts in another currency are unknown to budgets."""

CONFIG_FILE: Final = "tracon.json"
"""Configuration file read from the working directory when `TRACON_CONFIG` names none."""

# --- Webhooks and integrations (tracon-jobs additions) -------------------------------------

WEBHOOK_BACKOFF: Final = (
    timedelta(seconds=5),
    timedelta(minutes=5),
    timedelta(minutes=30),
    timedelta(hours=2),
    timedelta(hours=5),
    timedelta(hours=10),
    timedelta(hours=10),
)
"""The waits before each retry of a failed delivery, the Standard Webhooks schedule: eight
attempts over about 28 hours; after the last one the delivery is `failed` (it can be redelivered
by hand)."""

WEBHOOK_DISABLE_AFTER: Final = timedelta(days=5)
"""An endpoint whose every attempt failed for this long is disabled (`webhook.disabled`): a
receiver gone for days should stop costing attempts, and its owner should hear of it."""

WEBHOOK_TIMEOUT: Final = timedelta(seconds=10)
"""One attempt's time to connect, send and read the answer's status; a receiver is expected to
answer at once and do its work later."""

WEBHOOK_ROTATION_GRACE: Final = timedelta(hours=24)
"""How long the previous secret keeps signing beside the new one after a rotation, so that
receivers can move to the new secret without dropping a delivery."""

WEBHOOK_POLL_INTERVAL: Final = timedelta(seconds=1)
"""How often a worker looks for due deliveries when nothing woke it; a new event wakes the
workers at once, so this bounds only retries' lateness and a missed wake-up."""

WEBHOOK_CONCURRENCY: Final = 4
"""Deliveries one worker process sends at once; a slow receiver holds one of them for at most
`Timeout`."""

WEBHOOK_MAX_RESPONSE_BYTES: Final = 2048
"""The start of a receiver's answer kept with each attempt, for the deliveries page; the rest
is never read."""

WEBHOOK_OPERATOR_EVENTS: Final = ("circuit.opened", "circuit.closed", "webhook.disabled")
"""What the operator's endpoint hears by default: the events of the whole installation."""
