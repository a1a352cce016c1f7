"""Open batches, one per direction, executor and remote host; sealed when submission pauses, at a cap, or on flush."""
from __future__ import annotations

import os
import posixpath
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import cast

from parsl.dataflow.futures import AppFuture

from staging_core import StagingOptions

from .kept import PackedBatch
from .tasks import BatchSpec

IDLE_FACTOR = 4        # a pause ends a wave only if it is also this many times the longest gap between its files
IDLE_CAP = 10          # ... up to this many times ``idle``
MIN_TICK = 0.02        # seconds: the shortest wait between two looks at an open batch


@dataclass(frozen=True)
class Activity:
    """How the batcher sees whether a wave of submissions goes on: ``count()``, the submissions made so far (it
    moves while apps are submitted), and ``ongoing()``, whether a submission is in progress right now."""

    count: Callable[[], int]
    ongoing: Callable[[], bool]


@dataclass(frozen=True)
class BatchKey:
    """What the files of one batch share. ``gated``: its members wait for an upstream future (the app that
    writes an output, or the upstream output an input is) and are kept apart from files ready now;
    ``packed``: the batch is kept as one bundle (``keep_packed``)."""

    direction: str
    executor: str
    scheme: str
    netloc: str
    gated: bool
    packed: bool = False


@dataclass
class Member:
    """One file of a batch: absolute remote path, absolute local path, size if known, the future it waits
    for (None: ready now) and, when it waits, its own result future (it may fail alone)."""

    path: str
    local: str
    size: int | None = None
    gate: Future | None = None
    result: Future | None = None


@dataclass
class Batch:
    """A batch being filled. ``manifest`` resolves to its BatchSpec once it is sealed and every gate is done;
    its tasks, submitted when it opened, wait for it. ``done`` is the future of its last task; ``kept`` says
    where the apps of a packed batch find its bundle once ``done``."""

    number: int
    key: BatchKey
    host_root: str
    members: list[Member] = field(default_factory=list)
    nbytes: int = 0
    waiting: int = 0
    sealed: bool = False
    released: bool = False
    manifest: Future = field(default_factory=Future)
    done: Future = field(default_factory=Future)     # replaced, as the batch opens, by its opener's future
    timer: threading.Timer | None = None
    kept: PackedBatch = field(default_factory=PackedBatch)
    activity: Activity | None = None
    opened: float = 0.0         # time.monotonic() when it opened
    last: float = 0.0           # ... of the latest sign of submission: a file added or submissions seen going on
    arrived: float = 0.0        # ... of its latest file
    longest: float = 0.0        # the longest gap between two of its files with no submission seen in between
    busy_between: bool = False  # submissions were seen going on since its latest file
    submitted: int = 0          # activity.count() at the latest look


class Batcher:
    """Gathers files into batches; thread-safe.

    ``add`` puts a member into the open batch for its key, opening one
    when there is none (its ``opener(batch)`` submits the batch's tasks —
    on the caller's thread, which is the user's submitting thread under
    Parsl — and returns the future of the last one). A batch is sealed
    when submission pauses: no file added and no submission seen going on
    (``activity``) for ``idle`` seconds, or for ``IDLE_FACTOR`` times the
    longest gap between its files if that is longer (at most ``IDLE_CAP``
    times ``idle``); when it reaches ``max_files`` members or ``max_bytes``
    of known sizes; ``window`` seconds after it opened (None: no age
    limit); or on ``flush``. A timer thread looks at an open batch now and
    then; adding a file only notes the time. A sealed batch is released —
    its manifest resolved to a BatchSpec of the members whose gate
    succeeded — when every gate is done; members whose gate failed fail
    with the gate's error.
    """

    def __init__(self, idle: float, window: float | None, max_files: int, max_bytes: int, options: StagingOptions):
        self.idle, self.window, self.max_files, self.max_bytes = idle, window, max_files, max_bytes
        self.options = options
        self.batches: list[Batch] = []
        self._open: dict[BatchKey, Batch] = {}
        self._lock = threading.Lock()

    def add(self, key: BatchKey, host_root: str, member: Member, opener: Callable[[Batch], Future],
            activity: Activity | None = None) -> tuple[Future, int, PackedBatch]:
        """Add ``member``; return the future its DataFuture follows, the Parsl task id that stands for it and
        where a packed batch's bundle will be. ``activity`` tells a new batch whether submission goes on."""
        with self._lock:
            now = time.monotonic()
            batch = self._open.get(key) or self._start(key, host_root, opener, activity, now)
            if batch.members and not batch.busy_between:
                batch.longest = max(batch.longest, now - batch.arrived)
            batch.arrived = batch.last = now
            batch.busy_between = False
            batch.members.append(member)
            batch.nbytes += member.size or 0
            batch.waiting += member.gate is not None
            full = len(batch.members) >= self.max_files or batch.nbytes >= self.max_bytes
        if member.gate is not None:
            member.gate.add_done_callback(lambda _: self._gate_done(batch))
        if full:
            self.seal(batch)
        return member.result or batch.done, cast(AppFuture, batch.done).tid, batch.kept

    def seal(self, batch: Batch) -> None:
        """Take no more members into ``batch``; release it if nothing is awaited."""
        with self._lock:
            if self._open.get(batch.key) is batch:
                del self._open[batch.key]
            batch.sealed = True
            if batch.timer:
                batch.timer.cancel()
        self._release(batch)

    def flush(self) -> None:
        """Seal every open batch now."""
        with self._lock:
            pending = list(self._open.values())
        for batch in pending:
            self.seal(batch)

    def pause(self, batch: Batch) -> float:
        """How long submission must pause to end ``batch``'s wave."""
        return min(max(self.idle, IDLE_FACTOR * batch.longest), IDLE_CAP * self.idle)

    def _start(self, key: BatchKey, host_root: str, opener: Callable[[Batch], Future], activity: Activity | None,
               now: float) -> Batch:
        batch = Batch(len(self.batches) + 1, key, host_root, activity=activity, opened=now, last=now, arrived=now)
        batch.done = opener(batch)
        batch.submitted = activity.count() if activity else 0      # its own tasks are not the user's submissions
        if key.packed:                      # before any DataFuture over it: filled before its apps launch
            batch.done.add_done_callback(batch.kept.fill)
        self.batches.append(batch)
        self._open[key] = batch
        self._look_again(batch, now)
        return batch

    def _look_again(self, batch: Batch, now: float) -> None:
        """Arm ``batch``'s timer: at the end of the pause counted from its latest sign of submission, or sooner
        (half a pause) while submissions go on, never past its age limit."""
        pause = self.pause(batch)
        delay = min(pause / 2 if batch.last >= now else batch.last + pause - now, pause)
        if self.window is not None:
            delay = min(delay, batch.opened + self.window - now)
        batch.timer = threading.Timer(max(delay, MIN_TICK), self._look, (batch,))
        batch.timer.daemon = True
        batch.timer.start()

    def _look(self, batch: Batch) -> None:
        """The timer's look at an open batch: seal it once submission has paused long enough, or it is too old."""
        activity = batch.activity
        submitted = activity.count() if activity else 0
        ongoing = activity is not None and (submitted != batch.submitted or activity.ongoing())
        with self._lock:
            if batch.sealed:
                return
            now = time.monotonic()
            batch.submitted = submitted
            if ongoing:
                batch.last, batch.busy_between = now, True
            old = self.window is not None and now - batch.opened >= self.window
            if not old and now - batch.last < self.pause(batch):
                self._look_again(batch, now)
                return
        self.seal(batch)

    def _gate_done(self, batch: Batch) -> None:
        with self._lock:
            batch.waiting -= 1
        self._release(batch)

    def _release(self, batch: Batch) -> None:
        with self._lock:
            if batch.released or not batch.sealed or batch.waiting:
                return
            batch.released = True
        kept = [m for m in batch.members if m.gate is None or m.gate.exception() is None]
        for member in batch.members:
            if member.gate is not None and member.gate.exception() is not None and member.result is not None:
                member.result.set_exception(member.gate.exception())
        waiting = [m for m in kept if m.result is not None]
        if waiting:
            batch.done.add_done_callback(lambda done: _settle(done, waiting))
        batch.manifest.set_result(spec_for(batch, kept, self.options))


def spec_for(batch: Batch, members: list[Member], options: StagingOptions) -> BatchSpec:
    """The BatchSpec of ``members``: both roots at their deepest common directory, items relative to it."""
    if not members:
        return BatchSpec(batch.number, "", batch.key.direction, "", batch.host_root, (), None, options,
                         state_root(batch.host_root), batch.key.packed)
    common = posixpath.commonpath([posixpath.dirname(m.path) for m in members])
    items = tuple(posixpath.relpath(m.path, common) for m in members)
    remote_root = f"{batch.key.scheme}://{batch.key.netloc}{common}"
    local_root = os.path.join(batch.host_root, common.lstrip("/"))
    known = tuple(m.size for m in members if m.size is not None)
    sizes = known if len(known) == len(members) else None
    ident = BatchSpec.ident(batch.key.direction, remote_root, local_root, items, batch.key.packed)
    return BatchSpec(batch.number, ident, batch.key.direction, remote_root, local_root, items, sizes, options,
                     state_root(batch.host_root), batch.key.packed)


def state_root(host_root: str) -> str:
    """Where a batch's markers and bundles in transit live: ROOT/.pallet/parsl, beside the mirrored trees
    (``ROOT/host[:port]/...``), so none of them ever holds a file of pallet's."""
    return os.path.join(os.path.dirname(host_root), ".pallet", "parsl")


def _settle(done: Future, members: list[Member]) -> None:
    error = done.exception()
    for member in members:
        if member.result is None:
            continue
        if error is None:
            member.result.set_result(done.result())
        else:
            member.result.set_exception(error)
