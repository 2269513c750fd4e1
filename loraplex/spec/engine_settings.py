"""Each engine setting declared once: its name, type, default, bounds and help.

A setting's snake_case name is the AdapterPool's `spec.engine` field (camelCase in YAML), the
`loraplex agent` flag (kebab case), its argparse dest and the pool ConfigMap's `LORAPLEX_*` variable.
The CRD model (`EngineSpec`), the agent's arguments, the flag translator both the operator and
`loraplex up` use (`agent_flags`) and the table in docs/engine.md all derive from `ENGINE_SETTINGS`.
`AGENT_SETTINGS` are the engine's own flags that no `spec.engine` field of that name sets (the agent,
`loraplex profile` and the benchmarks take them; a pool passes them in `engine.extraArgs`, or through
`schedulerOptions`, `memoryOptions`, `prefixCache` and `baseModel.dtype`), declared the same way.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

NAME_PATTERN = r"^[a-z][a-z0-9-]{0,31}$"  # a policy named in a CRD: refused with a reason if unknown


@dataclass(frozen=True)
class EngineSetting:
    name: str
    type: Callable[[str], Any]
    default: Any
    help: str                                # the flag's help (`loraplex agent --help`)
    description: str | None = None          # the CRD field's (None: the schema gives none)
    choices: tuple[str, ...] = ()            # the flag's choices (the CRD checks a pattern, the operator the name)
    constraints: Mapping[str, Any] = field(default_factory=dict)  # the CRD field's bounds: ge, le, gt, pattern
    flag_name: str = ""                      # when the flag is not the name in kebab case
    metavar: str | None = None
    action: str | None = None                # "store_true" (a switch) or "append" (repeatable); None: a value

    @property
    def flag(self) -> str:
        return "--" + (self.flag_name or self.name.replace("_", "-"))

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def env(self) -> str:
        """The pool ConfigMap's variable that carries the value (the pod's args say `$(env)`)."""
        return "LORAPLEX_" + self.dest.upper()

    def crd_field(self) -> Any:
        """The pydantic field of `EngineSpec`."""
        return Field(self.default, description=self.description, **self.constraints)

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup, **overrides: Any) -> None:
        """The flag; a command whose default or help differs (a benchmark's own) says so in `overrides`."""
        if self.action == "store_true":
            parser.add_argument(self.flag, **({"action": "store_true", "help": self.help} | overrides))
            return
        bounds = {k: v for k, v in self.constraints.items() if k in ("ge", "le", "gt")}
        kind = bounded(self.type, **bounds) if bounds else self.type  # the CRD's bounds, on the flag too
        options: dict[str, Any] = {"type": kind, "default": self.default, "help": self.help}
        if self.action == "append":
            options |= {"action": "append", "default": list(self.default)}  # a list of its own per parser
        if self.choices:
            options["choices"] = list(self.choices)
        if self.metavar:
            options["metavar"] = self.metavar
        parser.add_argument(self.flag, **(options | overrides))


def bounded(kind: type, ge: float | None = None, le: float | None = None,
            gt: float | None = None) -> Callable[[str], int | float]:
    """A flag's type: a finite number within the bounds the setting declares for its CRD field, so the
    flag refuses what the AdapterPool refuses (`loraplex agent --max-lora-rank 0`)."""
    def convert(text: str) -> int | float:
        value = kind(text)
        if (not math.isfinite(value) or (ge is not None and value < ge) or (le is not None and value > le)
                or (gt is not None and value <= gt)):
            raise ValueError(text)
        return value

    parts = [f">= {ge}" if ge is not None else "", f"> {gt}" if gt is not None else "",
             f"<= {le}" if le is not None else ""]
    convert.__name__ = f"{kind.__name__} ({', '.join(p for p in parts if p)})"  # "invalid int (>= 1) value"
    return convert


def _int(name: str, default: int | None, help: str, description: str | None = None, **constraints: Any) -> EngineSetting:
    return EngineSetting(name, int, default, help, description, constraints=constraints)


def _named(name: str, default: str, choices: tuple[str, ...], help: str, description: str) -> EngineSetting:
    return EngineSetting(name, str, default, help, description, choices, {"pattern": NAME_PATTERN})


ENGINE_SETTINGS: dict[str, EngineSetting] = {s.name: s for s in (
    _int("max_model_len", None, "default: the model's own limit", "Default: the model's own limit", ge=16),
    _int("max_lora_rank", 64, "largest adapter rank served (default 64; `loraplex agent`: 64, or the largest rank "
         "of its --adapter folders if larger). A runtime load above it is refused", ge=1, le=512),
    _int("max_loras", 8, "adapter slots carved out of device memory under --memory-policy lru-static",
         "Adapter slots under memoryPolicy lru-static", ge=1),
    _int("max_num_seqs", 64, "requests in the running batch", ge=1),
    _int("max_num_batched_tokens", 512, "tokens one step computes at most; longer prompts are chunked", ge=16),
    _int("long_prefill_token_threshold", 0, "tokens of one prompt a step computes at most (0: the whole "
         "--max-num-batched-tokens), so a short prompt that arrives during a long one's prefill shares the next "
         "step instead of waiting for the long one to finish (vLLM's flag of that name)",
         "Tokens of one prompt a step computes at most (0: the whole maxNumBatchedTokens)", ge=0),
    _int("block_size", 16, "tokens per KV block (page)", ge=1),
    EngineSetting("kv_cache_memory_gib", float, None, "memory for the KV cache and the adapter slots in GiB (used "
                  "when --num-blocks is not given)", "Default: sized from free memory", constraints={"gt": 0},
                  flag_name="kv-cache-memory", metavar="GIB"),
    _named("scheduler", "fifo", ("fifo", "sjf", "vtc", "chameleon"), "engine scheduler (docs/engine.md, Schedulers)",
           "Engine scheduler by name"),
    _named("memory_policy", "unified", ("unified", "lru-static", "no-cache"),
           "adapters and KV in one page pool with a prefix cache and an adapter cache (unified), vLLM's fixed "
           "slots (lru-static) or S-LoRA's drop-when-idle (no-cache); docs/engine.md",
           "unified (one page pool, prefix and adapter cache), lru-static or no-cache"),
)}


AGENT_SETTINGS: dict[str, EngineSetting] = {s.name: s for s in (
    EngineSetting("dtype", str, "auto", "the weights' dtype: auto is the checkpoint's on CUDA and float32 on the CPU",
                  choices=("auto", "float32", "bfloat16", "float16")),
    EngineSetting("device", str, "auto", "cpu, cuda, cuda:N or auto (CUDA when available)"),
    _int("num_blocks", None, "KV blocks; default: sized from memory", ge=1),
    EngineSetting("scheduler_option", str, (), "a knob of the scheduler, e.g. refresh_s=60 or slo_s=2 (repeatable)",
                  metavar="KEY=VALUE", action="append"),
    EngineSetting("no_prefix_cache", bool, False, "do not reuse the KV of earlier requests", action="store_true"),
    _int("num_host_blocks", None, "host-memory KV blocks that evicted prefixes move to (default: as many as the "
         "device has; 0 drops evicted KV)", ge=0),
    EngineSetting("memory_option", str, (), "a knob of the memory policy, e.g. busy=0.9 or score=chameleon "
                  "(repeatable)", metavar="KEY=VALUE", action="append"),
    EngineSetting("emulate_h2d_gbps", float, None, "EMULATION: charge every host->device byte at this bandwidth "
                  "(e.g. 25 for PCIe 4.0 x16), so that a CPU-only machine shows what adapter and KV copies cost "
                  "on a GPU server", constraints={"gt": 0}, metavar="GBPS"),
    EngineSetting("cpu_assist", str, "auto", "run a request whose adapter is still being copied in, computing its "
                  "LoRA terms on the CPU for the layers not on the device yet (Toppings; auto: on with CUDA or "
                  "--emulate-h2d-gbps); docs/engine.md", choices=("auto", "on", "off")),
    EngineSetting("pinned_adapter_memory_gib", float, 8.0, "page-locked host memory for adapters on CUDA, so their "
                  "copies to the device are asynchronous DMA; the adapters least recently loaded past it copy from "
                  "pageable memory", constraints={"ge": 0}, flag_name="pinned-adapter-memory", metavar="GIB"),
    EngineSetting("enforce_eager", bool, False, "no CUDA graphs for decode steps (as vLLM's flag; they are used on "
                  "CUDA otherwise)", action="store_true"),
    _int("threads", None, "torch CPU threads (default: OMP_NUM_THREADS, else 1 for small models, else all CPUs)",
         ge=1),
)}


def add_agent_settings(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The engine's own flags (`AGENT_SETTINGS`)."""
    for setting in AGENT_SETTINGS.values():
        setting.add_to(parser)


def add_engine_settings(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str,
                        **overrides: Mapping[str, Any]) -> None:
    """The named settings' flags (all of them without names); `overrides[name]` changes one flag's
    default or help for a command whose meaning differs, e.g. `max_loras={"default": None}`."""
    for name in names or ENGINE_SETTINGS:
        ENGINE_SETTINGS[name].add_to(parser, **overrides.get(name, {}))


def settings_table() -> str:
    """The markdown table of docs/engine.md ("Engine settings"), checked against this in the tests."""
    rows = ["| AdapterPool `spec.engine` | `loraplex agent` flag | default | meaning |", "|---|---|---|---|"]
    for s in ENGINE_SETTINGS.values():
        camel = s.name.split("_")[0] + "".join(w.title() for w in s.name.split("_")[1:])
        default = "—" if s.default is None else f"`{s.default}`"
        choices = f" ({', '.join(s.choices)})" if s.choices else ""
        rows.append(f"| `{camel}` | `{s.flag}` | {default} | {s.help}{choices} |")
    return "\n".join(rows)
