"""The local stack (`loraplex up`) as a fixture: its own redis-server, 3 real agents on the tiny model,
the placement controller and the router, with 20 LoRADeployments applied from a folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from stack_manifests import deployment_yaml, pool_yaml

NUM_ADAPTERS = 20
POOL = "tiny"


REPLICATED = "ad19"  # deployed with replicas.min = 3: on every agent


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, free_port) -> Iterator:
    from loraplex_local.stack import StackConfig, running_stack

    from loraplex.ports import free_port_block

    folder = tmp_path_factory.mktemp("manifests")
    (folder / "pool.yaml").write_text(pool_yaml(POOL, tiny_model.base_dir,
                                                placement="{policy: loraserve, intervalSeconds: 30, hysteresis: 0.2}"))
    sources = list(tiny_model.adapters.values())
    for i in range(NUM_ADAPTERS):
        name = f"ad{i:02d}"
        replicas = "{min: 3}" if name == REPLICATED else ""
        (folder / f"{name}.yaml").write_text(deployment_yaml(name, sources[i % len(sources)], POOL, replicas))
    config = StackConfig(agents=3, manifests=folder, router_port=free_port(), agent_base_port=free_port_block(3),
                         redis_port=free_port(), heartbeat_interval_s=0.5, heartbeat_ttl_s=3.0,
                         workdir=tmp_path_factory.mktemp("stack"),
                         agent_args=["--num-blocks", "400"])
    with running_stack(config) as stack:
        yield stack


@pytest.fixture
def write_deployment(stack, tiny_model):
    """write_deployment(name): a new LoRADeployment file in the stack's -f folder."""
    def write(name: str) -> None:
        source = next(iter(tiny_model.adapters.values()))
        (stack.config.manifests / f"{name}.yaml").write_text(deployment_yaml(name, source, POOL))
    return write
