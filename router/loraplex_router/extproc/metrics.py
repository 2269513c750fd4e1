"""The picker's Prometheus series, under the names llm-d's endpoint picker uses (`llm_d_epp_*`), so a
dashboard or KEDA trigger made for it reads ours unchanged (the mapping: docs/gateway.md). They live
in the router's registry: one `/metrics` serves both."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from loraplex_router.metrics import RouterMetrics

_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_LATENCY_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_MODEL = ["model_name", "target_model_name"]


class PickerMetrics:
    def __init__(self, router: RouterMetrics) -> None:
        r = router.registry
        self.requests = Counter("llm_d_epp_request", "Requests the picker routed", _MODEL, registry=r)
        self.errors = Counter("llm_d_epp_request_error", "Requests the picker refused (an immediate response) "
                              "or the model server failed, by error code", [*_MODEL, "error_code"], registry=r)
        self.running = Gauge("llm_d_epp_request_running", "Requests routed and not finished yet", ["model_name"],
                             registry=r)
        self.duration = Histogram("llm_d_epp_request_duration_seconds", "From the request's headers to the "
                                  "response's end", _MODEL, buckets=_LATENCY_BUCKETS, registry=r)
        self.input_tokens = Histogram("llm_d_epp_request_input_tokens", "Prompt tokens per request (from the "
                                      "response's usage)", _MODEL, buckets=_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram("llm_d_epp_request_output_tokens", "Completion tokens per request",
                                       _MODEL, buckets=_TOKEN_BUCKETS, registry=r)
        self.request_size = Histogram("llm_d_epp_request_size_bytes", "Request body size", _MODEL,
                                      buckets=[2 ** k for k in range(6, 25, 2)], registry=r)
        self.decision = Histogram("llm_d_epp_scheduler_e2e_duration_seconds", "From the request body's last chunk "
                                  "to the decision (filters -> scorers -> picker)", buckets=_DECISION_BUCKETS,
                                  registry=r)
        self.attempts = Counter("llm_d_epp_scheduler_attempts", "Scheduling decisions, by result (success|failure)",
                                ["status"], registry=r)
        self.ready_endpoints = Gauge("llm_d_epp_ready_endpoints", "Servers the picker can send requests to "
                                     "(registered, address resolved)", registry=r)
        self.streams = Gauge("loraplex_picker_streams_open", "ext_proc streams open now", registry=r)
