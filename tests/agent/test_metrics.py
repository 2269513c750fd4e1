"""/metrics speaks Prometheus text with vLLM's metric names, labelled with the served model."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

VLLM_NAMES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:lora_requests_info": "gauge",
    "vllm:cache_config_info": "gauge",
    "loraplex:adapter_loads": "counter",
    "loraplex:resident_adapters": "gauge",
    "loraplex:request_success": "counter",
    "loraplex:engine_thread_cpu_seconds": "counter",
}


def _families(agent) -> dict:
    return {f.name: f for f in text_string_to_metric_families(agent.metrics())}


def _value(family, suffix: str = "", **labels) -> float:
    return sum(s.value for s in family.samples
               if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_use_vllm_names_types_and_model_label(agent):
    client = agent.client()
    client.completions.create(model=agent.adapters[2], prompt="x = 1\n", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    families = _families(agent)
    for name, kind in VLLM_NAMES.items():
        assert name in families, name
        assert families[name].type == kind, name
        assert all(s.labels["model_name"] == agent.base for s in families[name].samples), name


def test_counters_and_histograms_move_with_requests(agent):
    before = _families(agent)
    agent.client().completions.create(model=agent.adapters[3], prompt="while True:\n", max_tokens=7,
                                      temperature=0, extra_body={"ignore_eos": True})
    after = _families(agent)

    def delta(name: str, suffix: str = "_total", **labels) -> float:
        return _value(after[name], suffix, **labels) - _value(before[name], suffix, **labels)

    assert delta("vllm:generation_tokens") >= 7
    assert delta("vllm:prompt_tokens") >= 1
    assert delta("vllm:request_success", finished_reason="length") >= 1
    assert delta("loraplex:request_success", adapter=agent.adapters[3], finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds", "_count") >= 1
    assert delta("vllm:inter_token_latency_seconds", "_count") >= 6
    assert delta("vllm:e2e_request_latency_seconds", "_count") >= 1
    assert delta("vllm:request_queue_time_seconds", "_count") >= 1
    assert 0.0 <= _value(after["vllm:kv_cache_usage_perc"]) <= 1.0
    assert _value(after["loraplex:resident_adapters"]) >= 1
    assert delta("loraplex:engine_thread_cpu_seconds") > 0  # the engine thread stepped the request


def test_lora_requests_info_has_vllm_labels(agent):
    [sample] = _families(agent)["vllm:lora_requests_info"].samples
    assert set(sample.labels) == {"model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert sample.labels["max_lora"] == str(agent.engine.core.config.max_loras)
    assert sample.value > 1e9  # a wall-clock timestamp, as vLLM sets it


def test_memory_metrics_show_the_prefix_cache_pinned_adapters_and_load_times(agent):
    import httpx

    name = "pinned-copy"
    path = agent.tiny_model.adapters[agent.adapters[1]]
    with httpx.Client(base_url=agent.url, timeout=60) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), "pinned": True},
                           headers=agent.admin_headers())
        assert loaded.status_code == 200, loaded.text
    try:
        prompt = "def fibonacci(n):\n    " * 8  # long enough for full KV blocks
        for _ in range(2):  # the second request finds the first one's prompt in the prefix cache
            agent.client().completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)

        def hit() -> dict | None:  # the snapshot behind /metrics is refreshed about once a second
            families = _families(agent)
            return families if _value(families["vllm:prefix_cache_hits"], "_total") > 0 else None

        families = agent.wait_for(hit, "a prefix cache hit in /metrics")
        assert _value(families["vllm:prefix_cache_queries"], "_total") >= _value(families["vllm:prefix_cache_hits"],
                                                                                  "_total") > 0
        loaded_series = [s for s in families["vllm:lora_adapter_loaded"].samples if s.labels["adapter"] == name]
        assert loaded_series and loaded_series[0].labels["pinned"] == "true" and loaded_series[0].labels["level"] == "gpu"
        assert _value(families["vllm:lora_adapter_load_seconds"], "_count") >= 1
        assert families["loraplex:invalid_kv_pages"].samples[0].value == 0
        pages = {s.labels["kind"]: s.value for s in families["loraplex:memory_pages"].samples}
        assert pages["adapter"] > 0 and pages["cached_kv"] > 0
    finally:
        with httpx.Client(base_url=agent.url, timeout=60) as http:
            http.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=agent.admin_headers())


def test_the_model_server_contract_gie_reads(agent):
    """The series a Gateway API Inference Extension picker scrapes (GIE proposal 003), read as it reads
    them, while a request for an adapter is running: queue and running counts, KV use in [0, 1], the
    running adapter in vllm:lora_requests_info, block size and block count in vllm:cache_config_info."""
    adapter = agent.adapters[1]
    stream = agent.client().completions.create(model=adapter, prompt="def f(x):\n", max_tokens=64, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # running now
        families = _families(agent)
    finally:
        stream.close()
    assert _value(families["vllm:num_requests_running"]) >= 1
    assert _value(families["vllm:num_requests_waiting"]) >= 0
    assert 0.0 < _value(families["vllm:kv_cache_usage_perc"]) <= 1.0  # the running request holds blocks
    [lora] = families["vllm:lora_requests_info"].samples
    assert adapter in lora.labels["running_lora_adapters"].split(",")
    assert int(lora.labels["max_lora"]) >= 1
    [cache] = families["vllm:cache_config_info"].samples
    assert int(cache.labels["block_size"]) > 0 and int(cache.labels["num_gpu_blocks"]) == 256
