"""The vLLM OpenAI server as a child process of the agent (`loraplex agent --backend vllm` without
`--vllm-url`; in Kubernetes it is a second container of the pod instead). Its command line is
loraplex.backends.vllm's, as the operator renders it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from loraplex.backends.vllm import VllmLaunch, plugin_sources, vllm_argv, vllm_env
from loraplex.util.lifetime import die_with_this_process


def install_plugin(folder: Path) -> Path:
    """Write the plug-in modules into `folder`, for vLLM's PYTHONPATH."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in plugin_sources().items():
        (folder / name).write_text(source)
    return folder


def child_env(launch: VllmLaunch, plugin_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The agent's environment for vLLM, with PYTHONPATH the plug-in folder only (not ours)."""
    return {**(os.environ if base is None else base), **vllm_env(launch, str(plugin_dir)), "PYTHONUNBUFFERED": "1"}


class VllmProcess:
    def __init__(self, launch: VllmLaunch, plugin_dir: Path, log_path: Path, env: dict[str, str] | None = None) -> None:
        """`env`: variables added to the agent's environment for vLLM (e.g. VLLM_CPU_KVCACHE_SPACE)."""
        self.launch = launch
        self.plugin_dir = plugin_dir
        self.log_path = log_path
        self.env = env or {}
        self.process: subprocess.Popen | None = None

    def start(self) -> VllmProcess:
        install_plugin(self.plugin_dir)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            # A session of its own: stop() signals the API server and its engine-core processes together.
            # Bound to the agent's life: SIGTERM when it dies, even by SIGKILL (the agent's main thread
            # starts it and outlives it).
            env = child_env(self.launch, self.plugin_dir, {**os.environ, **self.env})
            self.process = subprocess.Popen(vllm_argv(self.launch), env=env,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=die_with_this_process())
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, timeout_s: float = 30.0) -> None:
        if not self.alive:
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait()

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def exit_reason(self) -> str:
        """Why it stopped, in one line: the signal that killed it, or its status and the last line of its
        log that looks like an error."""
        code = self.returncode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"the vLLM server was killed by signal {-code} ({signal.Signals(-code).name})"
        errors = [ln.strip() for ln in self.tail(60).splitlines() if "Error" in ln or "error" in ln]
        return f"the vLLM server exited with status {code}" + (f": {errors[-1][:400]}" if errors else "")
