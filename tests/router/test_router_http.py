"""The router over echo servers: OpenAI API, streaming, errors, φ routing, retries, keys, demand."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import openai
import pytest
from loraplex_router.auth import ApiKey, KeyRing
from threaded_server import ThreadedServer


def client_for(env, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=env.router.url + "/v1", api_key=key, max_retries=0)


def test_completions_and_chat_through_the_router(router_env):
    client = client_for(router_env)
    done = client.completions.create(model="a", prompt="hello world", max_tokens=3)
    assert done.choices[0].text == "tok tok tok"
    assert done.usage.completion_tokens == 3
    chat = client.chat.completions.create(model="c", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content == "tok tok"
    base = client.completions.create(model="tiny-base", prompt="x", max_tokens=1)
    assert base.choices[0].text == "tok"


def test_streams_pass_through_and_hide_the_usage_chunk_unless_asked(router_env):
    client = client_for(router_env)
    chunks = list(client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "tok" * 4
    assert all(c.choices for c in chunks)  # the router asked for usage, the client did not: stripped
    chunks = list(client.completions.create(model="b", prompt="hi", max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2


def test_demand_is_counted_per_adapter_in_the_store(router_env):
    client = client_for(router_env)
    client.completions.create(model="a", prompt="one two", max_tokens=5)
    list(client.completions.create(model="c", prompt="one", max_tokens=3, stream=True))
    client.completions.create(model="tiny-base", prompt="one", max_tokens=3)  # base: not adapter demand

    def counted() -> dict[str, float]:
        windows = router_env.store.demand_windows(time.time() + 2.0, 5)
        return {name: sum(rates) for name, rates in windows.rates.items()}

    router_env.wait_for(lambda: set(counted()) == {"a", "c"})
    assert counted()["a"] == pytest.approx(5 + 2)  # window_s = 1, so tokens/s sums to tokens
    assert counted()["c"] == pytest.approx(3 + 1)


def test_routing_follows_phi(router_env):
    """b is split 0.2 / 0.3 / 0.5 over s0, s1, s2; 1000 requests must match within a chi-square bound."""
    n = 1000
    seen: Counter[str] = Counter()
    with httpx.Client(base_url=router_env.router.url) as http:
        for _ in range(n):
            r = http.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200
            seen[r.headers["x-loraplex-server"]] += 1
    expected = {"s0": 0.2 * n, "s1": 0.3 * n, "s2": 0.5 * n}
    chi2 = sum((seen[s] - e) ** 2 / e for s, e in expected.items())
    assert chi2 < 13.8, (seen, chi2)  # p = 0.001 with 2 degrees of freedom


def test_table_swap_takes_effect_without_restart(router_env):
    router_env.publish({"a": {"s2": 1.0}, "b": {"s0": 1.0}, "c": {"s0": 1.0}})
    with httpx.Client(base_url=router_env.router.url) as http:
        servers = {http.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1})
                   .headers["x-loraplex-server"] for _ in range(20)}
    assert servers == {"s2"}


def test_unknown_model_is_404_and_bad_requests_are_400(router_env):
    client = client_for(router_env)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"
    r = httpx.post(router_env.router.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(router_env.router.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_a_dead_server_is_retried_elsewhere_and_then_avoided(router_env, free_port):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    router_env.register("dead", dead)
    router_env.wait_for(lambda: "dead" in router_env.app.state.cache.snapshot.servers)
    router_env.publish({"a": {"dead": 0.5, "s1": 0.5}, "b": {"s0": 1.0}, "c": {"s0": 1.0}})
    client = client_for(router_env)
    for _ in range(30):
        assert client.completions.create(model="a", prompt="x", max_tokens=1).choices[0].text == "tok"
    metrics = httpx.get(router_env.router.url + "/metrics").text
    failures = [line for line in metrics.splitlines()
                if line.startswith('loraplex_router_upstream_failures_total{server="dead"}')]
    assert failures and float(failures[0].split()[-1]) == 1.0  # then avoided for the cooldown


def test_no_live_server_is_503(router_env):
    router_env.store.deregister_server("s1")
    router_env.store.deregister_server("s2")
    router_env.store.deregister_server("s0")
    router_env.wait_for(lambda: not router_env.app.state.cache.snapshot.servers)
    with pytest.raises(openai.InternalServerError) as err:
        client_for(router_env).completions.create(model="c", prompt="x", max_tokens=1)
    assert err.value.status_code == 503 and err.value.body["code"] == "no_healthy_server"


def test_server_that_comes_back_is_used_again(router_env, free_port):
    from loraplex_bench.echo_server import EchoServer

    port = free_port()
    late = ThreadedServer(EchoServer("late"), port).start()
    router_env.extra.append(late)
    router_env.register("late", late.url)
    router_env.wait_for(lambda: "late" in router_env.app.state.cache.snapshot.servers)
    router_env.publish({"a": {"late": 1.0}, "b": {"s0": 1.0}, "c": {"s0": 1.0}})
    r = httpx.post(router_env.router.url + "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1})
    assert r.headers["x-loraplex-server"] == "late"


def test_api_keys_restrict_adapters(make_router_env):
    keys = KeyRing([ApiKey("sk-all", None), ApiKey("sk-a", frozenset({"a"}), base_model=False)])
    env = make_router_env(keys=keys)
    with pytest.raises(openai.AuthenticationError):
        client_for(env, "sk-wrong").completions.create(model="a", prompt="x", max_tokens=1)
    r = httpx.post(env.router.url + "/v1/completions", json={"model": "a", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    limited = client_for(env, "sk-a")
    assert limited.completions.create(model="a", prompt="x", max_tokens=1).choices[0].text == "tok"
    with pytest.raises(openai.PermissionDeniedError):
        limited.completions.create(model="b", prompt="x", max_tokens=1)
    with pytest.raises(openai.PermissionDeniedError):
        limited.completions.create(model="tiny-base", prompt="x", max_tokens=1)
    assert [m.id for m in limited.models.list()] == ["a"]
    assert [m.id for m in client_for(env, "sk-all").models.list()] == ["tiny-base", "a", "b", "c"]


def test_unknown_model_names_add_no_metric_series(router_env):
    """A client's free text never becomes a label: random names would grow the router's memory and
    the monitoring's series without bound."""
    client = client_for(router_env)
    for i in range(20):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=f"no-such-model-{i}", prompt="x", max_tokens=1)
    text = httpx.get(router_env.router.url + "/metrics").text
    assert "no-such-model" not in text
    assert 'loraplex_router_requests_total{code="404",model="(unknown)"} 20.0' in text


def test_models_lists_base_and_every_adapter_with_parent(router_env):
    cards = client_for(router_env).models.list().data
    assert [c.id for c in cards] == ["tiny-base", "a", "b", "c"]
    assert all(c.parent == "tiny-base" for c in cards[1:])


def test_metrics_are_prometheus_text(router_env):
    client_for(router_env).completions.create(model="a", prompt="x", max_tokens=2)
    text = httpx.get(router_env.router.url + "/metrics").text
    assert 'loraplex_router_requests_total{code="200",model="a"} 1.0' in text
    assert 'loraplex_router_tokens_total{kind="completion",model="a"} 2.0' in text
    assert "loraplex_router_routing_table_version 1.0" in text


def test_unknown_routes_and_wrong_methods_answer_in_the_openai_error_shape(router_env):
    url = router_env.router.url
    for response, status in ((httpx.get(url + "/v1/nope"), 404), (httpx.get(url + "/v1/completions"), 405),
                             (httpx.delete(url + "/v1/models"), 405)):
        assert response.status_code == status
        error = response.json()["error"]
        assert error["code"] == status and error["message"] and error["type"]
