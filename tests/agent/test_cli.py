"""`loraplex agent` as a user starts it: a subprocess serving the tiny model and two adapters."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI
from processes import wait_healthy


@pytest.fixture
def agent_process(tiny_model, free_port, tmp_path):
    port = free_port()
    adapters = list(tiny_model.adapters.items())[:2]
    command = [sys.executable, "-m", "loraplex.cli", "agent", "--model", str(tiny_model.base_dir),
               "--served-model-name", "tiny", "--port", str(port), "--device", "cpu", "--dtype", "float32",
               "--num-blocks", "64", "--max-model-len", "256"]
    for name, path in adapters:
        command += ["--adapter", f"{name}={path}"]
    log = (tmp_path / "agent.log").open("w")
    env = {**os.environ, "LORAPLEX_API_KEY": "from-env"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, tmp_path / "agent.log")
        yield url, [name for name, _ in adapters]
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def test_agent_command_serves_the_openai_api(agent_process):
    url, adapters = agent_process
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    models = {m.id: m.parent for m in client.models.list().data}
    assert models == {"tiny": None, adapters[0]: "tiny", adapters[1]: "tiny"}
    response = client.chat.completions.create(model=adapters[1], messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 4
    # The key comes from LORAPLEX_API_KEY.
    unload = {"lora_name": adapters[0]}
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json=unload).status_code == 401
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json=unload,
                      headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_agent_command_rejects_a_malformed_adapter_option(tiny_model):
    result = subprocess.run([sys.executable, "-m", "loraplex.cli", "agent", "--model", str(tiny_model.base_dir),
                             "--adapter", "no-equals-sign"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "NAME=DIR" in result.stderr
