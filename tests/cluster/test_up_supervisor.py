"""`loraplex up` as a supervisor, over the real command and its processes (redis-server, one agent on
the tiny model, the router): the numbered failures of issue 34.

1. a manifest whose record cannot be made (an invalid adapter name) is one line naming the file, once,
   and holds up neither the other files nor placement; at start it is refused in one line naming it;
2. a manifest for another pool, and a missing adapter folder, are each said once per change of their
   file, not at every tick nor when an unrelated file changes;
3. `kill -9` of `up` leaves nothing behind: every child dies with it and its ports are free;
4. a router or agent that dies is restarted with backoff, and said in one line;
5. `--model <an adapter folder>` and ports beyond 65535 are refused before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from processes import alive, terminate
from stack_manifests import deployment_yaml, pool_yaml
from waiting import wait_for, wait_until

from loraplex.ports import free_port, free_port_block, in_use, listener
from loraplex.routing.redis_store import RedisRoutingStore

LORAPLEX = str(Path(sys.executable).parent / "loraplex")
POOL = "tiny"


@dataclass
class Up:
    process: subprocess.Popen
    output: Path
    folder: Path
    router: int
    agent: int
    redis: int

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    def lines(self, fragment: str) -> list[str]:
        return [line for line in self.log().splitlines() if fragment in line]

    def store(self) -> RedisRoutingStore:
        return RedisRoutingStore.from_url(f"redis://127.0.0.1:{self.redis}/0", POOL)

    def pid(self, port: int) -> int:
        holder = listener(port)
        assert holder is not None, f"nothing listens on {port}"
        return int(holder.split(":")[0].removeprefix("pid "))


def start_up(tiny_model, tmp_path: Path) -> Up:
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "pool.yaml").write_text(pool_yaml(POOL, tiny_model.base_dir))
    (folder / "a.yaml").write_text(deployment_yaml("a", next(iter(tiny_model.adapters.values())), POOL))
    router, agent, redis = free_port(), free_port_block(1), free_port()
    output = tmp_path / "up.log"
    with output.open("wb") as sink:
        process = subprocess.Popen([LORAPLEX, "up", "--agents", "1", "-f", str(folder), "--port", str(router),
                                    "--agent-base-port", str(agent), "--redis-port", str(redis),
                                    "--workdir", str(tmp_path / "work"), "--heartbeat-ttl", "3"],
                                   stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path)
    up = Up(process, output, folder, router, agent, redis)
    wait_for("loraplex up to be up", lambda: "loraplex is up" in up.log() or process.poll() is not None, 240)
    assert process.poll() is None, up.log()
    return up




@pytest.fixture(scope="module")
def up(tiny_model, tmp_path_factory) -> Iterator[Up]:
    running = start_up(tiny_model, tmp_path_factory.mktemp("up"))
    try:
        yield running
    finally:
        terminate(running.process, 60)


def ready(port: int, path: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_1_a_bad_manifest_is_one_line_and_holds_up_no_other_file(up: Up, tiny_model) -> None:
    source = next(iter(tiny_model.adapters.values()))
    bad = up.folder / "bad.yaml"
    bad.write_text(deployment_yaml("x", source, POOL).replace("{name: x}", '{name: "my adapter"}'))
    (up.folder / "good.yaml").write_text(deployment_yaml("good", source, POOL))
    store = up.store()
    try:
        wait_for("the good file applied and placed", lambda: (t := store.read_table()) and "good" in t.entries, 30)
        time.sleep(3)  # three more ticks
    finally:
        store.close()
    said = up.lines(str(bad))
    assert len(said) == 1 and "invalid adapter name" in said[0], said
    assert "Traceback" not in up.log()
    bad.unlink()


def test_1_a_bad_manifest_at_start_is_one_line_naming_the_file(tiny_model, tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(deployment_yaml("x", next(iter(tiny_model.adapters.values())), POOL)
                                       .replace("{name: x}", '{name: "my adapter"}'))
    result = subprocess.run([LORAPLEX, "up", "-f", str(tmp_path), "--pool", POOL, "--workdir", str(tmp_path / "work"),
                             "--port", str(free_port()), "--agent-base-port", str(free_port_block(3)),
                             "--redis-port", str(free_port())], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert str(tmp_path / "bad.yaml") in lines[0] and "invalid adapter name" in lines[0]
    assert not (tmp_path / "work").exists()  # refused before anything started


def test_2_another_pool_and_a_missing_folder_are_said_once_per_change(up: Up, tiny_model, tmp_path: Path) -> None:
    other = up.folder / "other.yaml"
    other.write_text(deployment_yaml("elsewhere", next(iter(tiny_model.adapters.values())), "another-pool"))
    missing = up.folder / "missing.yaml"
    missing.write_text(deployment_yaml("gone", tmp_path / "no-such-adapter", POOL))
    wait_until(lambda: up.lines(str(missing)) and up.lines(str(other)), 10)
    time.sleep(3)
    (up.folder / "unrelated.yaml").write_text(deployment_yaml("unrelated", next(iter(tiny_model.adapters.values())),
                                                              POOL))
    time.sleep(3)  # the unrelated file is applied; the others did not change
    assert len(up.lines(str(other))) == 1 and "another-pool" in up.lines(str(other))[0]
    assert len(up.lines(str(missing))) == 1 and "not a PEFT adapter folder" in up.lines(str(missing))[0]
    missing.write_text(missing.read_text() + "# edited\n")
    wait_until(lambda: len(up.lines(str(missing))) == 2, 10)  # a change of the file: said again
    for path in (other, missing, up.folder / "unrelated.yaml"):
        path.unlink()


@pytest.mark.parametrize("what", ["router", "agent"])
def test_4_a_dead_child_is_restarted_and_said_in_one_line(up: Up, what: str) -> None:
    port, name, path = (up.router, "router", "/ready") if what == "router" else (up.agent, f"{POOL}-0", "/health")
    os.kill(up.pid(port), signal.SIGKILL)
    said = wait_for(f"the {what}'s exit said", lambda: up.lines(f"{name} exited with status"), 10)
    assert len(said) == 1 and "restarting it in" in said[0], said
    wait_for(f"the {what} back on its port", lambda: ready(port, path), 120)
    assert up.process.poll() is None


def test_3_kill_9_of_up_leaves_nothing_behind(tiny_model, tmp_path: Path) -> None:
    up = start_up(tiny_model, tmp_path)
    try:
        children = {port: up.pid(port) for port in (up.router, up.agent, up.redis)}
        up.process.kill()
        up.process.wait()
        wait_for("every child of up gone", lambda: not any(alive(pid) for pid in children.values()), 30)
        assert not any(in_use(port) for port in children)  # the next `up` on these ports starts
    finally:
        terminate(up.process, 60)
        for pid in children.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--agent-base-port", "65535", "--agents", "2"], "--agent-base-port: agent 1 would listen on port 65536"),
])
def test_5_ports_beyond_65535_are_refused_before_anything_starts(tmp_path: Path, args, fragment) -> None:
    result = subprocess.run([LORAPLEX, "up", *args, "--workdir", str(tmp_path / "work")], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and fragment in lines[0], result.stderr
    assert not (tmp_path / "work").exists()


def test_5_an_adapter_folder_as_model_is_refused_before_anything_starts(tiny_model, tmp_path: Path) -> None:
    adapter = next(iter(tiny_model.adapters.values()))
    result = subprocess.run([LORAPLEX, "up", "--model", str(adapter), "--workdir", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "an adapter folder (adapter_config.json)" in lines[0]
    assert not (tmp_path / "work").exists()


def test_the_backoff_doubles_to_its_cap_and_starts_over_after_a_steady_run(tmp_path: Path) -> None:
    """The Supervisor's schedule alone, with a clock of its own and a child that exits at once."""
    from loraplex_local.processes import Child, Supervisor

    now = [0.0]
    supervisor = Supervisor(first_s=1, max_s=4, steady_s=60, clock=lambda: now[0])
    child = Child("agent", [sys.executable, "-c", "pass"], tmp_path).start()
    child.process.wait()
    waits = []
    for _ in range(4):
        supervisor.check([child])  # says it, and when it starts again
        due = supervisor._due["agent"]
        waits.append(due - now[0])
        now[0] = due
        assert supervisor.check([child]) == [child]
        child.process.wait()
    assert waits == [1, 2, 4, 4]
    now[0] += 61
    child.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    supervisor.check([child])  # seen running
    now[0] += 61
    child.process.kill()
    child.process.wait()
    supervisor.check([child])
    assert supervisor._due["agent"] - now[0] == 1  # a minute up: from the first backoff again
