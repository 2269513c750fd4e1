"""The router as a GIE endpoint picker: a gRPC client that behaves as Envoy's ext_proc filter does in
FULL_DUPLEX_STREAMED mode drives it, over a real redis-server and echo servers on 127.0.0.1; the
client forwards each request to the endpoint the picker chose, as the gateway would."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loraplex_bench.gateway_client import Gateway, headers_message
from loraplex_router.auth import ApiKey, KeyRing
from loraplex_router.extproc.decision import PickerSettings
from loraplex_router.extproc.server import ExtProcConfig

from loraplex.routing.records import ServerRecord
from loraplex.routing.redis_store import RedisRoutingStore

BASE = "tiny-base"


@pytest.fixture
def picker_env(make_router_env, redis_url, free_port, request):
    """A router with the picker on, its table in Redis; `request.param` may give make_env kwargs."""
    kwargs = getattr(request, "param", {})
    port = free_port()
    store = RedisRoutingStore.from_url(redis_url, f"epp-{port}")
    picker = PickerSettings(8 << 20, fallbacks=kwargs.pop("fallbacks", 2),
                            shed_queue_depth=kwargs.pop("shed", 0))
    env = make_router_env(store=store, extproc=ExtProcConfig("127.0.0.1", port, picker), **kwargs)
    env.target = f"127.0.0.1:{port}"
    env.endpoint = {sid: server.url.removeprefix("http://") for sid, server in env.echoes.items()}
    env.endpoint_of = lambda sid: env.app.state.cache.snapshot.servers[sid].url.removeprefix("http://")
    return env


@pytest.fixture
async def gateway(picker_env):
    gw = Gateway(picker_env.target)
    yield gw
    await gw.close()


def completion(model: str, **extra) -> bytes:
    return json.dumps({"model": model, "prompt": "one two three four five six", "max_tokens": 3, **extra}).encode()


def metric(env, name: str) -> float:
    text = httpx.get(env.router.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_routes_in_order_and_the_chosen_server_serves(picker_env, gateway):
    ex = await gateway.send(completion("a"), pieces=40)
    assert ex.replies[:2] == ["request_headers", "request_body"]
    assert ex.replies[2] == "response_headers" and set(ex.replies[3:]) == {"response_body"}
    assert ex.destination == ex.metadata  # header and metadata never differ
    assert ex.destination.split(",")[0] == picker_env.endpoint["s0"]  # φ(a) = 1 on s0
    assert ex.served == picker_env.endpoint["s0"] and ex.status == 200
    doc = json.loads(ex.body)
    assert doc["model"] == "a" and doc["usage"]["completion_tokens"] == 3
    assert json.loads(ex.sent_body) == json.loads(completion("a"))  # the body as sent: not rewritten
    assert "content-length" not in ex.request_headers
    assert ex.request_headers["x-loraplex-adapter"] == "a"  # as the HTTP router sends it: a missing adapter loads


async def test_fallbacks_follow_the_pipeline_and_a_refused_primary_is_ejected(picker_env, gateway, free_port, wait):
    picker_env.register("dead", f"http://127.0.0.1:{free_port()}")  # registered, nothing listens there
    picker_env.publish({"b": {"dead": 1.0}, "a": {"s0": 1.0}})
    ex = await gateway.send(completion("b"))
    endpoints = ex.destination.split(",")
    assert len(endpoints) == 3 and len(set(endpoints)) == 3
    assert ex.served == endpoints[1] and ex.status == 200  # the gateway went down the list
    assert metric(picker_env, "loraplex_router_retries_total") == 1
    assert metric(picker_env, 'loraplex_router_upstream_failures_total{server="dead"}') == 1
    for _ in range(2):  # three failures in a row eject it (--eject-after)
        await gateway.send(completion("b"))
    snapshot = picker_env.app.state.cache.snapshot
    assert "dead" in picker_env.app.state.proxy.detector.ejected(snapshot.servers)
    ex = await gateway.send(completion("b"))
    assert picker_env.endpoint_of("dead") not in ex.destination.split(",")


async def test_streaming_passes_through_and_usage_is_counted(picker_env, gateway):
    ex = await gateway.send(completion("c", stream=True, max_tokens=5), pieces=3)
    assert json.loads(ex.sent_body)["stream_options"] == {"include_usage": True}  # asked for the demand count
    assert int(ex.request_headers["content-length"]) == len(ex.sent_body)
    events = [e for e in ex.body.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]" and len(events) == 6  # five tokens; the usage chunk not forwarded
    assert b'"prompt_tokens"' not in ex.body
    assert metric(picker_env, 'loraplex_router_tokens_total{kind="completion",model="c"}') == 5
    assert metric(picker_env, 'llm_d_epp_request_total{model_name="c"') == 1


async def test_stream_usage_is_forwarded_when_the_client_asked(picker_env, gateway):
    ex = await gateway.send(completion("c", stream=True, stream_options={"include_usage": True}))
    assert "content-length" not in ex.request_headers
    assert b'"completion_tokens":3' in ex.body


@pytest.mark.parametrize("body,status,code", [
    (b'{"model": "a", "prompt": ', 400, 400),
    (b'{"prompt": "x"}', 400, 400),
    (b"[1, 2]", 400, 400),
    (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "model_not_found"),
])
async def test_bad_requests_get_immediate_errors(picker_env, gateway, body, status, code):
    ex = await gateway.send(body, pieces=5)
    assert ex.immediate and ex.status == status and ex.replies == ["immediate_response"]
    assert json.loads(ex.body)["error"]["code"] == code


async def test_subset_hint(picker_env, gateway):
    s1, s2 = picker_env.endpoint["s1"], picker_env.endpoint["s2"]
    for _ in range(10):
        ex = await gateway.send(completion("b"), subset=[s2])
        assert ex.destination == s2 and ex.served == s2
    ex = await gateway.send(completion("b"), subset=f"{s1}, {s2}")  # one comma-separated string
    assert set(ex.destination.split(",")) <= {s1, s2}
    for subset in ([], ["10.9.9.9:8000"], ""):
        ex = await gateway.send(completion("b"), subset=subset)
        assert ex.immediate and ex.status == 503, subset
        assert json.loads(ex.body)["error"]["code"] == "no_eligible_endpoint"


async def test_no_ready_server_is_503(picker_env, gateway):
    for sid in list(picker_env.echoes):
        picker_env.store.deregister_server(sid)
    picker_env.wait_for(lambda: not picker_env.app.state.cache.snapshot.servers)
    ex = await gateway.send(completion("a"))
    assert ex.immediate and ex.status == 503
    assert json.loads(ex.body)["error"]["code"] == "no_healthy_server"


@pytest.mark.parametrize("picker_env", [{"shed": 1}], indirect=True)
async def test_shedding_is_429(picker_env, gateway):
    proxy = picker_env.app.state.proxy
    for sid in picker_env.echoes:
        proxy.in_flight[sid] = 1
    ex = await gateway.send(completion("a"))
    assert ex.immediate and ex.status == 429
    for sid in picker_env.echoes:
        proxy.in_flight[sid] = 0
    assert (await gateway.send(completion("a"))).status == 200


async def test_model_rewrite_header(picker_env, gateway):
    ex = await gateway.send(completion("a"), headers={"x-gateway-model-name-rewrite": "c"})
    assert json.loads(ex.sent_body)["model"] == "c"
    assert int(ex.request_headers["content-length"]) == len(ex.sent_body)
    assert ex.destination.split(",")[0] in {picker_env.endpoint["s1"], picker_env.endpoint["s2"]}
    assert json.loads(ex.body)["model"] == "c"


@pytest.mark.parametrize("picker_env", [{"keys": KeyRing([ApiKey("k-a", frozenset({"a"}), base_model=False)])}],
                         indirect=True)
async def test_per_key_adapter_access(picker_env, gateway):
    assert (await gateway.send(completion("a"))).status == 401
    assert (await gateway.send(completion("a"), headers={"authorization": "Bearer nope"})).status == 401
    assert (await gateway.send(completion("b"), headers={"authorization": "Bearer k-a"})).status == 403
    assert (await gateway.send(completion("a"), headers={"authorization": "Bearer k-a"})).status == 200


async def test_request_without_body_goes_to_a_server(picker_env, gateway):
    ex = await gateway.send(None, path="/v1/models", forward=False)
    assert ex.replies == ["request_headers"] and ex.destination.split(",")[0] in picker_env.endpoint.values()


async def test_cancel_mid_request_and_mid_response_leaves_nothing(picker_env, gateway, wait):
    processor = picker_env.app.state.picker.processor
    await gateway.send_and_cancel(completion("a"), after_chunks=2)
    call = gateway.stub.Process()
    await call.write(ProcessingRequest(request_headers=headers_message(
        {":path": "/v1/completions", "content-type": "application/json"})))
    await call.write(ProcessingRequest(request_body=HttpBody(body=completion("a", stream=True), end_of_stream=True)))
    await call.read()
    await call.read()
    call.cancel()  # routed, the response never came: the client left
    wait(lambda: not processor.open)
    proxy = picker_env.app.state.proxy
    assert all(v == 0 for v in proxy.in_flight.values())
    assert metric(picker_env, 'loraplex_router_requests_total{code="499",model="a"}') == 1


async def test_health_services(picker_env):
    async with grpc.aio.insecure_channel(picker_env.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_hostnames_resolve_to_addresses(picker_env, gateway, free_port):
    """Agents in a cluster register their pod's DNS name; the gateway wants ip:port."""
    port = free_port()
    picker_env.store.register_server(ServerRecord("named", f"http://localhost:{port}", max_rank=64,
                                                  base_model=BASE), ttl_s=600)
    picker_env.publish({"a": {"named": 1.0}})
    await asyncio.sleep(0.3)  # a registry poll and an address refresh
    ex = await gateway.send(completion("a"), forward=False)
    assert ex.destination.split(",")[0] in {f"127.0.0.1:{port}", f"[::1]:{port}"}


async def test_many_requests_with_cancels_leak_nothing(picker_env, gateway, wait):
    """The CI-sized leak check (the 10,000-request run is `loraplex bench picker --leak`)."""
    processor = picker_env.app.state.picker.processor

    async def one(i: int) -> None:
        if i % 10 == 0:
            await gateway.send_and_cancel(completion("b"), after_chunks=1 + i % 3)
        else:
            assert (await gateway.send(completion("b", stream=i % 2 == 0))).status == 200

    for start in range(0, 300, 30):
        await asyncio.gather(*(one(i) for i in range(start, start + 30)))
    wait(lambda: not processor.open)
    assert all(v == 0 for v in picker_env.app.state.proxy.in_flight.values())
    assert metric(picker_env, "loraplex_picker_streams_open") == 0
    assert metric(picker_env, 'llm_d_epp_request_running{model_name="b"}') == 0
