"""The local stack (`loraplex up`) as a fixture: its own redis-server, 3 real agents on the tiny model,
the placement controller and the router, with 20 LoRADeployments applied from a folder."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

NUM_ADAPTERS = 20
POOL = "tiny"


REPLICATED = "ad19"  # deployed with replicas.min = 3: on every agent


def deployment_yaml(name: str, source: Path, pool: str = POOL, replicas: str = "") -> str:
    return (f"apiVersion: loraplex.io/v1alpha1\nkind: LoRADeployment\nmetadata: {{name: {name}}}\n"
            f"spec:\n  pool: {pool}\n  adapter: {{source: \"file://{source}\"}}\n"
            + (f"  replicas: {replicas}\n" if replicas else ""))


def pool_yaml(base: Path) -> str:
    return ("apiVersion: loraplex.io/v1alpha1\nkind: AdapterPool\nmetadata: {name: tiny}\nspec:\n"
            f"  baseModel: {{name: tiny-llama, source: \"file://{base}\", dtype: float32}}\n"
            "  engine: {maxLoraRank: 64, maxLoras: 4, maxNumSeqs: 8, maxModelLen: 256}\n"
            "  placement: {policy: loraserve, intervalSeconds: 30, hysteresis: 0.2}\n")


def free_port_block(count: int) -> int:
    """A first port such that `count` consecutive ports are free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count < 65000 and all(_free(first + i) for i in range(count)):
            return first
    raise RuntimeError("no block of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, free_port) -> Iterator:
    from loraplex_router.local_stack import LocalStack, StackConfig

    folder = tmp_path_factory.mktemp("manifests")
    (folder / "pool.yaml").write_text(pool_yaml(tiny_model.base_dir))
    sources = list(tiny_model.adapters.values())
    for i in range(NUM_ADAPTERS):
        name = f"ad{i:02d}"
        replicas = "{min: 3}" if name == REPLICATED else ""
        (folder / f"{name}.yaml").write_text(deployment_yaml(name, sources[i % len(sources)], replicas=replicas))
    config = StackConfig(agents=3, manifests=folder, router_port=free_port(), agent_base_port=free_port_block(3),
                         redis_port=free_port(), heartbeat_interval_s=0.5, heartbeat_ttl_s=3.0,
                         workdir=tmp_path_factory.mktemp("stack"),
                         agent_args=["--num-blocks", "400"])
    stack = LocalStack(config).start()
    stack.start_background()
    yield stack
    stack.stop()


@pytest.fixture
def write_deployment(stack, tiny_model):
    """write_deployment(name): a new LoRADeployment file in the stack's -f folder."""
    def write(name: str) -> None:
        source = next(iter(tiny_model.adapters.values()))
        (stack.config.manifests / f"{name}.yaml").write_text(deployment_yaml(name, source))
    return write


@pytest.fixture(scope="session")
def port_block():
    """port_block(count): a first port such that `count` consecutive ports are free now."""
    return free_port_block
