"""Triton's interpreter on the CPU, as the kernel tests and the GPU run's rehearsal use it."""

from __future__ import annotations


def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with `int(array)`, which numpy
    >= 2.4 rejects for its 1-element arrays, so `range(lo, hi)` over loaded scalars fails
    (triton-lang/triton#9171, fixed upstream after 3.6). Converting through `.squeeze()` is the
    upstream fix; it is applied only where the bug shows."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_loraplex_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._loraplex_patched = True
    interpreter._patch_lang_tensor = patched
