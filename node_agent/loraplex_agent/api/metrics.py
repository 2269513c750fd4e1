"""Prometheus metrics under vLLM's names, so routers and dashboards built for vLLM read us unchanged.

Engine-wide values (queue lengths, KV usage, token counters, adapter residency) are read from the
engine's latest snapshot when Prometheus scrapes. Per-request values (latencies, finish reasons)
are observed by the server as each request streams. Every series carries `model_name` = the served
base model, as in vLLM; our own `loraplex:` series add an `adapter` label where it helps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.engine.memory.stats import MemoryStats
from loraplex.engine.scheduling.stats import SchedulerStats
from loraplex_agent.runtime.async_engine import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BASE_MODEL_LABEL = ""  # the `adapter` label of requests served by the base model alone

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so the same PromQL quantiles apply.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot], max_loras: int,
                 block_size: int, drain_load_seconds: Callable[[], list[float]] = list) -> None:
        disable_created_metrics()  # no `*_created` series, as in vLLM (a process-wide switch)
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=reg)
        self.adapter_success = Counter(
            "loraplex:request_success", "Finished requests by adapter ('' = base model) and finish reason.",
            ["model_name", "adapter", "finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token.",
                              labels, buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two output tokens.",
                             labels, buckets=ITL_BUCKETS, registry=reg)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Time between two output tokens (deprecated alias of inter_token_latency).",
                              labels, buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             labels, buckets=REQUEST_LATENCY_BUCKETS, registry=reg)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled.",
                                    labels, buckets=REQUEST_LATENCY_BUCKETS, registry=reg)
        self.adapter_load = Histogram("vllm:lora_adapter_load_seconds", "Adapter copies host -> device, from "
                                      "the step that started one to the weights on the device.",
                                      labels, buckets=LOAD_BUCKETS, registry=reg)
        self.drain_load_seconds = drain_load_seconds
        reg.register(EngineCollector(model_name, snapshot, max_loras, block_size))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)
        self.tpot.labels(self.model_name).observe(seconds)

    def observe_finished(self, reason: str, adapter: str | None, e2e_seconds: float,
                         queue_seconds: float | None) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.adapter_success.labels(self.model_name, adapter or BASE_MODEL_LABEL, reason).inc()
        self.e2e.labels(self.model_name).observe(e2e_seconds)
        if queue_seconds is not None:
            self.queue_time.labels(self.model_name).observe(queue_seconds)

    def render(self) -> bytes:
        for seconds in self.drain_load_seconds():
            self.adapter_load.labels(self.model_name).observe(seconds)
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Engine state at scrape time, from the snapshot the engine thread publishes each step."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot], max_loras: int,
                 block_size: int) -> None:
        self.model_name = model_name
        self.snapshot = snapshot
        self.max_loras = max_loras
        self.block_size = block_size

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        stats = snap.stats
        model = [self.model_name]
        yield _gauge("vllm:num_requests_running", "Requests in the running batch.", model, stats.num_running)
        yield _gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", model, stats.num_waiting)
        yield _gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", model,
                     stats.kv_usage)
        yield _gauge("vllm:gpu_cache_usage_perc", "Deprecated alias of vllm:kv_cache_usage_perc.", model,
                     stats.kv_usage)
        yield _counter("vllm:prompt_tokens", "Prompt tokens processed.", model, stats.prompt_tokens_total)
        yield _counter("vllm:generation_tokens", "Tokens generated.", model, stats.generation_tokens_total)
        yield _counter("vllm:num_preemptions", "Requests preempted (recomputed later).", model,
                       stats.num_preemptions)
        yield _counter("loraplex:adapter_loads", "Adapter copies into a device slot.", model,
                       stats.adapter_loads_total)
        yield _gauge("loraplex:resident_adapters", "Adapters resident in device slots.", model,
                     len(snap.resident_adapters))
        yield _counter("loraplex:engine_thread_cpu_seconds", "CPU time (user + system) of the engine thread: its "
                       "steps and the commands between them; the rest of the process's CPU is serving (HTTP, "
                       "templates, tokenizing, streaming).", model, snap.engine_cpu_s)
        yield self._lora_requests_info(snap)
        yield self._cache_config_info(stats.num_blocks)
        if snap.scheduler is not None:
            yield from self._scheduler(snap.scheduler)
        if snap.memory is not None:
            yield from self._memory(snap.memory)

    def _memory(self, mem: MemoryStats) -> Iterator[Metric]:
        """The memory policy: prefix cache, adapter cache, pages by kind, copies (vLLM names where vLLM has one)."""
        model = [self.model_name]
        yield _counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", model,
                       mem.prefix_queries_tokens)
        yield _counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", model,
                       mem.prefix_hit_tokens)
        yield _gauge("vllm:num_gpu_loaded_lora_adapters", "Adapters whose weights are on the device.", model,
                     mem.num_gpu_adapters)
        loaded = GaugeMetricFamily("vllm:lora_adapter_loaded", "1 per adapter in engine memory, by level.",
                                   labels=["model_name", "adapter", "level", "pinned", "rank"])
        for a in mem.adapters:
            loaded.add_metric([self.model_name, a.name, a.level, str(a.pinned).lower(), str(a.rank)], 1.0)
        yield loaded
        yield _counter("loraplex:adapter_admissions", "Admitted requests with an adapter.", model, mem.adapter_queries)
        yield _counter("loraplex:adapter_cache_hits", "Of those, the adapter was already on the device.", model,
                       mem.adapter_hits)
        yield _counter("loraplex:adapter_evictions", "Adapters that left the device for room.", model,
                       mem.adapter_evictions)
        yield _counter("loraplex:kv_evictions", "Cached KV blocks dropped.", model, mem.kv_evictions)
        yield _counter("loraplex:kv_swap_outs", "Cached KV blocks moved to the host tier.", model, mem.kv_swap_outs)
        yield _counter("loraplex:kv_swap_ins", "Cached KV blocks brought back from the host tier.", model,
                       mem.kv_swap_ins)
        yield _counter("loraplex:copy_bytes", "Host <-> device bytes copied (adapters and KV).", model, mem.h2d_bytes)
        pages = GaugeMetricFamily("loraplex:memory_pages", "Device pages by what they hold.",
                                  labels=["model_name", "memory_policy", "kind"])
        for kind, value in (("adapter", mem.adapter_pages), ("running_kv", mem.running_kv_pages),
                            ("cached_kv", mem.cached_kv_pages), ("free", mem.free_pages),
                            ("host_kv", mem.host_kv_pages)):
            pages.add_metric([self.model_name, mem.policy, kind], value)
        yield pages
        yield _gauge("loraplex:invalid_kv_pages", "Cached KV pages whose adapter is not on the device (0 under "
                     "unified).", model, mem.invalid_kv_pages)

    def _scheduler(self, sched: SchedulerStats) -> Iterator[Metric]:
        """The scheduler's queues, quotas and decisions (loraplex.engine.scheduling.stats)."""
        model = [self.model_name]
        per_queue = [
            ("loraplex:scheduler_queue_length", "Waiting requests per scheduler queue (0 = smallest).",
             lambda q: q.length),
            ("loraplex:scheduler_queue_wait_seconds", "Recent arrival-to-admission time per queue.",
             lambda q: q.mean_wait_s),
            ("loraplex:scheduler_queue_head_wait_seconds", "Wait of the oldest waiting request per queue.",
             lambda q: q.head_wait_s),
            ("loraplex:scheduler_queue_quota_tokens", "Token quota per queue (chameleon).",
             lambda q: q.quota_tokens),
            ("loraplex:scheduler_queue_held_tokens", "Quota tokens borrowed by running requests per queue.",
             lambda q: q.held_tokens if q.quota_tokens is not None else None),
        ]
        for name, doc, value in per_queue:
            metric = GaugeMetricFamily(name, doc, labels=["model_name", "scheduler", "queue"])
            for q in sched.queues:
                v = value(q)
                if v is not None:
                    metric.add_metric([self.model_name, sched.policy, str(q.index)], v)
            yield metric
        yield _counter("loraplex:scheduler_squashes", "Bypassing requests stopped so the request they passed "
                       "could start.", model, sched.num_squashes)
        yield _counter("loraplex:scheduler_bypasses", "Requests admitted ahead of an older one whose adapter had "
                       "no memory.", model, sched.num_bypasses)
        yield _gauge("loraplex:scheduler_overloaded", "1 when the queues' M/M/1 quota floors exceed the token pool "
                     "(more servers needed).", model, float(sched.overloaded))
        if sched.predictor is not None:
            yield _gauge("loraplex:output_length_prediction_error_tokens", "Recent mean absolute error of the "
                         "output-length predictor.", model, sched.predictor.mean_abs_error)
            yield _gauge("loraplex:output_length_prediction_relative_error", "Recent mean |predicted - actual| "
                         "/ actual of the output-length predictor.", model, sched.predictor.mean_rel_error)
        service = CounterMetricFamily("loraplex:adapter_service_tokens", "Prompt and output tokens of finished "
                                      "requests per adapter ('' = base model).", labels=["model_name", "adapter"])
        for adapter, tokens in sorted(sched.adapter_service.items()):
            service.add_metric([self.model_name, adapter], tokens)
        yield service

    def _lora_requests_info(self, snap: EngineSnapshot) -> Metric:
        # vLLM's encoding: adapter names as comma-separated label values, the value a timestamp
        # (consumers such as the Gateway API Inference Extension take the newest series).
        metric = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running and waiting adapters.",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        metric.add_metric([self.model_name, str(self.max_loras), ",".join(snap.running_adapters),
                           ",".join(snap.waiting_adapters)], time.time())
        return metric

    def _cache_config_info(self, num_blocks: int) -> Metric:
        metric = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                   labels=["model_name", "block_size", "num_gpu_blocks"])
        metric.add_metric([self.model_name, str(self.block_size), str(num_blocks)], 1.0)
        return metric


def _gauge(name: str, doc: str, labels: list[str], value: float) -> Metric:
    metric = GaugeMetricFamily(name, doc, labels=["model_name"])
    metric.add_metric(labels, value)
    return metric


def _counter(name: str, doc: str, labels: list[str], value: float) -> Metric:
    metric = CounterMetricFamily(name, doc, labels=["model_name"])
    metric.add_metric(labels, value)
    return metric
