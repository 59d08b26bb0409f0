"""``GET /metrics``: the server's numbers in Prometheus' text format (``prometheus_client``).

The HTTP side counts requests by route and status, and each reply when it ends (its
outcome, tokens in and out, time to first token, the time between its tokens, prefix-cache
reuse, the plugin that failed it). The scheduler's state (queue depth, batch occupancy,
steps) is read when scraped, from its public surface only. docs/serving.md lists every metric.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from chatcore.adapters.http_api.completions import Completion
    from chatcore.serving import Scheduler

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/plugins",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
)
# Seconds: from a few milliseconds (chatcore-tiny on a GPU) to minutes (a large model on a busy CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class SchedulerCollector:
    """The scheduler's state at scrape time."""

    def __init__(self, scheduler: "Scheduler") -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator["Metric"]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        scheduler = self.scheduler
        in_flight = scheduler.in_flight()
        yield GaugeMetricFamily("chatcore_queue_depth", "Requests waiting for a batch slot.", len(scheduler.waiting))
        yield GaugeMetricFamily(
            "chatcore_setting_up",
            "Requests waiting for their plugin's setup (a model or head loading).",
            scheduler.setting_up(),
        )
        yield GaugeMetricFamily("chatcore_batch_rows", "Replies being decoded now.", in_flight)
        yield GaugeMetricFamily(
            "chatcore_batch_capacity", "Replies decoded at once at most (--max-batch).", scheduler.max_batch
        )
        yield GaugeMetricFamily(
            "chatcore_batch_occupancy",
            "Replies being decoded over --max-batch (0 to 1).",
            in_flight / scheduler.max_batch,
        )
        yield CounterMetricFamily("chatcore_scheduler_steps", "Batched forward passes so far.", scheduler.steps)


def route_of(path: str) -> str:
    """The route label of a request path: one of ROUTES, or ``other`` (so that unknown paths
    cannot grow the number of series without bound)."""
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class ServeMetrics:
    """Every metric of one server, in a registry of its own (several servers may share a process)."""

    def __init__(self, scheduler: "Scheduler") -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "chatcore_http_requests",
            "HTTP requests answered, by route and status.",
            ["route", "status"],
            registry=registry,
        )
        self.replies = Counter(
            "chatcore_replies",
            "Replies ended, by outcome: stop, length, refused (the request's fault, 400), error (the server's), "
            "cancelled (client gone), "
            "queue-wait (--max-queue-wait), timeout (--request-timeout), shutdown.",
            ["outcome"],
            registry=registry,
        )
        self.prompt_tokens = Counter("chatcore_prompt_tokens", "Prompt tokens of admitted replies.", registry=registry)
        self.completion_tokens = Counter("chatcore_completion_tokens", "Tokens generated.", registry=registry)
        self.prefix_cache_hits = Counter(
            "chatcore_prefix_cache_hits", "Replies whose prompt reused cached key/values.", registry=registry
        )
        self.prefix_cached_tokens = Counter(
            "chatcore_prefix_cached_tokens", "Prompt tokens taken from the prefix cache.", registry=registry
        )
        self.plugin_failures = Counter(
            "chatcore_plugin_failures", "Replies a decoder or steerer failed, by plugin.", ["plugin"], registry=registry
        )
        self.queue_wait = Histogram(
            "chatcore_queue_wait_seconds",
            "Time from submission to a batch slot.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.first_token = Histogram(
            "chatcore_time_to_first_token_seconds",
            "Time from submission to the first token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.per_token = Histogram(
            "chatcore_time_per_output_token_seconds",
            "Time between two tokens of a reply, as the server received them.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        registry.register(SchedulerCollector(scheduler))

    def record_status(self, path: str, status: int) -> None:
        self.requests.labels(route_of(path), str(status)).inc()

    def record_busy(self) -> None:
        """A request refused with 429: the queue was full."""
        self.replies.labels("busy").inc()

    def record_reply(self, completion: "Completion") -> None:
        """Count a reply once it has ended, however it ended."""
        from chatcore.errors import PluginError

        handle = completion.handle
        self.replies.labels(completion.outcome).inc()
        self.completion_tokens.inc(completion.completion_tokens)
        if handle.admitted is not None:
            self.prompt_tokens.inc(completion.prompt_tokens)
            self.queue_wait.observe(handle.admitted - handle.submitted)
            cached = int(handle.provenance.get("prefix_cached_tokens", 0))
            if cached:
                self.prefix_cache_hits.inc()
                self.prefix_cached_tokens.inc(cached)
        if handle.first_token is not None:
            self.first_token.observe(handle.first_token - handle.submitted)
        times = completion.token_times
        for earlier, later in zip(times, times[1:]):
            self.per_token.observe(later - earlier)
        if isinstance(completion.failure, PluginError):
            self.plugin_failures.labels(completion.failure.plugin).inc()

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class CountingRequests:
    """ASGI middleware: count each HTTP response by route and status when it starts."""

    def __init__(self, app: Any, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.record_status(scope["path"], int(message["status"]))
            await send(message)

        await self.app(scope, receive, sending)
