"""Compile the Triton kernels a call launches in parallel, before it runs.

A forward compiles its kernels one after the other as it reaches them, in the launching thread. Triton's
compiler spends most of its time outside the GIL (its passes and ptxas), so `compile_ahead(call)` runs the call
once with every Triton launch turned into a compile submitted to a thread pool (Triton's asynchronous compile
mode), waits for them all, and leaves the compiled kernels in Triton's caches: the caller's real run then
launches them at once. The dry run launches no kernel, so its other operations compute from unwritten memory:
`call` must be one whose real run writes, before reading it, whatever the dry run may write (a forward over a
round does: its saves never overwrite what the round reads). Where Triton has no asynchronous compile mode, or
under the interpreter, it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from triton.runtime.jit import JITFunction

try:
    from triton.runtime._async_compile import AsyncCompileMode, active_mode
except ImportError:  # a Triton without it compiles in the launching thread
    AsyncCompileMode = active_mode = None

WORKERS = max(1, min(16, os.cpu_count() or 1))  # compile threads


def available() -> bool:
    """Whether calls can be compiled ahead here (a Triton with the asynchronous compile mode, not interpreted)."""
    return AsyncCompileMode is not None and os.environ.get("TRITON_INTERPRET") != "1"


def compile_ahead(call: Callable[[], object]) -> None:
    """Compile every Triton kernel `call` launches (with the arguments it launches them with) on WORKERS
    threads, without running any; returns when all are compiled (a compile error is raised here)."""
    if not available():
        return
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="flide-compile") as pool, AsyncCompileMode(pool) as mode, \
            _launches_compile_only(mode):
        call()


_LAUNCH = JITFunction.__getitem__
_COMPILING: set[AsyncCompileMode] = set()  # the modes whose threads compile instead of launching
_LOCK = threading.Lock()  # engines on several devices compile ahead at once


def _compile_only(self: JITFunction, grid: object) -> Callable[..., object]:
    """`kernel[grid](...)`: Triton's own warm-up call (a compile submitted to the thread's mode) in a thread
    compiling ahead; the launch elsewhere."""
    if active_mode.get() not in _COMPILING:
        return _LAUNCH(self, grid)
    return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=True, **kwargs)


@contextlib.contextmanager
def _launches_compile_only(mode: AsyncCompileMode) -> Iterator[None]:
    """Launches compile without running in this thread while `mode` is its active compile mode; other threads
    launch as usual (Triton's launch is replaced while any thread compiles ahead)."""
    with _LOCK:
        _COMPILING.add(mode)
        JITFunction.__getitem__ = _compile_only
    try:
        yield
    finally:
        with _LOCK:
            _COMPILING.discard(mode)
            if not _COMPILING:
                JITFunction.__getitem__ = _LAUNCH
