"""Submitting to kt_ops' background threads while the interpreter exits.

At exit Python shuts every ``ThreadPoolExecutor`` down before it joins the threads still
running, so a (non-daemon) serving thread that outlives the main thread got "cannot
schedule new futures after shutdown" on every call. :func:`submit` runs such work on the
calling thread instead and returns it as a finished ``Future``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import thread as _futures_thread
from typing import Any, Callable


def shutting_down(pool: ThreadPoolExecutor) -> bool:
    """Whether ``pool`` refuses work because it, or the interpreter, is shutting down."""
    return bool(getattr(pool, "_shutdown", False) or getattr(_futures_thread, "_shutdown", False))


def run_now(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on this thread, as a finished ``Future`` (its exception set there, raised
    by ``result()`` as a worker's would be)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as error:
        future.set_exception(error)
    return future


def submit(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
    """``pool.submit(fn, *args)``, or :func:`run_now` when the interpreter's exit shut
    ``pool`` down; any other refusal raises."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        if not shutting_down(pool):
            raise
        return run_now(fn, *args)
