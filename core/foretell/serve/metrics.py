"""``GET /metrics``: what the server did and is doing, in Prometheus' text format.

Counters grow from the server's start (requests by route and status, prompt, cached and
generated tokens, prefix-cache hits by tier, drafted and accepted tokens); gauges are read at
scrape time from the scheduler (queue depth, running rows, live KV bytes) and the cache tier;
tokens per second is over the last :data:`RATE_WINDOW_S` seconds; histograms hold each
request's time to first token and its part spent waiting for admission.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from foretell.scheduler import Scheduler
    from foretell.stream import Stats

#: The window tokens per second and the completion rate are measured over.
RATE_WINDOW_S = 10.0
#: Upper bounds (seconds) of the latency histograms' buckets.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """Observations counted into :data:`LATENCY_BUCKETS` (Prometheus' cumulative form when
    rendered), with their sum and count."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*map(repr, LATENCY_BUCKETS), "+Inf"), self.counts):
            total += count
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        return [*out, f"{name}_sum {self.sum!r}", f"{name}_count {total}"]


class Metrics:
    """Counters the routes update and :meth:`render` reports (event-loop thread only, but
    guarded: the scrape may come while a request finishes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cached_tokens: collections.Counter[str] = collections.Counter()
        self.prefix_hits: collections.Counter[str] = collections.Counter()
        self.prefix_misses = 0
        self.drafted = 0
        self.accepted = 0
        self.cancelled_requests = 0
        #: From submission (its wait for a place in the batch included) to the first token.
        self.ttft = Histogram()
        #: From submission to admission.
        self.queued = Histogram()
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._finished: collections.deque[float] = collections.deque()

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def tokens(self, count: int) -> None:
        """``count`` tokens streamed now (for tokens per second)."""
        now = time.monotonic()
        with self._lock:
            self._tokens.append((now, count))
            self._trim(now)

    def cancelled(self) -> None:
        """A request ended before its reply did (its client went away)."""
        with self._lock:
            self.cancelled_requests += 1

    def finished(self, stats: Stats) -> None:
        with self._lock:
            self.prompt_tokens += stats.prompt_tokens
            self.generated_tokens += stats.generated_tokens
            if stats.cached_tokens:
                tier = stats.cached_from or "ram"
                self.prefix_hits[tier] += 1
                self.cached_tokens[tier] += stats.cached_tokens
            else:
                self.prefix_misses += 1
            if stats.speculation:
                self.drafted += int(stats.speculation.get("drafted", 0))
                self.accepted += int(stats.speculation.get("accepted", 0))
            self.ttft.observe(stats.queued_s + stats.ttft_s)
            self.queued.observe(stats.queued_s)
            self._finished.append(time.monotonic())

    def _trim(self, now: float) -> None:
        while self._tokens and self._tokens[0][0] < now - RATE_WINDOW_S:
            self._tokens.popleft()
        while self._finished and self._finished[0] < now - RATE_WINDOW_S:
            self._finished.popleft()

    def tokens_per_second(self) -> float:
        with self._lock:
            self._trim(time.monotonic())
            return sum(n for _, n in self._tokens) / RATE_WINDOW_S

    def retry_after(self, waiting: int) -> int:
        """Seconds until ``waiting`` requests have likely gone through, from the recent
        completion rate (1 to 60)."""
        with self._lock:
            self._trim(time.monotonic())
            rate = len(self._finished) / RATE_WINDOW_S
        if rate <= 0:
            return 5
        return max(1, min(60, math.ceil(waiting / rate)))

    def render(self, scheduler: Scheduler, cache: Any) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str,
                   samples: list[tuple[dict[str, str], float]]) -> None:
            out.append(f"# HELP foretell_{name} {help_text}")
            out.append(f"# TYPE foretell_{name} {kind}")
            for labels, value in samples:
                tags = ",".join(f'{k}="{v}"' for k, v in labels.items())
                text = str(value) if isinstance(value, int) else repr(float(value))
                out.append(f"foretell_{name}{{{tags}}} {text}" if tags
                           else f"foretell_{name} {text}")

        with self._lock:
            requests = sorted(self.requests.items())
            hits, cached = dict(self.prefix_hits), dict(self.cached_tokens)
            counters = (self.prompt_tokens, self.generated_tokens, self.prefix_misses,
                        self.drafted, self.accepted, self.cancelled_requests)
            ttft = self.ttft.lines("foretell_time_to_first_token_seconds")
            queued = self.queued.lines("foretell_request_queue_seconds")
        prompt, generated, misses, drafted, accepted, cancelled = counters
        metric("requests_total", "counter", "HTTP requests by route and status",
               [({"route": r, "status": str(s)}, n) for (r, s), n in requests])
        metric("requests_cancelled_total", "counter",
               "requests cancelled before their reply ended (the client went away)",
               [({}, cancelled)])
        metric("queue_depth", "gauge", "requests submitted and not yet decoding",
               [({}, scheduler.queue_depth)])
        metric("running_requests", "gauge", "requests decoding now", [({}, scheduler.running)])
        metric("live_kv_bytes", "gauge", "KV cache bytes the running requests hold",
               [({}, scheduler.live_kv_bytes())])
        metric("kv_budget_bytes", "gauge", "KV bytes the scheduler admits requests up to",
               [({}, scheduler.kv_budget_bytes)])
        metric("prompt_tokens_total", "counter", "prompt tokens of finished requests",
               [({}, prompt)])
        metric("generation_tokens_total", "counter", "tokens generated by finished requests",
               [({}, generated)])
        metric("generation_tokens_per_second", "gauge",
               f"tokens streamed per second over the last {RATE_WINDOW_S:g} s",
               [({}, self.tokens_per_second())])
        tiers = sorted({"ram", *hits})
        metric("prefix_cache_hits_total", "counter",
               "requests whose prompt started from a cached prefix, by tier",
               [({"tier": t}, hits.get(t, 0)) for t in tiers])
        metric("prefix_cache_misses_total", "counter", "requests computed from their first token",
               [({}, misses)])
        metric("prefix_cache_tokens_total", "counter", "prompt tokens served from the cache, by tier",
               [({"tier": t}, cached.get(t, 0)) for t in tiers])
        metric("draft_tokens_total", "counter", "tokens drafters proposed", [({}, drafted)])
        metric("draft_accepted_tokens_total", "counter", "drafted tokens the model accepted",
               [({}, accepted)])
        metric("time_to_first_token_seconds", "histogram",
               "submission to first token, the wait for admission included", [])
        out += ttft
        metric("request_queue_seconds", "histogram",
               "submission to admission (the wait for a place in the batch)", [])
        out += queued
        if cache is not None:
            stats = cache.stats()
            metric("cache_bytes", "gauge", "bytes the prefix cache holds, by tier",
                   [({"tier": tier}, stats[tier]["bytes"]) for tier in ("ram", "ssd")
                    if tier in stats])
            metric("cache_entries", "gauge", "entries the prefix cache holds, by tier",
                   [({"tier": tier}, stats[tier]["entries"]) for tier in ("ram", "ssd")
                    if tier in stats])
        return "\n".join(out) + "\n"
