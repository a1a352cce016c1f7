"""Run per-shard work on N forked worker processes (or inline for one), results in submission order."""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator


def default_jobs() -> int:
    """Number of CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def ordered_map(func: Callable, items: Iterable, jobs: int, initializer: Callable, initargs: tuple,
                window: int | None = None) -> Iterator:
    """Yield ``func(item)`` for every item, in order, computed by ``jobs`` workers.

    Workers are forked after ``initializer(*initargs)`` has run in this process,
    so large shared state (the index) reaches them without pickling; the
    initializer also runs in-process when ``jobs`` is 1. At most ``window``
    items are in flight. The first exception raised by ``func`` propagates
    and the pending work is cancelled. On Linux a worker is killed when the
    thread that started it (the one first advancing this generator) ends —
    in particular when this process dies, even by ``kill -9`` — so no orphan
    keeps inherited pipes (an ssh stream, a lock) open.
    """
    initializer(*initargs)
    if jobs <= 1:
        for item in items:
            yield func(item)
        return
    window = window or 2 * jobs
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append(pool.submit(func, item))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Worker initializer: ask Linux to kill this worker when the thread that forked it ends."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:        # it died before the request took effect
        os._exit(1)
