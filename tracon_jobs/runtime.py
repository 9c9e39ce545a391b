"""The composition root of one process: every service built once from the settings, and
each given only the few services it uses.

Domain code never sees this object; only the entry points do (the Flask app keeps it in
`app.extensions["tracon"]`, the `tracon-jobs` command and `beat_schedules` take it to wire
Celery). Tests build their own, and replace how runs are sent with `send_runs_with`.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from functools import cached_property
from typing import Any

import redis
from celery import Celery

from tracon_jobs import fast_paths
from tracon_jobs.agents.tools import ToolRegistry
from tracon_jobs.agents.tools import registry as default_tools
from tracon_jobs.coordination.cancellation import RedisCancelBus
from tracon_jobs.coordination.event_feed import EventFeed, RedisEventFeed
from tracon_jobs.coordination.fair_share import RedisFairStore
from tracon_jobs.coordination.held import HeldRuns, Holders
from tracon_jobs.coordination.leases import RedisLeaseStore, Singleton
from tracon_jobs.coordination.live_text import LiveText, RedisLiveText
from tracon_jobs.db import Database
from tracon_jobs.errors import ConfigurationError, ToolRegistrationError
from tracon_jobs.integrations.links import ApprovalLinks, approval_links, payload_links
from tracon_jobs.integrations.slack import SlackApprovals, slack_approvals, slack_requests
from tracon_jobs.integrations.slack_requests import SlackRequests
from tracon_jobs.limits.budget_store import RedisBudgetStore
from tracon_jobs.limits.quota_store import RedisQuotaStore
from tracon_jobs.limits.tenant_quotas import Quotas
from tracon_jobs.limits.tenant_runs import RedisTenantRunStore, TenantRuns
from tracon_jobs.providers.registry import ProviderRegistry
from tracon_jobs.redis_clients import CoordinationClient, coordination_client, redis_client
from tracon_jobs.resilience.breaker import BreakerPolicy, CircuitBreaker, RedisBreakerStore
from tracon_jobs.resilience.cache import RedisResponseCache
from tracon_jobs.resilience.concurrency import RedisSlotStore, Slots
from tracon_jobs.resilience.rate_limits import RateLimits, RedisRateStore, limits_of
from tracon_jobs.resilience.views import circuits_view
from tracon_jobs.runs.approvals import Approvals, ApprovalStore
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.continuation import Continuations
from tracon_jobs.runs.dispatch import FairShare, RunDispatcher, Sender
from tracon_jobs.runs.executor import Resilience, RunExecutor
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.live import LiveRuns
from tracon_jobs.runs.parking import Resumer
from tracon_jobs.runs.reconcile import Reconciler
from tracon_jobs.runs.retention import RunRetention
from tracon_jobs.runs.retries import Sleep
from tracon_jobs.runs.store import RunStore
from tracon_jobs.runs.subagents import CHILD_CLAIM_WAIT, SubAgents
from tracon_jobs.schedules.definition import ScheduleTargets
from tracon_jobs.schedules.firing import FiringPolicy, ScheduleFiring
from tracon_jobs.schedules.store import ScheduleStore
from tracon_jobs.settings import Settings
from tracon_jobs.tenants import TenantStore
from tracon_jobs.webhooks.addresses import Destinations
from tracon_jobs.webhooks.circuits import CIRCUIT_EVENTS, CircuitEvents, transitions_key
from tracon_jobs.webhooks.deliverer import (
    Attempts,
    Deliverer,
    OperatorEndpoint,
    operator_endpoint,
)
from tracon_jobs.webhooks.deliveries import DeliveryStore, Targets
from tracon_jobs.webhooks.outbox import QuotaNotices, WebhookOutbox
from tracon_jobs.webhooks.sender import Sender as WebhookSender
from tracon_jobs.webhooks.subscriptions import RedisSubscriptions, Subscriptions, configured
from tracon_jobs.worker.app import CONTROL_QUEUE, Describe, create_celery, describe_runs
from tracon_jobs.worker.brokers import is_coordination_redis
from tracon_jobs.worker.capacity import WorkerCapacity, start_with_worker
from tracon_jobs.worker.drain import WorkerDrain
from tracon_jobs.worker.envelope import RUNS_QUEUE, celery_message, celery_sender
from tracon_jobs.worker.held import follow_held_runs
from tracon_jobs.workflows.registry import WorkflowRegistry
from tracon_jobs.workflows.registry import registry as default_workflows
from tracon_jobs.workflows.resume import WorkflowResumes
from tracon_jobs.workflows.runner import WorkflowRunner
from tracon_jobs.workflows.store import WorkflowStore

log = logging.getLogger(__name__)

REDIS_CONNECTIONS_SPARE = 256
"""Connections a process's Redis pool may open beyond two per worker thread (request
threads, listeners, the flusher, the stream hub's readers)."""

DELIVERY_CLAIM_MARGIN = timedelta(seconds=5)
"""A webhook delivery's claim lasts twice `Webhooks.Timeout` and this: beyond any attempt."""


class Runtime:
    """Builds and wires the services of one process; holds no logic of its own."""

    def __init__(
        self,
        settings: Settings,
        *,
        feed: EventFeed | None = None,
        live_text: LiveText | None = None,
        tools: ToolRegistry | None = None,
        sender: Sender | None = None,
        sleep: Sleep | None = None,
        workflows: WorkflowRegistry | None = None,
        child_claim_wait: float = CHILD_CLAIM_WAIT,
        subscriptions: Subscriptions | None = None,
    ) -> None:
        self.settings = settings
        self.db = Database(
            settings.database.url,
            max_connections=settings.database.max_connections,
            prepared_statements=settings.database.prepared_statements,
            outage_retry_seconds=settings.database.outage_retry.total_seconds(),
        )
        # The one server, or a Sentinel group's current master (`redis_clients`: one quick
        # retry, not redis-py's default backoff). The pool holds a connection per busy thread
        # (each run's, the live text's flusher, the listeners, a web process's request
        # threads): redis-py's default cap of 100 would refuse a call ("Too many
        # connections") at a hundred runs in flight.
        self.redis = redis_client(
            settings.redis,
            max_connections=REDIS_CONNECTIONS_SPARE + 2 * settings.worker.threads,
        )
        self.feed = feed or RedisEventFeed(self.redis)
        self.tenants = TenantStore(self.db)
        # webhooks: who wants which events (read lazily, then kept fresh by a thread), and
        # the messages the run store writes with their events
        self.subscriptions = subscriptions or RedisSubscriptions(
            self.db,
            self.redis,
            configured(settings),
            poll_seconds=settings.webhooks.poll_interval.total_seconds(),
        )
        self.outbox = WebhookOutbox(
            self.db,
            self.redis,
            self.subscriptions,
            QuotaNotices(
                self.quotas,
                self.tenants,
                settings.tenants.max_concurrent_runs,
                settings.pricing.currency,
            ),
        )
        self.runs = RunStore(self.db, self.feed, self.outbox)
        self.live_text = live_text or RedisLiveText(self.redis)  # streaming answers' text
        self.providers = ProviderRegistry(settings.providers)
        self.tools = tools or default_tools
        self.owner_id = settings.singleton_execution.resolved_owner_id()
        self.draining = threading.Event()  # set once a graceful stop began
        self.sleep = sleep  # tool retry backoff; tests pass one that does not wait
        self.dispatcher = RunDispatcher(
            self.runs, sender or self._send_with_celery, self._fair_share(sender is None)
        )
        self.workflow_registry = workflows or default_workflows
        self.child_claim_wait = child_claim_wait  # see `runs.subagents`; tests shorten it
        import_tool_modules(settings.tool_modules)
        import_modules("WorkflowModules", settings.workflow_modules)
        check_agent_tools(settings, self.tools)
        check_workflow_settings(settings)
        # one-time approval links: their key is read (and a short one refused) at startup
        self.approval_links: ApprovalLinks | None = approval_links(
            settings.integrations.approval_links, os.environ
        )
        # the operator's webhook endpoint: its URL, events and secret checked at startup
        self.operator_endpoint: OperatorEndpoint | None = operator_endpoint(
            settings.webhooks, os.environ
        )

    @cached_property
    def coordination(self) -> CoordinationClient:
        """The client of the coordination state: the Redis Cluster of `Redis:ClusterUrl`
        (built, and so connected, when first asked for), else `self.redis` itself.

        On it: circuits, slots, rate windows, budgets, quotas, tenants' running places, stream
        places, leases, the response cache and the circuits' moves. On `self.redis` always:
        the broker, the fair lines, the held runs' records and everything that publishes or
        subscribes (docs/reliability.md, "Redis Cluster"). A cluster's pools are per node:
        each gets the cap of `self.redis`'s one pool."""
        cluster = coordination_client(
            self.settings.redis,
            max_connections=REDIS_CONNECTIONS_SPARE + 2 * self.settings.worker.threads,
        )
        return self.redis if cluster is None else cluster

    def send_runs_with(self, sender: Sender) -> None:
        """Send run messages through `sender` instead of Celery (tests run them in threads)."""
        self.dispatcher.send = sender
        self.dispatcher.fair = self._fair_share(celery=False)

    @cached_property
    def fair_store(self) -> RedisFairStore:
        """The fair lines; with the envelope fast path they push runs' messages themselves."""
        return self._fair_store(celery=True)

    @cached_property
    def pushes_runs(self) -> bool:
        """Whether runs' messages are pushed to the broker's Redis list by this process (the
        `envelope` fast path): only where the broker is `Redis:Url` itself. On RabbitMQ, or
        a Redis of the messages' own, every message goes through Celery's `send_task`."""
        return fast_paths.enabled("envelope") and is_coordination_redis(self.settings)

    def _fair_store(self, celery: bool) -> RedisFairStore:
        lost_ms = _ms(self.settings.runs.requeue_after)
        pushes = celery and self.pushes_runs
        return RedisFairStore(self.redis, lost_ms, queue=RUNS_QUEUE if pushes else None)

    def _fair_share(self, celery: bool) -> FairShare:
        if not celery:  # runs sent by a sender of the caller's: the lines push nothing
            return FairShare(self._fair_store(celery=False))
        return FairShare(self.fair_store, self._message if self.pushes_runs else None)

    def _message(self, run_id: str) -> str:
        return self._celery_message(run_id)

    @cached_property
    def _celery_message(self) -> Callable[[str], str]:  # the Celery app only once asked
        return celery_message(self.celery, labels=self._labels_of)

    def _send_with_celery(self, run_id: str) -> None:
        self._celery_send(run_id)

    @cached_property
    def _celery_send(self) -> Sender:
        client = self.redis if self.pushes_runs else None  # else Celery's `send_task`
        return celery_sender(self.celery, labels=self._labels_of, client=client)

    def _labels_of(self, run_id: str) -> tuple[str, str] | None:
        """(agent, tenant name) a run's message shows in Flower: from the submission this
        process is making (no read), else from the row (a re-send, a child, a continuation)."""
        submitting = self.dispatcher.submitting(run_id)
        if submitting is not None:
            agent, tenant_id = submitting
            return agent, self.tenants.name_of(tenant_id) or tenant_id
        summary = self._describe(run_id)
        return None if summary is None else (summary.agent, summary.tenant)

    @cached_property
    def _describe(self) -> Describe:
        return describe_runs(self.db)

    @cached_property
    def celery(self) -> Celery:
        """The Celery app, with the run task; `beat_schedules.install` adds the periodic ones."""
        app = create_celery(
            self.settings,
            self.executor.execute,
            describe=self._describe,
            draining=self.draining,
        )
        queues = [RUNS_QUEUE, CONTROL_QUEUE]
        WorkerDrain(app, self.settings.drain, self.draining, self.live_runs, queues).install()
        self.capacity(app).install()
        held = HeldRuns(self.redis, self.worker_id, healthy=self.db.check)
        follow_held_runs(app, held)
        start_with_worker(app, self.deliverer.start)
        return app

    @cached_property
    def worker_id(self) -> str:
        """This process, as a worker: in the fair lines and in the held runs' records."""
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    @cached_property
    def holders(self) -> Holders:
        """Every worker's held runs, for the requeue pass."""
        return Holders(self.redis)

    def capacity(self, app: Celery) -> WorkerCapacity:
        """This worker's slots in the fair lines, registered once it is ready."""
        return WorkerCapacity(
            app,
            self.fair_store,
            self.worker_id,
            self.settings.worker.concurrency,
            self.tenants.weights,
            self.dispatcher.send_all,
            self.draining,
            reserve=self.settings.worker.fair_reserve,
            running=lambda: self.live_runs.snapshot().keys(),
        )

    @cached_property
    def breaker(self) -> CircuitBreaker:
        config = self.settings.circuit_breaker
        policy = BreakerPolicy(
            threshold=config.failure_threshold,
            break_ms=_ms(config.break_duration),
            max_probes=config.half_open_max_probes,
            probe_lease_ms=_ms(config.probe_lease),
        )
        moves = self.circuit_events
        return CircuitBreaker(
            RedisBreakerStore(self.coordination, transitions=transitions_key if moves else None),
            policy,
            enabled=config.enabled,
            on_store_unavailable=config.on_store_unavailable,
            on_transition=moves.soon if moves else None,
        )

    @cached_property
    def circuit_events(self) -> CircuitEvents | None:
        """The circuits' moves into the outbox, when the operator's endpoint wants them: the
        breaker's script records each move, and this process moves them (started at once)."""
        if not configured(self.settings) & CIRCUIT_EVENTS:
            return None
        moves = CircuitEvents(
            self.coordination,
            self.db,
            self.subscriptions,
            lambda provider: circuits_view(self.breaker, self.slots, [provider], self.rate_limits)[
                0
            ],
            wake=self.outbox.wake,
            providers=self.settings.providers,
            poll_seconds=self.settings.webhooks.poll_interval.total_seconds(),
        )
        moves.start()
        return moves

    @cached_property
    def webhook_deliveries(self) -> DeliveryStore:
        """The outbox's fan-out, the deliveries' claims and their outcomes, in SQL."""
        config = self.settings.webhooks
        operator = config.operator
        targets = Targets(
            frozenset(operator.events) if operator is not None else frozenset(),
            slack=self.settings.integrations.slack is not None,
        )
        return DeliveryStore(
            self.db,
            targets,
            config.backoff,
            config.disable_after,
            claim_for=2 * config.timeout + DELIVERY_CLAIM_MARGIN,
            links=payload_links(self.approval_links),
        )

    @cached_property
    def webhook_sender(self) -> WebhookSender:
        """Webhook attempts: destinations checked after DNS at each, one deadline each."""
        config = self.settings.webhooks
        return WebhookSender(
            Destinations(config.allow_http, config.allow_private_networks),
            config.timeout.total_seconds(),
            config.max_response_bytes,
        )

    @cached_property
    def deliverer(self) -> Deliverer:
        """A worker's webhook deliverer (started once the worker is ready)."""
        config = self.settings.webhooks
        return Deliverer(
            self.webhook_deliveries,
            Attempts(self.webhook_sender, self.operator_endpoint, self.slack),
            self.redis,
            self.subscriptions,
            concurrency=config.concurrency,
            poll_seconds=config.poll_interval.total_seconds(),
            draining=self.draining,
        )

    @cached_property
    def slots(self) -> Slots:
        config = self.settings.model_concurrency
        return Slots(
            RedisSlotStore(self.coordination),
            config.max_concurrent_calls_per_provider,
            _ms(config.slot_lease),
        )

    @cached_property
    def rate_limits(self) -> RateLimits:
        return RateLimits(RedisRateStore(self.coordination), limits_of(self.settings.providers))

    @cached_property
    def budgets(self) -> RedisBudgetStore:
        return RedisBudgetStore(self.coordination)

    @cached_property
    def quotas(self) -> Quotas:
        """Tenants' cost quotas: limits in SQL, counters in Redis."""
        return Quotas(
            self.settings.tenants.default_quota,
            RedisQuotaStore(self.coordination),
            self.db,
            self.settings.pricing.currency,
        )

    @cached_property
    def cancel_bus(self) -> RedisCancelBus:
        return RedisCancelBus(self.redis)

    @cached_property
    def live_runs(self) -> LiveRuns:
        """Heartbeats (when reconciliation is on) and cancel delivery for executing runs."""
        config = self.settings.run_reconciliation
        heartbeat = config.heartbeat_interval if config.enabled else None
        poll = min(1.0, heartbeat.total_seconds()) if heartbeat else 1.0
        return LiveRuns(self.runs, self.cancel_bus, heartbeat, poll_seconds=poll)

    @cached_property
    def leases(self) -> Singleton:
        """The elector of this process's periodic services (no thread until first asked)."""
        config = self.settings.singleton_execution
        return Singleton(
            RedisLeaseStore(self.coordination),
            config.resolved_owner_id(),
            _ms(config.lease_duration),
            enabled=config.enabled,
        )

    @cached_property
    def executor(self) -> RunExecutor:
        return RunExecutor(
            self.settings,
            self.runs,
            self.db,
            self.tools,
            self.providers,
            Resilience(self.breaker, self.slots, self.budgets, self.quotas, self.rate_limits),
            self.live_runs,
            self.subagents,
            self.approval_store,
            workflows=self.workflow_runner,
            owner_id=self.owner_id,
            draining=self.draining,
            cache=RedisResponseCache(self.coordination),
            sleep=self.sleep,
            live_text=self.live_text,
            resume_later=self.resumer.at,
            dispatcher=self.dispatcher,
            child_ended=lambda run: self.workflow_resumes.child_ended(run),
            tenant_runs=TenantRuns(
                RedisTenantRunStore(self.coordination), self.settings.tenants.max_concurrent_runs
            ),
        )

    @cached_property
    def resumer(self) -> Resumer:
        """Sends this process's parked runs again when they may go on."""
        return Resumer(self.runs, self.dispatcher)

    @cached_property
    def approval_store(self) -> ApprovalStore:
        return ApprovalStore(self.runs, self.settings.approvals.timeout)

    @cached_property
    def approvals(self) -> Approvals:
        """Decisions and expiry, with their effects on runs and budgets."""
        return Approvals(self.approval_store, self.dispatcher, self.budgets)

    @cached_property
    def slack(self) -> SlackApprovals | None:
        """The Slack app's approval messages (the webhook deliverer's `slack` sink, and the
        web's updates after a click); None without `Integrations.Slack`."""
        return slack_approvals(
            self.settings.integrations.slack,
            os.environ,
            self.db,
            RedisLeaseStore(self.coordination),
            timeout=self.settings.webhooks.timeout.total_seconds(),
        )

    @cached_property
    def slack_requests(self) -> SlackRequests | None:
        """The checks of Slack's signed requests (signature, age, replay)."""
        return slack_requests(
            self.settings.integrations.slack, os.environ, RedisLeaseStore(self.coordination)
        )

    @cached_property
    def subagents(self) -> SubAgents:
        return SubAgents(
            self.runs,
            self.feed,
            self.dispatcher,
            self.cancel_bus,
            self.approval_store,
            claim_wait=self.child_claim_wait,
        )

    @cached_property
    def workflow_store(self) -> WorkflowStore:
        return WorkflowStore(self.runs)

    @cached_property
    def workflow_runner(self) -> WorkflowRunner:
        return WorkflowRunner(
            self.settings,
            self.runs,
            self.workflow_store,
            self.workflow_registry,
            self.budgets,
            self.subagents,
            lambda run_id: self.executor.execute(run_id),
            quotas=self.quotas,
            event_waited=lambda run_id: self.workflow_resumes.give_kept_event(run_id),
            fanout_waited=lambda run_id: self.workflow_resumes.answer_fanout(run_id),
            ending=lambda run_id: self.executor.end_with_final_write(run_id),
        )

    @cached_property
    def workflow_resumes(self) -> WorkflowResumes:
        """Answers, operator resumes and job recoveries of workflow runs."""
        return WorkflowResumes(
            self.settings,
            self.workflow_store,
            self.dispatcher,
            self.workflow_registry,
            cancel=lambda run: self.subagents.cancel(run.id),
        )

    @cached_property
    def continuations(self) -> Continuations:
        return Continuations(self.settings, self.runs, self.db, self.tools, self.dispatcher)

    @cached_property
    def reconciler(self) -> Reconciler:
        config = self.settings.run_reconciliation
        return Reconciler(config, self.runs, self.continuations, self.workflow_resumes)

    @cached_property
    def run_retention(self) -> RunRetention:
        """Deletes run groups past `Runs.Retention` (or a tenant's own), archiving them first
        with `Runs.ArchiveDirectory`."""
        config = self.settings.runs
        return RunRetention(
            self.db,
            config.retention,
            batch=config.retention_batch,
            archive_directory=config.archive_directory,
        )

    @cached_property
    def schedules(self) -> ScheduleStore:
        return ScheduleStore(self.db)

    @property
    def schedule_targets(self) -> ScheduleTargets:
        """What a schedule may run here: a configured agent, a registered workflow."""
        return ScheduleTargets(
            agent=lambda name: name in self.settings.agents,
            workflow=self.workflow_registry.knows,
        )

    @cached_property
    def schedule_firing(self) -> ScheduleFiring:
        """Beat's firing pass of the tenants' schedules."""
        config = self.settings.schedules
        return ScheduleFiring(
            self.db,
            self.runs,
            self.dispatcher,
            self.schedule_targets,
            self.cancel_run,
            FiringPolicy(config.max_catch_up, config.misfire_grace, self.settings.pricing.currency),
            workflow_version=self.workflow_registry.version_of,
        )

    def cancel_run(self, run_id: str) -> list[str]:
        """Cancel a live run and its descendants, as `POST /api/runs/{id}/cancel` does."""
        run = self.runs.get(run_id)
        if run is None or RunStatus(run.status).is_terminal:
            return []
        return cancel_tree(
            self.runs, self.cancel_bus, self.approval_store, run, self.dispatcher.done
        )

    def open_connections(self) -> None:
        """As a worker starts: a Redis connection open for each of its threads, so a
        backlog's first runs do not each open theirs at the same moment. Database
        connections are not opened ahead: each counts against the server's
        `max_connections`, and a thread opens one when it first needs one
        (`Database.MaxConnections`; measured with B2, docs/benchmark-history.md)."""
        count = self.settings.worker.threads
        pool = self.redis.connection_pool
        opened: list[Any] = []
        try:
            for _ in range(count):
                connection = pool.get_connection()
                opened.append(connection)
                connection.connect()
        except redis.RedisError as exc:  # the rest connect when needed, as they would
            log.warning("opened %d of %d Redis connections ahead: %s", len(opened), count, exc)
        finally:
            for connection in opened:
                pool.release(connection)
        log.info("opened %d Redis connections ahead", len(opened))

    def read_before_serving(self) -> None:
        """As a worker or a web process starts: the webhook subscriptions read now, outside
        any transaction. Read lazily, the first read came inside the first event write's
        transaction, on a second connection of its thread: with every connection the
        process may open (`Database.MaxConnections`) held by threads in such a first
        write, each would wait for a connection that none of them gives back."""
        self.subscriptions.current()

    def close(self) -> None:
        if "leases" in self.__dict__:
            self.leases.release_all()
        for service in ("live_runs", "cancel_bus", "slots", "resumer"):
            if service in self.__dict__:
                self.__dict__[service].stop()
        self.subscriptions.stop()
        moves = self.__dict__.get("circuit_events")
        if moves is not None:
            moves.stop()
        if "deliverer" in self.__dict__:
            self.deliverer.stop()
        if "webhook_sender" in self.__dict__:
            self.webhook_sender.close()
        executor = self.__dict__.get("executor")
        if executor is not None and executor.text_sender is not None:
            executor.text_sender.close()  # the live text it holds goes out first
        self.providers.close_all()
        self.db.dispose()
        coordination = self.__dict__.get("coordination")
        if coordination is not None and coordination is not self.redis:
            coordination.close()
        self.redis.close()


def import_tool_modules(modules: list[str]) -> None:
    """Import the modules whose `@tool` declarations fill the registry."""
    import_modules("ToolModules", modules)


def import_modules(setting: str, modules: list[str]) -> None:
    """Import the modules a setting lists (their decorators register tools or workflows)."""
    for index, name in enumerate(modules):
        try:
            importlib.import_module(name)
        except ToolRegistrationError as exc:
            raise ConfigurationError(f"{setting}[{index}]", f"'{name}': {exc}") from exc
        except ImportError as exc:
            raise ConfigurationError(
                f"{setting}[{index}]", f"cannot import '{name}': {exc}"
            ) from exc


def check_workflow_settings(settings: Settings) -> None:
    """A setting that would be accepted and do nothing fails at startup instead.

    Interrupted queued workflow runs are found by the orphan scan, so resuming them, or
    giving their jobs more than one attempt, needs `RunReconciliation.Enabled`.
    """
    if settings.run_reconciliation.enabled:
        return
    if settings.workflows.resume_interrupted_runs:
        raise ConfigurationError(
            "Workflows.ResumeInterruptedRuns",
            "requires RunReconciliation.Enabled (interrupted runs are found by its scan)",
        )
    if settings.async_run.max_attempts > 1:
        raise ConfigurationError(
            "AsyncRun.MaxAttempts",
            "more than 1 requires RunReconciliation.Enabled (interrupted runs are found by its "
            "scan)",
        )


def check_agent_tools(settings: Settings, tools: ToolRegistry) -> None:
    """Every tool an agent names must be registered: fail at startup, not at the first run."""
    for agent_name, agent in settings.agents.items():
        for index, tool_name in enumerate(agent.tools):
            if tools.get(tool_name) is None:
                raise ConfigurationError(
                    f"Agents.{agent_name}.Tools[{index}]",
                    f"no tool named '{tool_name}' is registered (check ToolModules)",
                )


def _ms(duration: timedelta) -> int:
    return int(duration.total_seconds() * 1000)
