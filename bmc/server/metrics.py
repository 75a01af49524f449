"""Prometheus metrics under vLLM's names with a `bmc:` prefix (the shapes users' dashboards know): gauges read from
the scheduler at scrape time, counters and latency histograms observed by the HTTP handlers (what a client sees)."""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds; vLLM's buckets, which cover a CPU's slower steps too
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.model_name = model_name
        self.running = Gauge("bmc:num_requests_running", "Requests admitted to the batch (prefilling or decoding)",
                             label, registry=r)
        self.waiting = Gauge("bmc:num_requests_waiting", "Requests waiting to be admitted", label, registry=r)
        self.kv_bytes = Gauge("bmc:kv_cache_usage_bytes", "KV cache bytes held by the running batch and prefills",
                              label, registry=r)
        self.kv_rows = Gauge("bmc:num_kv_rows", "Rows (sequences) in the batch KV cache", label, registry=r)
        self.prompt_tokens = Counter("bmc:prompt_tokens", "Prompt tokens prefilled", label, registry=r)
        self.generation_tokens = Counter("bmc:generation_tokens", "Tokens generated", label, registry=r)
        self.request_success = Counter("bmc:request_success", "Requests finished, by finish reason",
                                       label + ["finished_reason"], registry=r)
        self.ttft = Histogram("bmc:time_to_first_token_seconds", "Time to first token", label,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("bmc:inter_token_latency_seconds", "Time between a sample's tokens", label,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("bmc:e2e_request_latency_seconds", "Request latency, arrival to last token", label,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("bmc:request_queue_time_seconds", "Time waiting before admission", label,
                               buckets=REQUEST_BUCKETS, registry=r)
        self.step = Histogram("bmc:engine_step_seconds", "Scheduler steps: leave/join, one decode step, prefill chunks",
                              label, buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                                              2.0, 5.0), registry=r)
        self.errors = Counter("bmc:request_errors", "Requests that failed, by HTTP status", label + ["status"],
                              registry=r)

    def bind(self, running: Callable[[], float], waiting: Callable[[], float], kv_bytes: Callable[[], float],
             kv_rows: Callable[[], float]) -> None:
        """Gauges read from the scheduler at each scrape."""
        m = self.model_name
        self.running.labels(m).set_function(running)
        self.waiting.labels(m).set_function(waiting)
        self.kv_bytes.labels(m).set_function(kv_bytes)
        self.kv_rows.labels(m).set_function(kv_rows)

    def bind_speculation(self, stats: Callable[[], Any]) -> None:
        """Speculative decoding's counters (vLLM's spec_decode names), read from the scheduler's SpecStats."""
        self.registry.register(_SpecCollector(self.model_name, stats))

    def bind_prefix_cache(self, scheduler: Any) -> None:
        """The prefix cache's counters (vLLM's names: tokens looked up and found), the bytes it holds, the rows that
        read it in place, and the peak of all KV bytes held."""
        self.registry.register(_PrefixCacheCollector(self.model_name, scheduler))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecCollector:
    def __init__(self, model_name: str, stats: Callable[[], Any]) -> None:
        self.model_name, self.stats = model_name, stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self.stats()
        for name, doc, value in (
                ("bmc:spec_decode_num_drafts", "Verify steps (each row's draft tree checked in one forward)",
                 s.verify_steps),
                ("bmc:spec_decode_num_draft_tokens", "Draft tokens verified", s.drafted),
                ("bmc:spec_decode_num_accepted_tokens", "Draft tokens accepted", s.accepted)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class _PrefixCacheCollector:
    def __init__(self, model_name: str, scheduler: Any) -> None:
        self.model_name, self.scheduler, self.cache = model_name, scheduler, scheduler.prefix_cache

    def collect(self) -> Iterator[Any]:
        s = self.cache.stats
        for name, doc, value in (("bmc:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.queries),
                                 ("bmc:prefix_cache_hits", "Prompt tokens found in the prefix cache", s.hits)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        gauge = GaugeMetricFamily("bmc:prefix_cache_usage_bytes", "Bytes of prompt KV the prefix cache holds",
                                  labels=["model_name"])
        gauge.add_metric([self.model_name], self.cache.nbytes)
        yield gauge
        for name, doc, value in (
                ("bmc:prefix_cache_shared_rows", "Batch rows reading a cached prompt prefix in place",
                 self.scheduler.shared_prefix_rows),
                ("bmc:prefix_cache_pinned_bytes", "Bytes of the prefix cache that running requests read in place "
                 "(not evicted; the budget bounds the rest)", self.cache.pinned_bytes),
                ("bmc:kv_cache_peak_bytes", "Most KV bytes held at a step's end: the batch, prefills, the prefix cache",
                 self.scheduler.peak_kv_bytes),
                ("bmc:kv_cache_running_peak_bytes", "Most KV bytes running requests read at a step's end: the batch, "
                 "prefills and the cached paths read in place", self.scheduler.peak_running_kv_bytes)):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
