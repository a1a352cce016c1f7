"""Items produced on a thread of their own, a few ahead of the thread that reads them."""
from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
_POLL_SECONDS = 0.05


class ReadAhead(Generic[Item]):
    """``produce()`` called on a thread, its results queued at most ``depth`` ahead of :meth:`next`.

    ``produce`` returns the next item, or None at the end; an Exception it
    raises ends the production and is raised by :meth:`next`, in the reading
    thread. After the end or an error, ``next`` returns None or raises that
    error again on every call. Use it as a context manager: leaving it stops
    the thread after its current ``produce`` call, and with ``join`` waits for
    that call too (only for producers whose calls end on their own, such as
    reads of a local file, not of a pipe that may stall).
    """

    def __init__(self, produce: Callable[[], Item | None], depth: int, name: str, join: bool = False):
        self._produce, self._join = produce, join
        self._queue: queue.Queue = queue.Queue(depth)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> ReadAhead[Item]:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stopped.set()
        while self._join and self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=_POLL_SECONDS)     # unblock a put, drop what was produced

    def next(self) -> Item | None:
        item = self._queue.get()
        if item is None or isinstance(item, Exception):
            self._queue.put_nowait(item)        # the producer has stopped: the end or the error stays
            if item is not None:
                raise item
        return item

    def _run(self) -> None:
        while not self._stopped.is_set():
            item: Item | Exception | None
            try:
                item = self._produce()
            except Exception as exc:            # raised by next(), in the reading thread
                item = exc
            self._put(item)
            if item is None or isinstance(item, Exception):
                return

    def _put(self, item: Item | Exception | None) -> None:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return
            except queue.Full:
                continue
