"""`loraplex router` refuses a bad start with one line on stderr and a non-zero exit, never a
traceback; a good start still serves."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from processes import wait_healthy
from waiting import wait_until

from loraplex.routing.records import ServerRecord
from loraplex.routing.redis_store import RedisRoutingStore

LORAPLEX = str(Path(sys.executable).parent / "loraplex")


def start_router(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LORAPLEX, "router", *args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and all(f in lines[0] for f in fragments), lines[0]
    assert "Traceback" not in result.stderr


def test_a_port_in_use_is_one_line(redis_url, free_port):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        port = sock.getsockname()[1]
        result = start_router("--redis-url", redis_url, "--port", str(port))
    assert_one_line_error(result, f"127.0.0.1:{port}", "in use")


def test_a_bad_redis_url_is_one_line(free_port):
    result = start_router("--redis-url", f"http://127.0.0.1:{free_port()}", "--port", str(free_port()))
    assert_one_line_error(result, "bad --redis-url")


def test_a_redis_not_up_yet_is_waited_for(free_port, start_redis, tmp_path):
    """A fresh install starts the router and Redis together: the router serves /health, answers
    /ready 503 while Redis is down, and becomes ready once Redis is up and a server registered."""
    port, redis_port = free_port(), free_port()
    log = tmp_path / "router.log"
    with log.open("w") as out:
        process = subprocess.Popen([LORAPLEX, "router", "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
                                    "--port", str(port), "--poll-interval", "0.2"],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log)
        assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 503
        with start_redis(redis_port, tmp_path) as url:
            store = RedisRoutingStore.from_url(url, "default")
            store.register_server(ServerRecord("s0", "http://127.0.0.1:9", max_rank=8, base_model="b"), ttl_s=60)
            store.close()
            wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200, 30)
        assert process.poll() is None
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "Redis is not reachable yet" in log.read_text()


def test_a_good_start_serves(redis_url, free_port, tmp_path):
    port = free_port()
    log = tmp_path / "router.log"
    with log.open("w") as out:
        process = subprocess.Popen([LORAPLEX, "router", "--redis-url", redis_url, "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log)
        assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 503  # no agent registered
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert f"listening on http://127.0.0.1:{port}" in log.read_text()



def test_a_picker_port_in_use_is_one_line(redis_url, free_port):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        port = sock.getsockname()[1]
        result = start_router("--redis-url", redis_url, "--port", str(free_port()), "--extproc-port", str(port))
    assert_one_line_error(result, f"127.0.0.1:{port}", "in use")


@pytest.mark.parametrize("args,fragment", [(["--extproc-port", "70000"], "--extproc-port"),
                                           (["--extproc-shed-queue-depth", "-1"], "--extproc-shed-queue-depth")])
def test_bad_picker_flags_are_one_line(redis_url, free_port, args, fragment):
    assert_one_line_error(start_router("--redis-url", redis_url, "--port", str(free_port()), *args), fragment)


def test_the_picker_serves_health_beside_the_router(redis_url, free_port, tmp_path):
    port, grpc_port = free_port(), free_port()
    store = RedisRoutingStore.from_url(redis_url, "picker-cli")
    log = tmp_path / "router.log"
    with log.open("w") as out:
        process = subprocess.Popen([LORAPLEX, "router", "--redis-url", redis_url, "--pool", "picker-cli",
                                    "--port", str(port), "--extproc-port", str(grpc_port), "--poll-interval", "0.2"],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

            assert status("liveness") == health_pb2.HealthCheckResponse.SERVING
            assert status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING  # no server yet
            store.register_server(ServerRecord("s0", "http://127.0.0.1:9", max_rank=64, base_model="m"), ttl_s=60)
            wait_until(lambda: status("envoy.service.ext_proc.v3.ExternalProcessor")
                       == health_pb2.HealthCheckResponse.SERVING, timeout_s=20)
    finally:
        process.terminate()
        process.wait(timeout=20)
        store.deregister_server("s0")
        store.close()


async def test_served_connections_send_without_waiting_for_acks(free_port):
    """The listening socket names TCP, so asyncio sets TCP_NODELAY on each accepted connection (a
    socket of protocol 0 left Nagle on: ~40 ms per small response, waiting for the delayed ACK)."""
    import asyncio

    from loraplex.startup import listen_socket

    accepted = asyncio.get_running_loop().create_future()

    async def serve(reader, writer) -> None:
        accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    with listen_socket("127.0.0.1", free_port()) as sock:
        server = await asyncio.start_server(serve, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        assert await asyncio.wait_for(accepted, 10) == 1
        writer.close()
        server.close()
