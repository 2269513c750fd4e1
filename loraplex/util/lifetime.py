"""A child process bound to the life of the process that starts it (Linux): before exec the child asks
the kernel (prctl PR_SET_PDEATHSIG) for SIGTERM when its parent dies, kept across exec, so even
`kill -9` of the parent leaves no child holding a port. The kernel sends it when the *thread* that
forked exits: start such children from a thread that lives as long as the process."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up here (not in the forked child, where only async-signal-safe work is safe)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def die_with_this_process() -> Callable[[], None] | None:
    """`subprocess.Popen(preexec_fn=...)` for a child that gets SIGTERM when this process dies, and
    exits at once if this process died already, between fork and the child's prctl. None where the
    kernel offers no such signal (not Linux)."""
    if _PRCTL is None:
        return None
    parent, prctl = os.getpid(), _PRCTL

    def bind() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return bind
