"""Run per-shard work on a pool of worker processes started by exec (never fork), results in submission order."""
from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

from . import native
from .errors import WorkerError
from .workers import receive_message, send_message

# Measured on a 2-core machine: a worker is ready about 60 ms after it is started (interpreter start,
# imports of zstandard and xxhash, no site processing); work estimated below INLINE_SECONDS runs inline, in the
# calling thread.
WORKER_START_SECONDS = 0.06
INLINE_SECONDS = 4 * WORKER_START_SECONDS

_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); from bundles.workers import serve; "
         "serve(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))")


def default_jobs() -> int:
    """Number of CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def jobs_for(estimated_seconds: float, requested: int) -> int:
    """How many workers to use for work estimated at ``estimated_seconds`` in one process.

    ``requested`` > 0 is obeyed (a user's ``--jobs N``). 0 means automatic:
    one worker per CPU, or 1 (inline, no worker started) when the work is
    too small to repay starting workers.
    """
    if requested > 0:
        return requested
    return 1 if estimated_seconds < INLINE_SECONDS else default_jobs()


@contextmanager
def pool_for(pool: WorkerPool | None, jobs: int) -> Iterator[WorkerPool]:
    """``pool`` itself (left open for its owner), or a new pool of ``jobs`` workers closed on exit."""
    if pool is not None:
        yield pool
        return
    with WorkerPool(jobs, native.releases_gil()) as own:
        yield own


def _worker_path() -> list[str]:
    """The workers' ``sys.path``: the directory holding this package (even when an editable install finds it
    through an import hook, which ``-S`` leaves out), then this process's own path."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [here, *(p for p in sys.path if p and p != here)]


class _Worker:
    """One worker process and the two pipes that feed it tasks and bring back results."""

    def __init__(self):
        task_r, self.task_w = os.pipe()
        self.result_r, result_w = os.pipe()
        os.set_inheritable(task_r, True)
        os.set_inheritable(result_w, True)
        try:
            argv = [sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(_worker_path()),
                    str(task_r), str(result_w), str(os.getpid())]
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, pass_fds=(task_r, result_w))
        except BaseException:
            os.close(self.task_w)
            os.close(self.result_r)
            raise
        finally:
            os.close(task_r)
            os.close(result_w)

    def call(self, func: Callable, item: object) -> object:
        try:
            send_message(self.task_w, (func, item))
            ok, value = receive_message(self.result_r)
        except (EOFError, BrokenPipeError):
            raise self._died() from None
        if not ok:
            raise value
        return value

    def _died(self) -> WorkerError:
        status = self.process.wait()
        how = f"signal {-status}" if status < 0 else f"exit status {status}"
        return WorkerError(f"a worker process ended unexpectedly ({how})", None,
                           "rerun; if it happens again, run with --jobs 1 to work in one process")

    def stop(self) -> None:
        """Close the pipes (the worker exits when it reads EOF) and reap it, killing it if it lingers."""
        os.close(self.task_w)
        os.close(self.result_r)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class WorkerPool:
    """``jobs`` worker processes owned by one operation; with ``jobs`` <= 1 all work runs inline.

    With ``in_threads`` the work runs on ``jobs`` threads of this process
    instead, for work that releases the GIL (the native engine's loops, the
    codecs): no process is started and nothing is pickled.

    Workers are started with ``posix_spawn``/``exec`` (``subprocess``), never
    by forking this process, so a host running threads (Snakemake, Parsl, a
    user's thread pool) is safe: no lock or pipe of another thread is copied
    into them, and they inherit only their own two pipes. They import the
    same modules as this process (its ``sys.path``), and get everything a
    task needs from the task itself: ``func`` must be a module-level function
    and ``item`` picklable. A worker dies with the thread that started it,
    even on ``kill -9`` of this process. Workers start on the first
    :meth:`map` that needs them, or at :meth:`start` to overlap their start
    with other work. Use the pool from one thread at a time; close it (or use
    it as a context manager) to stop the workers.
    """

    def __init__(self, jobs: int, in_threads: bool = False):
        self.jobs = max(1, jobs)
        self.in_threads = in_threads
        self._workers: list[_Worker] = []
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: ThreadPoolExecutor | None = None
        self._aborted = False

    @property
    def started(self) -> bool:
        """True once worker processes run (never for an inline pool)."""
        return self._threads is not None

    def start(self) -> WorkerPool:
        """Start the worker processes now (no-op inline or when already started)."""
        if self.jobs > 1 and self._threads is None:
            self._threads = ThreadPoolExecutor(self.jobs, thread_name_prefix="pallet-worker")
            for _ in range(0 if self.in_threads else self.jobs):
                worker = _Worker()
                self._workers.append(worker)
                self._idle.put(worker)
        return self

    def map(self, func: Callable, items: Iterable, inline: bool = False, window: int | None = None,
            ordered: bool = True) -> Generator[Any, None, None]:
        """Yield ``func(item)`` for every item; at most ``window`` (default 2·jobs) items are in flight.

        Results come in the order of ``items``, or as they finish when
        ``ordered`` is False. ``inline`` runs this map in the calling thread
        even if the pool has workers (small work). Items are drawn from
        ``items`` only as room opens in the window. The first exception
        raised by ``func`` propagates (re-raised here, with its type) and the
        pending work is cancelled; closing the generator early cancels it too.
        """
        if inline or self.jobs <= 1:
            return (func(item) for item in items)
        self.start()
        return self._map_on_workers(func, iter(items), window or 2 * self.jobs, ordered)

    def _map_on_workers(self, func: Callable, items: Iterator, window: int, ordered: bool
                        ) -> Generator[Any, None, None]:
        threads = self._threads
        assert threads is not None, "map() starts the pool first"
        pending: deque = deque()
        try:
            while True:
                for item in itertools.islice(items, window - len(pending)):
                    pending.append(threads.submit(self._call, func, item))
                if not pending:
                    return
                if ordered:
                    yield pending.popleft().result()
                    continue
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    pending.remove(future)
                    yield future.result()
        finally:
            if pending:
                self._aborted = True
                for future in pending:
                    future.cancel()

    def _call(self, func: Callable, item: object) -> object:
        if self.in_threads:
            return func(item)
        worker = self._idle.get()
        try:
            return worker.call(func, item)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        """Stop every worker: at once if work was abandoned, else once it has read its pipe to the end."""
        if self._aborted:
            for worker in self._workers:
                worker.process.kill()
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
            self._threads = None
        for worker in self._workers:
            worker.stop()
        self._workers.clear()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._aborted = self._aborted or exc_type is not None
        self.close()
