"""Streamed bundles over ssh: a push feeds the far side's `mpi_stager receive`, a pull reads its `mpi_stager send`."""
from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from bundles.codecs import get_codec
from bundles.errors import PalletError, StreamError
from bundles.level_fit import LevelFit, level_range
from bundles.progress import Progress
from bundles.scan import SourceTree
from bundles.tarformat import Kind
from mpi_stager.receive import read_skeleton, receive
from mpi_stager.send import BegunStream, StreamSource, begin_stream, prepare_source, selection_block, send_stream
from mpi_stager.wire import ReceiveSummary

from staging_core.far_side.far_process import FarStager
from staging_core.options import StagingOptions
from staging_core.planning.level import FittedLevel, fixed_level
from staging_core.transports.base import Endpoint, Transport

_GRACE_SECONDS = 5


@dataclass(frozen=True)
class StreamOutcome:
    """What a streaming push or pull did: shards skipped (finished by an earlier run), stream bytes, seconds
    per stage (push: 'scan', 'stream': pack ∥ wire ∥ unpack, 'finish'; pull: 'stream'), the receiver's
    summary (the far side's for a push, this side's for a pull), and the shards compressed at each level
    (level -> shards, those skipped too; a push's only: a pull's are compressed at the far side)."""

    skipped_shards: int
    bytes_sent: int
    stage_seconds: dict[str, float]
    receiver: ReceiveSummary
    shard_levels: dict[int, int] = field(default_factory=dict)


def stream_push(transport: Transport, src: str, endpoint: Endpoint, codec: str, options: StagingOptions,
                progress: Progress, tree: SourceTree | None = None,
                receiver: Callable[[], FarStager] | None = None, level: FittedLevel | None = None) -> StreamOutcome:
    """Push the tree under ``src`` to ``endpoint.path`` as a bundle stream and return what was done.

    ``transport`` is open and can stream (ssh); ``remote_python -m mpi_stager
    receive`` runs there reading the stream (docs/bundle-format.md, 'Bundle
    stream v1'), with ``--no-verify`` unless ``options.verify``. Shards of
    ``options.shard_size`` (None: automatic) are built by ``options.jobs``
    local workers and written as each is ready, while the far side unpacks
    the previous ones. Shards an earlier, interrupted run finished there are
    still built (to learn their hashes) but only announced. The source is
    only read. Raises FarStagerError with the far side's message when its
    receiver fails, a TransportError when ssh does, and the local error (e.g.
    SourceError) when packing fails — the far side then stops, marked incomplete.
    ``tree`` is ``src`` already scanned (the planner's walk), reused as is.
    ``receiver`` starts the far-side receiver instead (a push's far-side
    session, staging_core.far_side.session); a stream the session offered and
    the far side took (its ``begun``) goes on from its skeleton.
    ``level``: the shards' level (None: ``options.level``, else the codec's
    default, for every shard); one not ``fixed`` starts there and is fitted
    as the stream runs (bundles.level_fit), and the index's level is where
    it started (a stream the session began declares the codec's default).
    """
    started = time.monotonic()
    level = level or fixed_level(codec, options.level)
    fit = None if level.fixed else LevelFit(level_range(codec, level.level, level.low, level.high))
    far = receiver() if receiver is not None else FarStager(transport, receive_argv(options, endpoint.path),
                                                             endpoint.url())
    begun = far.begun
    source = begun.source if begun is not None else prepare_source(src, codec, options.jobs, options.shard_size, tree)
    source = at_level(source, level.level, fit, declared=begun is None)
    scanned = time.monotonic()
    resume = far.handshake if fit is None else (lambda stream_id: fit.hold(far.handshake(stream_id)))
    try:
        begun = _metered(begun or begin_stream(source, far.stdin), fit)
        report = send_stream(source, far.stdin, resume, progress, begun)
        sent = time.monotonic()
        summary = far.summary()
    except (BrokenPipeError, ConnectionResetError):
        raise far.failure() from None
    except KeyboardInterrupt:
        far.interrupt()
        raise
    finally:
        far.close()
    seconds = {"scan": scanned - started, "stream": sent - scanned, "finish": time.monotonic() - sent}
    return StreamOutcome(report.skipped_shards, report.bytes_sent, seconds, summary, shard_levels(source, fit))


def at_level(source: StreamSource, level: int, fit: LevelFit | None, declared: bool) -> StreamSource:
    """``source`` compressing at ``level`` (with ``fit``: starting there, then as the fit says); ``declared``:
    its skeleton is not written yet, and its index says ``level`` too."""
    codec = replace(get_codec(source.codec.name, level), fit=fit)
    if declared:
        source.tree.index.level = level
    return replace(source, codec=codec)


def _metered(begun: BegunStream, fit: LevelFit | None) -> BegunStream:
    """``begun``, its writer reporting each frame to ``fit``."""
    begun.wire.meter = fit
    return begun


def shard_levels(source: StreamSource, fit: LevelFit | None) -> dict[int, int]:
    """Shards of ``source`` compressed at each level: as ``fit`` handed them out, and a shard of one large file
    at the codec's starting level (level -> shards)."""
    big = sum(1 for plan in source.plans if plan.big)
    if fit is None:
        return {source.codec.level: len(source.plans)}
    used = fit.used()
    if big:
        used[source.codec.level] = used.get(source.codec.level, 0) + big
    return dict(sorted(used.items()))


def stream_pull(transport: Transport, endpoint: Endpoint, dest: str, codec: str, options: StagingOptions,
                progress: Progress, items: Sequence[str] | None = None) -> StreamOutcome:
    """Pull the tree at ``endpoint.path`` into local ``dest`` as a bundle stream and return what was done.

    :class:`PullStream` begun and received at once; see there.
    """
    with PullStream(transport, endpoint, codec, options, items) as stream:
        return stream.receive_into(dest, progress)


class PullStream:
    """A streamed pull begun: ``remote_python -m mpi_stager send`` started at the source over ``transport``
    (ssh), and the stream's skeleton read — the tree's listing, which the planner can use instead of a
    listing of its own.

    :meth:`receive_into` then receives the rest into DEST as it arrives
    (:func:`mpi_stager.receive.receive`: checked before anything is
    written, each shard verified unless ``options.verify`` is off, and
    journaled in DEST/.pallet, so a rerun after an interruption is sent
    only the shards not finished here); the caller holds DEST's lock.
    ``items`` (relative paths) sends only those and their parent
    directories. Errors: FarStagerError with the sender's message when it
    fails, a TransportError when ssh does, and the local error (unsafe
    entries, damaged data, a full disk) otherwise; the sender then stops.
    Closing a stream not received stops the sender.
    """

    def __init__(self, transport: Transport, endpoint: Endpoint, codec: str, options: StagingOptions,
                 items: Sequence[str] | None = None):
        self.started, self.verify = time.monotonic(), options.verify
        selection = None if items is None else [os.fsencode(i) for i in items]
        self.far = FarStager(transport, send_argv(options, endpoint.path, codec, selection is not None),
                             endpoint.url())
        try:
            if selection is not None:
                self.far.stdin.write(selection_block(selection))
                self.far.stdin.flush()
            self.opened = read_skeleton(self.far.stdout, f"stream from {endpoint.url()}")
        except BaseException as exc:
            self._fail(exc)

    def file_sizes(self) -> list[int]:
        """The sizes of the regular files the stream carries, from its skeleton."""
        index = self.opened[1].index
        return [size for kind, size in zip(index.kinds, index.sizes, strict=True) if kind == Kind.FILE]

    def receive_into(self, dest: str, progress: Progress) -> StreamOutcome:
        """Receive the stream into ``dest`` (see the class) and return what was done."""
        try:
            summary = receive(self.far.stdout, self.far.stdin, dest, self.verify, lock_held=True,
                              progress=progress, opened=self.opened)
        except BaseException as exc:
            self._fail(exc)
        self.far.close()
        if self.far.process.returncode != 0:
            raise self.far.failure()
        return StreamOutcome(summary.shards_skipped, summary.stream_bytes,
                             {"stream": time.monotonic() - self.started}, summary)

    def close(self) -> None:
        """Stop the sender if the stream was not received (it sees its receiver go away)."""
        self.far.close(_GRACE_SECONDS)

    def __enter__(self) -> PullStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fail(self, exc: BaseException):
        """Raise the error behind ``exc``: the sender's own, or ``exc`` (see :meth:`FarStager.blame`). An error
        of this side that is not about the stream itself (unsafe entries, damaged data, a full disk) is ours
        alone: the sender is stopped at once."""
        if isinstance(exc, PalletError) and not isinstance(exc, StreamError):
            self.far.close(0)
            raise exc
        if isinstance(exc, PalletError):
            error = self.far.blame(exc)
        elif isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            error = self.far.blame(None)
        elif isinstance(exc, KeyboardInterrupt):
            self.far.interrupt()
            raise exc
        else:
            self.far.close(_GRACE_SECONDS)
            raise exc
        self.far.close(_GRACE_SECONDS)
        raise error from None


def receive_argv(options: StagingOptions, dest: str) -> list[str]:
    """The far-side command: ``remote_python -m mpi_stager receive --json --locked-by-caller [--no-verify] DEST``
    (no launcher; the push holds DEST's lock)."""
    verify = [] if options.verify else ["--no-verify"]
    return [*shlex.split(options.remote_python), "-m", "mpi_stager", "receive", "--json", "--locked-by-caller",
            *verify, dest]


def send_argv(options: StagingOptions, src: str, codec: str, selected: bool) -> list[str]:
    """The far-side command of a streamed pull: ``remote_python -m mpi_stager send --codec C [--shard-size N]
    [--jobs N] [--files-from -] SRC``; with ``selected``, the selection precedes the reply on its stdin."""
    shards = [] if options.shard_size is None else ["--shard-size", str(options.shard_size)]
    jobs = ["--jobs", str(options.ranks)] if options.ranks else []
    selection = ["--files-from", "-"] if selected else []
    return [*shlex.split(options.remote_python), "-m", "mpi_stager", "send", "--codec", codec, *shards, *jobs,
            *selection, src]
