"""Open batches, one per direction, executor and remote host; sealed on a window, a count, a byte cap or flush."""
from __future__ import annotations

import os
import posixpath
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from staging_core import StagingOptions

from .kept import PackedBatch
from .tasks import BatchSpec


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
    done: Future | None = None
    timer: threading.Timer | None = None
    kept: PackedBatch = field(default_factory=PackedBatch)


class Batcher:
    """Gathers files into batches; thread-safe.

    ``add`` puts a member into the open batch for its key, opening one
    when there is none (its ``opener(batch)`` submits the batch's tasks —
    on the caller's thread, which is the user's submitting thread under
    Parsl — and returns the future of the last one). A batch is sealed
    when it reaches ``max_files`` members or ``max_bytes`` of known sizes,
    ``window`` seconds after it opened, or on ``flush``. A sealed batch is
    released — its manifest resolved to a BatchSpec of the members whose
    gate succeeded — when every gate is done; members whose gate failed
    fail with the gate's error.
    """

    def __init__(self, window: float, max_files: int, max_bytes: int, options: StagingOptions):
        self.window, self.max_files, self.max_bytes, self.options = window, max_files, max_bytes, options
        self.batches: list[Batch] = []
        self._open: dict[BatchKey, Batch] = {}
        self._lock = threading.Lock()

    def add(self, key: BatchKey, host_root: str, member: Member,
            opener: Callable[[Batch], Future]) -> tuple[Future, int, PackedBatch]:
        """Add ``member``; return the future its DataFuture follows, the Parsl task id that stands for it and
        where a packed batch's bundle will be."""
        with self._lock:
            batch = self._open.get(key) or self._start(key, host_root, opener)
            batch.members.append(member)
            batch.nbytes += member.size or 0
            batch.waiting += member.gate is not None
            full = len(batch.members) >= self.max_files or batch.nbytes >= self.max_bytes
        if member.gate is not None:
            member.gate.add_done_callback(lambda _: self._gate_done(batch))
        if full:
            self.seal(batch)
        return member.result or batch.done, batch.done.tid, batch.kept

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

    def _start(self, key: BatchKey, host_root: str, opener: Callable[[Batch], Future]) -> Batch:
        batch = Batch(len(self.batches) + 1, key, host_root)
        batch.done = opener(batch)
        if key.packed:                      # before any DataFuture over it: filled before its apps launch
            batch.done.add_done_callback(batch.kept.fill)
        batch.timer = threading.Timer(self.window, self.seal, (batch,))
        batch.timer.daemon = True
        batch.timer.start()
        self.batches.append(batch)
        self._open[key] = batch
        return batch

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
            if member.gate is not None and member.gate.exception() is not None:
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
    sizes = None if any(m.size is None for m in members) else tuple(m.size for m in members)
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
        if error is None:
            member.result.set_result(done.result())
        else:
            member.result.set_exception(error)
