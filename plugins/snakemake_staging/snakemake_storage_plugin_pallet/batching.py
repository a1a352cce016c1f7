"""Gather the requests of one Snakemake scheduler round and hand them to a worker thread as one batch."""
from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Request = TypeVar("Request")
Runner = Callable[[list], Mapping[int, Exception]]


@dataclass(frozen=True)
class Limits:
    """When a batch closes: ``window`` seconds after it opened at the earliest (0: as soon as the round is
    handed over), at once at ``max_items`` requests or ``max_bytes`` bytes (0/None: no limit)."""

    window: float = 0.0
    max_items: int = 0
    max_bytes: int | None = None


@dataclass
class _Open:
    """The batch being gathered on one event loop."""

    requests: list = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)
    nbytes: int = 0


class Batcher(Generic[Request]):
    """Turns concurrent :meth:`submit` calls into calls of ``run(requests)``.

    Snakemake starts the retrievals (or stores) of one scheduler round as
    tasks of one asyncio TaskGroup; each calls ``submit``, which returns
    when its batch is done. A batch closes once the event loop has run every
    task that was ready when it opened and no new request arrived in a whole
    pass (so a round is one batch), but not before ``window`` seconds; it
    closes at once when it reaches ``max_items`` or ``max_bytes``. ``run``
    is blocking and runs in a worker thread (``asyncio.to_thread``), so the
    event loop stays free while it works; it returns the exception to raise for each failed request, by index, and
    should not raise itself (if it does, every request of the batch raises
    that error). Requests whose task was cancelled before their batch
    started (a TaskGroup aborting) are left out. Each event loop (Snakemake
    makes several) has its own open batch.
    """

    def __init__(self, run: Runner, limits: Limits = Limits()):
        self._run = run
        self._limits = limits
        self._open: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Open] = weakref.WeakKeyDictionary()
        self._running: set[asyncio.Task] = set()

    async def submit(self, request: Request, nbytes: int = 0) -> None:
        """Add ``request`` to the open batch and wait until that batch has run; raise its error if it failed."""
        loop = asyncio.get_running_loop()
        batch = self._open.get(loop)
        if batch is None:
            batch = self._open[loop] = _Open()
            loop.call_soon(self._settle, loop, batch, 0, loop.time() + self._limits.window)
        future = loop.create_future()
        batch.requests.append(request)
        batch.futures.append(future)
        batch.nbytes += nbytes
        if self._full(batch):
            self._close(loop, batch)
        await future

    def _full(self, batch: _Open) -> bool:
        limits = self._limits
        return bool(limits.max_items and len(batch.requests) >= limits.max_items
                    or limits.max_bytes and batch.nbytes >= limits.max_bytes)

    def _settle(self, loop: asyncio.AbstractEventLoop, batch: _Open, seen: int, deadline: float) -> None:
        """Close ``batch`` once a whole loop pass added nothing to it and the window has passed."""
        if self._open.get(loop) is not batch:
            return                                   # already closed by a limit
        if len(batch.requests) != seen:
            loop.call_soon(self._settle, loop, batch, len(batch.requests), deadline)
        elif loop.time() < deadline:
            loop.call_at(deadline, self._settle, loop, batch, -1, deadline)
        else:
            self._close(loop, batch)

    def _close(self, loop: asyncio.AbstractEventLoop, batch: _Open) -> None:
        del self._open[loop]
        task = loop.create_task(self._execute(batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _execute(self, batch: _Open) -> None:
        live = [(request, future) for request, future in zip(batch.requests, batch.futures, strict=True)
                if not future.done()]
        if not live:
            return                                   # every task of the round was cancelled before it started
        requests = [request for request, _ in live]
        try:
            failures = await asyncio.to_thread(self._run, requests)
        except Exception as exc:
            failures = {n: exc for n in range(len(requests))}
        for n, (_, future) in enumerate(live):
            if future.done():                        # its task was cancelled meanwhile
                continue
            if n in failures:
                future.set_exception(failures[n])
            else:
                future.set_result(None)
