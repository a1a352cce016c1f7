"""Receive a bundle stream on stdin and unpack each shard into DEST as it arrives, resumably."""
from __future__ import annotations

import os
import resource
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

from bundles.codecs import Codec, get_codec
from bundles.errors import CorruptBundleError, StreamError
from bundles.extract import (check_index, damaged_shard, extract_shard_data, finish_tree, make_directories,
                             prepare_destination)
from bundles.extract_common import read_up_to
from bundles.index import Index, Shard, content_hash, new_hasher
from bundles.streamed import write_streamed_file, writing_directory
from bundles.parallel import default_jobs
from bundles.progress import NoProgress, Progress
from bundles.read_ahead import ReadAhead
from bundles.shards import ShardPlan, entry_header, record_shard, reset_columns
from bundles.stream import (DATA_CHUNK, Frame, FrameKind, FrameReader, ShardRecord, Skeleton, decode_shard_record,
                            decode_skeleton, frame_limit, shard_key)
from bundles.tarformat import Kind
from bundles.journal import Journal, new_run_name
from bundles.state import finish, holding_lock, mark_incomplete

from .wire import ReceiveSummary
from .wire import encode_resume_reply

_HINT = "rerun the transfer: shards finished here are not sent again"
_READ_AHEAD = 2          # frames buffered while the previous shard is written


def read_skeleton(inp: BinaryIO, source: str) -> tuple[FrameReader, Skeleton]:
    """Read a stream's prelude and SKELETON frame from ``inp``: the reader to go on with, and the skeleton
    (the tree's entries and shard plan, not yet checked against the extraction rules). StreamError names
    ``source`` for anything else."""
    reader = FrameReader(inp, source)
    reader.prelude()
    return reader, _read_skeleton(reader, source)


def receive(inp: BinaryIO, out: BinaryIO, dest: str, verify: bool = True, lock_held: bool = False,
            progress: Progress | None = None, opened: tuple[FrameReader, Skeleton] | None = None,
            ends_at_index: bool = False) -> ReceiveSummary:
    """Unpack the bundle stream read from ``inp`` into ``dest`` and return a summary.

    The skeleton is checked against the extraction rules before anything is
    written (UnsafeMemberError names every refused entry), and so is its
    plan (StreamError for a shard sent whole that could decode to more than
    HELD_RAW_LIMIT). Then ``dest``
    gets ``.pallet/INCOMPLETE``, one JSON line goes to ``out`` —
    ``{"stream": ID, "done": {"N": "HASH", ...}}``, the shards the journal
    DEST/.pallet/stream-ID lists as finished, which the sender may skip —
    and the directories are made. Each shard is written as it arrives (a big
    one in chunks), verified with ``verify``, and journaled; at most a few
    shards are held in memory. After the last shard the index the sender
    sends must equal the one assembled here; then links and directory
    metadata are applied, and the journal and the incomplete marker are
    removed (with ``.pallet`` if nothing else is in it). Raises StreamError
    or CorruptBundleError
    naming the shard for damaged, cut or inconsistent input, leaving
    ``dest`` marked incomplete and the journal for a rerun. DEST is locked
    for the whole receive unless ``lock_held`` (the sender holds it).
    Shards written or skipped are reported on ``progress`` as 'receive'.
    ``opened`` is :func:`read_skeleton`'s result when the caller has
    already read that much of ``inp`` (a pull plans from the skeleton).
    With ``ends_at_index`` nothing is read after the index frame (a far-side
    session reads its next request there); otherwise ``inp`` must end there.
    """
    started = time.monotonic()
    source = f"stream to {dest}"
    reader, skeleton = opened or read_skeleton(inp, source)
    check_index(skeleton.index, source)
    reader.shard_limit = frame_limit(skeleton, source)      # a plan it would not hold is refused here too
    prepare_destination(dest)
    with holding_lock(dest, lock_held):
        return _receive_into(reader, out, dest, skeleton, verify, source, started, progress or NoProgress(),
                             ends_at_index)


def _receive_into(reader: FrameReader, out: BinaryIO, dest: str, skeleton: Skeleton, verify: bool, source: str,
                  started: float, progress: Progress, ends_at_index: bool) -> ReceiveSummary:
    journal = Journal.for_stream(dest, skeleton.stream_id)
    mark_incomplete(dest, "pallet is receiving a bundle stream here; if this file remains, the transfer did "
                          "not finish: rerun it", journal.name_in(dest))
    journal.create(dest)
    run = new_run_name()
    adopt_other_streams(dest, skeleton, journal, run)
    receiver = _Receiver(skeleton, dest, verify, journal, source, progress, run)
    _reply(out, skeleton, receiver.recorded)
    make_directories(skeleton.index, dest)
    progress.start("receive", sum(1 for kind in skeleton.index.kinds if kind == Kind.FILE), sum(skeleton.index.sizes))
    try:
        with _frames_ahead(reader, ends_at_index) as frames, \
                ThreadPoolExecutor(receiver.threads, "pallet-extract") as pool:
            receiver.pool = pool
            for plan in skeleton.plans:
                receiver.take(plan, frames)
            receiver.finish(frames)
    finally:
        progress.finish()
    finish_tree(skeleton.index, dest)
    summary = receiver.summary(reader.bytes_read, time.monotonic() - started)
    finish(dest, journal.root)
    return summary


def adopt_other_streams(dest: str, skeleton: Skeleton, journal: Journal, run: str) -> None:
    """Take over an interrupted stream's records (Journal.take_over) for the shards of this stream with the
    same key (the same entries), so the sender skips those whose bytes are still the same."""
    def matching(other: Journal) -> dict[int, tuple[bytes, bytes]]:
        by_key = other.recorded_keys()
        keys = ((plan.number, shard_key(skeleton.index, plan)) for plan in skeleton.plans) if by_key else ()
        return {number: (by_key[key], key) for number, key in keys if key in by_key}
    journal.take_over(dest, run, matching)


def _read_skeleton(reader: FrameReader, source: str) -> Skeleton:
    frame = reader.next()
    if frame is None or frame.kind != FrameKind.SKELETON:
        raise StreamError("stream does not start with a skeleton frame", source, _HINT)
    return decode_skeleton(frame.payload, source)


def _reply(out: BinaryIO, skeleton: Skeleton, recorded: dict[int, bytes]) -> None:
    done = {n: digest for n, digest in recorded.items() if n < len(skeleton.plans)}
    try:
        out.write(encode_resume_reply(skeleton.stream_id, done))
        out.flush()
    except BrokenPipeError:
        raise StreamError("the sender went away", None, _HINT) from None


class _Receiver:
    """The state of one receive: the index being assembled, the journal, and counters.

    Small shards are checked, decompressed and written by ``threads`` threads
    (the native engine and the codecs release the GIL), at most ``threads``
    of them in flight besides the one being read. Each shard is journaled as
    soon as it is written (under a lock); the index and counters are updated
    by the receiving thread alone, in shard order.
    """

    pool: ThreadPoolExecutor        # the extracting threads, set once they run (before the first shard)

    def __init__(self, skeleton: Skeleton, dest: str, verify: bool, journal: Journal, source: str,
                 progress: Progress, run: str):
        self.index, self.dest, self.verify, self.journal, self.source = skeleton.index, dest, verify, journal, source
        self.progress, self.plans = progress, skeleton.plans
        self.stream_id, self.shards_total = skeleton.stream_id, len(skeleton.plans)
        self.recorded = journal.recorded_shards()
        self.run = run
        self.offset = self.received = self.skipped = self.files = self.file_bytes = self.data_bytes = 0
        self.threads = max(1, min(default_jobs(), len(skeleton.plans)))
        self.pending: deque[tuple[Shard, int, Future]] = deque()
        self.journal_lock = threading.Lock()
        reset_columns(self.index)

    def take(self, plan: ShardPlan, frames: ReadAhead) -> None:
        """Consume the frames of shard ``plan``: SKIP, SHARD, or (big shards) DATA... then SHARD."""
        frame = _expect(frames, self.source, f"shard {plan.number}")
        if frame.number != plan.number or frame.kind not in _SHARD_KINDS[plan.big]:
            raise StreamError(f"expected shard {plan.number}, got a {frame.kind.name} frame for shard "
                              f"{frame.number}", self.source, _HINT)
        if frame.kind == FrameKind.SKIP:
            self._skip(plan, decode_shard_record(frame.payload, self.index, plan, False, self.source))
            return
        if self.recorded.pop(plan.number, None) is not None:
            self.journal.forget_shard(plan.number)      # written again: its record no longer holds meanwhile
        if plan.big:
            self._take_big(plan, frame, frames)
        else:
            self._take_small(plan, decode_shard_record(frame.payload, self.index, plan, True, self.source))

    def _skip(self, plan: ShardPlan, record: ShardRecord) -> None:
        if self.recorded.get(plan.number) != record.hash:
            raise StreamError(f"shard {plan.number}: the sender skipped it, but it is not finished here",
                              self.source, _HINT)
        self._record(plan, record)
        self.skipped += 1
        files = sum(1 for i in range(plan.first, plan.first + plan.count) if self.index.kinds[i] == Kind.FILE)
        self.progress.advance(files, record.built.file_bytes)

    def _take_small(self, plan: ShardPlan, record: ShardRecord) -> None:
        shard = self._record(plan, record)
        self.pending.append((shard, record.length, self.pool.submit(self._extract_small, plan, shard, record)))
        while len(self.pending) > self.threads:
            self._complete_oldest()

    def _extract_small(self, plan: ShardPlan, shard: Shard, record: ShardRecord):
        """In a pool thread: check, decompress and write one small shard."""
        if self.verify and content_hash(record.built.compressed) != record.hash:
            raise damaged_shard(self.source, self.index, shard)
        data = self._codec(plan).decompress(record.built.compressed, record.built.raw_size)
        outcome = extract_shard_data(data, self.index, shard, self.dest, self.verify, self.source, plan.last)
        self._journal(shard)        # at once: a sender that stalls must not keep a finished shard unrecorded
        return outcome

    def _journal(self, shard: Shard) -> None:
        with self.journal_lock:
            self.journal.record_shard(self.index, shard.number, self.run, 0,
                                      shard_key(self.index, self.plans[shard.number]))

    def _complete_oldest(self) -> None:
        shard, length, future = self.pending.popleft()
        outcome = future.result()
        self._count(length, outcome.files, outcome.file_bytes)

    def _complete_all(self) -> None:
        while self.pending:
            self._complete_oldest()

    def _take_big(self, plan: ShardPlan, first: Frame, frames: ReadAhead) -> None:
        i, where = plan.first, f"shard {plan.number}"
        raw = _DataReader(frames, plan.number, first, self.source)
        content = self._codec(plan).open_stream(raw)
        header = entry_header(self.index, i)
        if read_up_to(content, len(header)) != header:
            raise StreamError(f"{where}: its tar header does not match the skeleton", self.source, _HINT)
        with writing_directory(self.dest) as writing:
            written = write_streamed_file(content, self.index, i, self.dest, writing, plan.number, self.source)
            try:
                shard = self._check_big(plan, raw, len(header), written.digest)
            except BaseException:
                written.discard()
                raise
            written.commit()
        self._journal(shard)
        self._count(shard.length, 1, self.index.sizes[i])

    def _check_big(self, plan: ShardPlan, raw: _DataReader, header_size: int, digest: bytes) -> Shard:
        """The rest of a big shard's frames, its record and hashes checked (the file's ``digest`` too)."""
        where = f"shard {plan.number}"
        end = raw.drain()
        record = decode_shard_record(end.payload, self.index, plan, False, self.source)
        if (record.length, record.built.offsets[0], record.built.data_offsets[0]) != (raw.length, 0, header_size):
            raise StreamError(f"{where}: its sizes disagree with its data", self.source, _HINT)
        shard = self._record(plan, record)
        if self.verify and raw.digest() != record.hash:
            raise damaged_shard(self.source, self.index, shard)
        if self.verify and digest != record.built.hashes:
            raise CorruptBundleError(f"{where}: content hash mismatch", self.source, _HINT,
                                     [os.fsdecode(self.index.paths[plan.first])])
        return shard

    def _codec(self, plan: ShardPlan) -> Codec:
        """The stream's codec, naming the shard in its decoding errors."""
        return get_codec(self.index.codec, self.index.level, f"{self.source}, shard {plan.number}")

    def _record(self, plan: ShardPlan, record: ShardRecord) -> Shard:
        built = record.built
        shard = Shard(plan.number, self.offset, record.length, built.raw_size, plan.first, plan.count,
                      built.file_bytes, record.hash)
        record_shard(self.index, plan, built, shard)
        self.offset += record.length
        return shard

    def _count(self, length: int, files: int, file_bytes: int) -> None:
        self.received += 1
        self.data_bytes += length
        self.files += files
        self.file_bytes += file_bytes
        self.progress.advance(files, file_bytes)

    def finish(self, frames: ReadAhead) -> None:
        """Wait for the shards in flight, check the sender's index against the assembled one, and that the
        stream ends there."""
        self._complete_all()
        frame = _expect(frames, self.source, "the index")
        if frame.kind != FrameKind.INDEX:
            raise StreamError(f"expected the index, got a {frame.kind.name} frame", self.source, _HINT)
        if Index.blob_of(bytes(frame.payload), self.source) != self.index.to_blob():
            raise StreamError("the sender's index differs from the one assembled from the shards", self.source,
                              "the two sides may run different pallet versions; rerun after aligning them")
        if frames.next() is not None:
            raise StreamError("the stream goes on after its index", self.source, _HINT)

    def summary(self, stream_bytes: int, seconds: float) -> ReceiveSummary:
        return ReceiveSummary(self.dest, self.stream_id, self.shards_total, self.received, self.skipped,
                              self.files, self.file_bytes, stream_bytes, self.data_bytes, self.verify,
                              _max_rss(), seconds)


_SHARD_KINDS = {False: (FrameKind.SHARD, FrameKind.SKIP), True: (FrameKind.DATA, FrameKind.SKIP)}


def _expect(frames: ReadAhead, source: str, what: str) -> Frame:
    frame = frames.next()
    if frame is None:
        raise StreamError(f"stream ends before {what}", source, _HINT)
    return frame


class _DataReader:
    """File-like reader of a big shard's compressed bytes: its DATA frames, hashed, up to its SHARD frame (``end``)."""

    def __init__(self, frames: ReadAhead, number: int, first: Frame, source: str):
        self.frames, self.number, self.source = frames, number, source
        self.buffer = memoryview(first.payload)
        self.end: Frame | None = None
        self.hasher, self.length = new_hasher(), len(first.payload)
        self.hasher.update(first.payload)

    def read(self, size: int = -1) -> bytes:
        size = DATA_CHUNK if size is None or size < 0 else size
        while not self.buffer and self.end is None:
            self._next_frame()
        data, self.buffer = bytes(self.buffer[:size]), self.buffer[size:]
        return data

    def drain(self) -> Frame:
        """Read the rest of the shard's bytes (padding, end of archive) up to its SHARD frame; that frame."""
        while self.end is None:
            self.buffer = memoryview(b"")
            self._next_frame()
        return self.end

    def digest(self) -> bytes:
        return self.hasher.digest()

    def _next_frame(self) -> None:
        frame = _expect(self.frames, self.source, f"the end of shard {self.number}")
        if frame.number != self.number or frame.kind not in (FrameKind.DATA, FrameKind.SHARD):
            raise StreamError(f"shard {self.number}: its data is interrupted by a {frame.kind.name} frame",
                              self.source, _HINT)
        if frame.kind == FrameKind.SHARD:
            self.end = frame
            return
        self.buffer = memoryview(frame.payload)
        self.hasher.update(frame.payload)
        self.length += len(frame.payload)


class _FrameSource:
    """The frames of ``reader`` as a ReadAhead produces them: None at the end of the stream, or, with
    ``ends_at_index``, after the index frame (as if the stream ended there); a read error as pallet's."""

    def __init__(self, reader: FrameReader, ends_at_index: bool):
        self.reader, self.ends_at_index, self.ended = reader, ends_at_index, False

    def __call__(self) -> Frame | None:
        if self.ended:
            return None
        try:
            frame = self.reader.next()
        except OSError as exc:
            raise StreamError(f"cannot read the stream ({exc.strerror})", self.reader.source, _HINT) from None
        self.ended = frame is None or (self.ends_at_index and frame.kind == FrameKind.INDEX)
        return frame


def _frames_ahead(reader: FrameReader, ends_at_index: bool = False) -> ReadAhead[Frame]:
    """Frames read on a thread, a few ahead, so the wire keeps moving while a shard is written."""
    return ReadAhead(_FrameSource(reader, ends_at_index), _READ_AHEAD, "pallet-read-ahead")


def _max_rss() -> int:
    """Peak resident memory of this program image (Linux VmHWM: ru_maxrss would include the spawning parent's)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
