"""Session fixtures shared by every test area.

- `tiny_model`: a TinyModel (loraplex_agent.tools.tiny_model) with 8 adapters of ranks 8, 16, 32, 64
  (cycled: lora00-r8, lora01-r16, lora02-r32, lora03-r64, lora04-r8, ...), built once per session.
  Treat it as read-only; copy an adapter folder (shutil.copytree) before changing it.
- `redis_server`: URL (redis://127.0.0.1:PORT/0) of a real redis-server, no persistence, one per session.
- `redis_url`: the same URL, with the database flushed before the test.
- `free_port`: a function returning a free TCP port on 127.0.0.1; `port_in_use`: one this process listens on.
- `start_redis`: `with start_redis(port, workdir) as url:` a redis-server of the test's own.

Without a GPU the Triton kernels run in Triton's interpreter. TRITON_INTERPRET must be set before
anything imports triton (kernels are wrapped at decoration), so it is set here, before any test
module is collected: whichever test first imports a kernel (the kernel tests, the GPU run's
rehearsal, an engine test) gets the interpreter, in any order.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch
from triton_interpreter import patch_interpreter_index

from loraplex.ports import free_port as free_port_now

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    patch_interpreter_index()

REDIS_SERVER = "/usr/bin/redis-server"
TINY_MODEL_ADAPTERS = 8
TINY_MODEL_RANKS = (8, 16, 32, 64)


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    return free_port_now


@pytest.fixture
def port_in_use(free_port) -> Iterator[int]:
    """A port on 127.0.0.1 that this test process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    from loraplex_agent.tools.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-model")
    return make_tiny_model(out, num_adapters=TINY_MODEL_ADAPTERS, ranks=TINY_MODEL_RANKS, seed=0)


@pytest.fixture(scope="session")
def tiny_alora_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model with lora00-r8, lora01-r16 and the activated LoRAs alora00-r8 and alora01-r16
    (the same weights, invoked by `tiny_model.INVOCATION`)."""
    from loraplex_agent.tools.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-alora-model")
    return make_tiny_model(out, num_adapters=2, ranks=(8, 16), seed=0, alora_adapters=2)


@contextmanager
def running_redis(port: int, workdir: Path) -> Iterator[str]:
    """A real redis-server on 127.0.0.1:port (no persistence), stopped on exit; yields its URL."""
    if not Path(REDIS_SERVER).exists():
        pytest.fail(f"{REDIS_SERVER} is not installed (apt-get install redis-server)")
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_redis(port, process, workdir / "redis.log")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("redis")
    with running_redis(free_port_now(), workdir) as url:
        yield url
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def start_redis() -> Callable[[int, Path], AbstractContextManager[str]]:
    """`with start_redis(port, workdir) as url:` a redis-server of the test's own, on that port."""
    return running_redis


@pytest.fixture
def redis_url(redis_server: str) -> str:
    import redis

    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server


def _wait_for_redis(port: int, process: subprocess.Popen, log: Path, timeout_s: float = 20.0) -> None:
    """Poll with PING until the server answers (it starts in milliseconds; the bound is for a busy CI)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = log.read_text(errors="replace") if log.exists() else ""
            raise RuntimeError(f"redis-server exited with {process.returncode}: {output}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"redis-server did not answer on port {port} within {timeout_s} s")
