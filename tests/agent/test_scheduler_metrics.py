"""The scheduler's stats reach /metrics (no model needed: a snapshot is enough)."""

from __future__ import annotations

from loraplex_agent.api.metrics import EngineCollector
from loraplex_agent.runtime.async_engine import EngineSnapshot
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.core import EngineStats
from loraplex.engine.scheduling.stats import PredictorStats, QueueStats, SchedulerStats


def scrape(snapshot: EngineSnapshot) -> dict:
    registry = CollectorRegistry()
    registry.register(EngineCollector("base", lambda: snapshot, max_loras=4, block_size=16))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_chameleon_stats_are_exported_per_queue_and_adapter():
    stats = EngineStats(0, 3, 10, 10, 0, [], 0, 0, 0, 0)
    sched = SchedulerStats(
        policy="chameleon",
        queues=[QueueStats(0, 0.01, 2, 0.5, mean_wait_s=0.2, quota_tokens=300, held_tokens=120),
                QueueStats(1, None, 1, 1.5, quota_tokens=700, held_tokens=0)],
        num_squashes=2, num_bypasses=7, overloaded=True, predictor=PredictorStats(10, 12.5, 0.25, -3.0),
        adapter_service={"": 40, "sql": 900})
    families = scrape(EngineSnapshot(stats=stats, scheduler=sched))

    def value(name, suffix="", **labels):
        return [s.value for s in families[name].samples
                if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())]

    assert value("loraplex:scheduler_queue_length", queue="1", scheduler="chameleon") == [1]
    assert value("loraplex:scheduler_queue_quota_tokens", queue="0") == [300]
    assert value("loraplex:scheduler_queue_held_tokens", queue="0") == [120]
    assert value("loraplex:scheduler_queue_wait_seconds") == [0.2]  # queue 1 has no measurement yet
    assert value("loraplex:scheduler_squashes", "_total") == [2]
    assert value("loraplex:scheduler_bypasses", "_total") == [7]
    assert value("loraplex:scheduler_overloaded") == [1.0]
    assert value("loraplex:output_length_prediction_error_tokens") == [12.5]
    assert value("loraplex:adapter_service_tokens", "_total", adapter="sql") == [900]


def test_fifo_exports_no_quotas_and_no_predictor():
    stats = EngineStats(0, 0, 10, 10, 0, [], 0, 0, 0, 0)
    families = scrape(EngineSnapshot(stats=stats, scheduler=SchedulerStats("fifo", [QueueStats(0, None, 0, 0.0)])))
    assert not families["loraplex:scheduler_queue_quota_tokens"].samples
    assert "loraplex:output_length_prediction_error_tokens" not in families
    assert "vllm:num_requests_waiting" in families
