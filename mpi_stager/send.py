"""Send a tree as a bundle stream: shards framed as they are built, shards the receiver holds only announced."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, cast

from bundles.codecs import Codec, get_codec
from bundles.errors import SourceError, StreamError
from bundles.index import Shard, content_hash, new_hasher
from bundles.parallel import default_jobs
from bundles.progress import NoProgress, Progress
from bundles.scan import SourceTree, scan
from bundles.shards import (BuiltShard, ShardPlan, auto_shard_size, build_streamed_shard, plan_shards, record_shard,
                            reset_columns)
from bundles.stream import DATA_CHUNK, FrameKind, FrameWriter, encode_shard_record, encode_skeleton
from bundles.writer import iter_shards

from .wire import RECEIVER_GONE, SOURCE_MISSING, decode_resume_reply

_SELECTION_LIMIT = 1 << 30        # bytes of a selection block: far above 10M names
_HINT = "rerun the pull: shards finished at the receiver are not sent again"


class SourceMissingError(SourceError):
    """SRC does not exist."""

    exit_code = SOURCE_MISSING


class ReceiverGoneError(StreamError):
    """The receiver closed the stream or its reply channel; the reason is on its side."""

    exit_code = RECEIVER_GONE


@dataclass(frozen=True)
class StreamSource:
    """A scanned source ready to stream: the tree, its shard plan, the codec and the local workers (0: automatic)."""

    tree: SourceTree
    plans: list[ShardPlan]
    codec: Codec
    jobs: int


@dataclass(frozen=True)
class SendReport:
    """What :func:`send_stream` wrote: shards in all, shards sent only as SKIP frames, bytes written."""

    shards: int
    skipped_shards: int
    bytes_sent: int


def prepare_source(src: str, codec: str, jobs: int, shard_size: int | None = None,
                   tree: SourceTree | None = None, include: frozenset[bytes] | None = None) -> StreamSource:
    """Scan ``src`` (unless ``tree`` is its scan; ``include``: only those relative names and their parent
    directories) and cut it into shards (``shard_size`` None: automatic) for ``codec`` at its default level."""
    chosen = get_codec(codec)
    tree = tree or scan(src, chosen.name, chosen.level, include=include)
    tree.index.codec, tree.index.level = chosen.name, chosen.level
    tree.index.shard_size = shard_size or auto_shard_size(tree.index)
    return StreamSource(tree, plan_shards(tree.index, tree.index.shard_size), chosen, jobs)


@dataclass(frozen=True)
class BegunStream:
    """A bundle stream whose prelude and skeleton are written (:func:`begin_stream`): its source, the writer
    it goes on with, and its identity."""

    source: StreamSource
    wire: FrameWriter
    stream_id: str


def begin_stream(source: StreamSource, out: BinaryIO) -> BegunStream:
    """Write the stream's prelude and skeleton onto ``out`` and flush it; :func:`send_stream` sends the rest."""
    wire = FrameWriter(out)
    wire.prelude()
    skeleton, stream_id = encode_skeleton(source.tree.index, source.plans)
    wire.frame(FrameKind.SKELETON, 0, skeleton)
    wire.flush()
    return BegunStream(source, wire, stream_id)


def send_stream(source: StreamSource, out: BinaryIO, resume: Callable[[str], dict[int, bytes]],
                progress: Progress, begun: BegunStream | None = None) -> SendReport:
    """Write the bundle stream of ``source`` onto ``out`` and return what was written.

    After the skeleton, ``resume(stream_id)`` says which shards (number ->
    hash) the receiver already holds. It is asked once the first shard is
    built, so that the answer travels while that shard is built. A shard
    whose built hash matches is sent as a SKIP frame, every other one in
    full. The index frame comes
    last; ``out`` is flushed but not closed. Shards are reported on
    ``progress`` as they are sent. ``begun``: the stream of ``source`` was
    begun on ``out`` already (its skeleton is written); it goes on from there.
    """
    begun = begun or begin_stream(source, out)
    index, wire = source.tree.index, begun.wire
    sender = _ShardSender(source, wire, lambda: resume(begun.stream_id))
    reset_columns(index)
    progress.start("stream", len(index), sum(index.sizes))
    try:
        for plan, built in iter_shards(source.tree, source.plans, source.codec, source.jobs, sender.sink):
            sender.send(plan, built)
            progress.advance(plan.count, built.file_bytes)
    finally:
        progress.finish()
    wire.frame(FrameKind.INDEX, 0, index.to_bytes())
    wire.flush()
    return SendReport(len(source.plans), sender.skipped, wire.bytes_written)


class _ShardSender:
    """Frames built shards onto the wire (or announces them as skipped) and records them in the index."""

    def __init__(self, source: StreamSource, wire: FrameWriter, resume: Callable[[], dict[int, bytes]]):
        self.source, self.wire, self.resume = source, wire, resume
        self.offset = self.skipped = 0
        self.current: RelaySink | None = None
        self.answer: dict[int, bytes] | None = None

    @property
    def done(self) -> dict[int, bytes]:
        """The shards the receiver holds (number -> hash), asked for on first use."""
        if self.answer is None:
            self.answer = self.resume()
        return self.answer

    def sink(self, plan: ShardPlan) -> BinaryIO:
        """Where a big shard is compressed to: the wire, or only a hasher if the far side may have it."""
        self.current = self._data_sink(None if plan.number in self.done else self.wire, plan.number)
        return self.current.as_file()

    @staticmethod
    def _data_sink(wire: FrameWriter | None, number: int) -> RelaySink:
        """DATA frames of shard ``number`` on ``wire`` (None: hashed only)."""
        if wire is None:
            return RelaySink(None)

        def frames(view: memoryview) -> None:
            for start in range(0, view.nbytes, DATA_CHUNK):
                wire.frame(FrameKind.DATA, number, view[start:start + DATA_CHUNK])
        return RelaySink(frames, wire.flush)

    def send(self, plan: ShardPlan, built: BuiltShard) -> None:
        relay = self.current        # set by sink() for every big shard
        if plan.big and relay is not None:
            digest, length = relay.finish()
            if relay.emit is None and self.done.get(plan.number) != digest:
                built, digest, length = self._resend_big(plan)
        else:
            digest, length = content_hash(built.compressed), len(built.compressed)
        shard = Shard(plan.number, self.offset, length, built.raw_size, plan.first, plan.count, built.file_bytes,
                      digest)
        record_shard(self.source.tree.index, plan, built, shard)
        self.offset += length
        record = encode_shard_record(plan, built, length, digest)
        if self.done.get(plan.number) == digest:
            self.wire.frame(FrameKind.SKIP, plan.number, *record)
            self.skipped += 1
        elif plan.big:
            self.wire.frame(FrameKind.SHARD, plan.number, *record)
        else:
            self.wire.frame(FrameKind.SHARD, plan.number, *record, built.compressed)

    def _resend_big(self, plan: ShardPlan) -> tuple[BuiltShard, bytes, int]:
        """The far side holds another version of this big shard: build it again, onto the wire this time."""
        sink = self._data_sink(self.wire, plan.number)
        built = build_streamed_shard(self.source.tree, plan, self.source.codec, self.source.jobs or default_jobs(),
                                     sink)
        self.done.pop(plan.number)
        return built, *sink.finish()


class RelaySink:
    """A compressor's output as it is produced, hashed and counted, and passed to ``emit`` (None: dropped).

    It is a file-like object for :func:`bundles.shards.build_streamed_shard`;
    pigz needs a descriptor, so ``fileno`` hands out a pipe a thread relays.
    """

    def __init__(self, emit: Callable[[memoryview], None] | None, flush: Callable[[], None] = lambda: None):
        self.emit, self._flush = emit, flush
        self.hasher, self.length = new_hasher(), 0
        self._relay: tuple[threading.Thread, int] | None = None
        self._relay_error: Exception | None = None

    def as_file(self) -> BinaryIO:
        """Itself, as the binary file bundles.writer.iter_shards writes a big shard to (write, flush, fileno)."""
        return cast(BinaryIO, self)

    def write(self, data) -> int:
        view = memoryview(data)
        self.hasher.update(view)
        self.length += view.nbytes
        if self.emit is not None:
            self.emit(view)
        return view.nbytes

    def flush(self) -> None:
        self._flush()

    def fileno(self) -> int:
        read_fd, write_fd = os.pipe()
        thread = threading.Thread(target=self._relay_from, args=(read_fd,), name="pallet-relay", daemon=True)
        thread.start()
        self._relay = (thread, write_fd)
        return write_fd

    def _relay_from(self, read_fd: int) -> None:
        with open(read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 20):
                if self._relay_error is None:       # after a failure, drain so the compressor can finish
                    try:
                        self.write(chunk)
                    except Exception as exc:        # raised again by finish(), in the caller's thread
                        self._relay_error = exc

    def finish(self) -> tuple[bytes, int]:
        """The content hash and length of everything written; raises what the relay met."""
        if self._relay is not None:
            thread, write_fd = self._relay
            os.close(write_fd)
            thread.join()
            self._relay = None
        if self._relay_error is not None:
            raise self._relay_error
        return self.hasher.digest(), self.length


def send(src: str, inp: BinaryIO, out: BinaryIO, codec: str, shard_size: int | None = None, jobs: int = 0,
         include: frozenset[bytes] | None = None) -> SendReport:
    """Stream the tree under ``src`` onto ``out`` for a receiver whose reply comes on ``inp``.

    This is the source end of a streamed pull (``python -m mpi_stager
    send``): the skeleton goes out, the receiver's one-line reply
    (:func:`mpi_stager.wire.decode_resume_reply`) names the shards it holds,
    and every other shard follows as it is built, then the index. The
    source is only read. Raises ReceiverGoneError when the receiver goes
    away (end of ``inp`` before its reply, or a broken ``out``),
    SourceMissingError when ``src`` does not exist, StreamError
    for a reply that is not one, and the scan's or packing's own errors
    (SourceError ...) otherwise.
    """
    if not os.path.lexists(src):
        raise SourceMissingError("does not exist", src, "check the source path")
    source = prepare_source(src, codec, jobs, shard_size, include=include)

    def resume(stream_id: str) -> dict[int, bytes]:
        out.flush()
        line = inp.readline()
        if not line:
            raise ReceiverGoneError("the receiver went away before answering", src, _HINT)
        return decode_resume_reply(line, stream_id, src)

    try:
        return send_stream(source, out, resume, NoProgress())
    except (BrokenPipeError, ConnectionResetError):
        raise ReceiverGoneError("the receiver went away", src, _HINT) from None


def selection_block(names: list[bytes]) -> bytes:
    """A selection as ``send --files-from -`` reads it before the reply: its length in bytes on one line, then
    the names, NUL-separated."""
    blob = b"\0".join(names)
    return b"%d\n" % len(blob) + blob


def read_selection_block(inp: BinaryIO, source: str) -> frozenset[bytes]:
    """The names of a :func:`selection_block` read from ``inp``; StreamError naming ``source`` if it is not one."""
    line = inp.readline(32)
    try:
        length = int(line)
        if not 0 <= length <= _SELECTION_LIMIT:
            raise ValueError(f"{length} bytes")
    except ValueError as exc:
        raise StreamError(f"the file list on stdin does not start with its length ({exc})", source,
                          "send --files-from - expects a line with the list's length in bytes, then the list") \
            from None
    blob = inp.read(length)
    if len(blob) != length:
        raise ReceiverGoneError("the file list on stdin is cut short", source, _HINT)
    return frozenset(name for name in blob.split(b"\0") if name)
