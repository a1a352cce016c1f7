"""Streaming bundle push: shards go into the far side's `mpi_stager receive` while later ones are still packed."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable

from bundles.codecs import Codec, get_codec
from bundles.errors import PalletError
from bundles.index import Shard, content_hash, new_hasher
from bundles.parallel import default_jobs
from bundles.progress import Progress
from bundles.scan import SourceTree, scan
from bundles.shards import (BuiltShard, ShardPlan, auto_shard_size, build_streamed_shard, plan_shards, record_shard,
                            reset_columns)
from bundles.stream import DATA_CHUNK, FrameKind, FrameWriter, encode_shard_record, encode_skeleton
from bundles.writer import iter_shards
from mpi_stager.receive import ReceiveSummary

from .options import StagingOptions
from .transports.base import Endpoint, Transport
from .transports.errors import classify

_RESUME_HINT = "fix the cause and rerun: shards the far side finished are not sent again"
_SSH_FAILED = 255
_ERROR_PREFIX = "mpi_stager receive: error: "     # how the receiver's errors start on its stderr


class ReceiverError(PalletError):
    """The far side's `mpi_stager receive` failed; the message is its own."""


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


@dataclass(frozen=True)
class StreamOutcome:
    """What a streaming push did: shards skipped (finished by an earlier run), bytes sent, seconds per
    stage ('scan', 'stream': pack ∥ wire ∥ unpack, 'finish': links and directory metadata there), and
    the far side's own summary."""

    skipped_shards: int
    bytes_sent: int
    stage_seconds: dict[str, float]
    far_side: ReceiveSummary


def stream_push(transport: Transport, src: str, endpoint: Endpoint, codec: str, options: StagingOptions,
                progress: Progress, tree: SourceTree | None = None) -> StreamOutcome:
    """Push the tree under ``src`` to ``endpoint.path`` as a bundle stream and return what was done.

    ``transport`` is open and can stream (ssh); ``remote_python -m mpi_stager
    receive`` runs there reading the stream (docs/bundle-format.md, 'Bundle
    stream v1'), with ``--no-verify`` unless ``options.verify``. Shards of
    ``options.shard_size`` (None: automatic) are built by ``options.jobs``
    local workers and written as each is ready, while the far side unpacks
    the previous ones. Shards an earlier, interrupted run finished there are
    still built (to learn their hashes) but only announced. The source is
    only read. Raises ReceiverError with the far side's message when its
    receiver fails, a TransportError when ssh does, and the local error (e.g.
    SourceError) when packing fails — the far side then stops, marked incomplete.
    ``tree`` is ``src`` already scanned (the planner's walk), reused as is.
    """
    started = time.monotonic()
    source = prepare_source(src, codec, options.jobs, options.shard_size, tree)
    scanned = time.monotonic()
    far = _FarSide(transport, receive_argv(options, endpoint.path), endpoint.url())
    try:
        report = send_stream(source, far.process.stdin, far.handshake, progress)
        sent = time.monotonic()
        summary = far.finish()
    except (BrokenPipeError, ConnectionResetError):
        raise far.failure() from None
    finally:
        far.close()
    seconds = {"scan": scanned - started, "stream": sent - scanned, "finish": time.monotonic() - sent}
    return StreamOutcome(report.skipped_shards, report.bytes_sent, seconds, summary)


def receive_argv(options: StagingOptions, dest: str) -> list[str]:
    """The far-side command: ``remote_python -m mpi_stager receive --json --locked-by-caller [--no-verify] DEST``
    (no launcher; the push holds DEST's lock)."""
    verify = [] if options.verify else ["--no-verify"]
    return [*shlex.split(options.remote_python), "-m", "mpi_stager", "receive", "--json", "--locked-by-caller",
            *verify, dest]


def prepare_source(src: str, codec: str, jobs: int, shard_size: int | None = None,
                   tree: SourceTree | None = None) -> StreamSource:
    """Scan ``src`` (unless ``tree`` is its scan) and cut it into shards (``shard_size`` None: automatic) for
    ``codec`` at its default level."""
    chosen = get_codec(codec)
    tree = tree or scan(src, chosen.name, chosen.level)
    tree.index.codec, tree.index.level = chosen.name, chosen.level
    tree.index.shard_size = shard_size or auto_shard_size(tree.index)
    return StreamSource(tree, plan_shards(tree.index, tree.index.shard_size), chosen, jobs)


def send_stream(source: StreamSource, out: BinaryIO, resume: Callable[[str], dict[int, bytes]],
                progress: Progress) -> SendReport:
    """Write the bundle stream of ``source`` onto ``out`` and return what was written.

    After the skeleton, ``resume(stream_id)`` says which shards (number ->
    hash) the receiver already holds; a shard whose built hash matches is
    sent as a SKIP frame, every other one in full. The index frame comes
    last; ``out`` is flushed but not closed. Shards are reported on
    ``progress`` as they are sent.
    """
    index = source.tree.index
    wire = FrameWriter(out)
    wire.prelude()
    skeleton, stream_id = encode_skeleton(index, source.plans)
    wire.frame(FrameKind.SKELETON, 0, skeleton)
    wire.flush()
    sender = _ShardSender(source, wire, resume(stream_id))
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

    def __init__(self, source: StreamSource, wire: FrameWriter, done: dict[int, bytes]):
        self.source, self.wire, self.done = source, wire, done
        self.offset = self.skipped = 0
        self.current: RelaySink | None = None

    def sink(self, plan: ShardPlan) -> RelaySink:
        """Where a big shard is compressed to: the wire, or only a hasher if the far side may have it."""
        self.current = self._data_sink(None if plan.number in self.done else self.wire, plan.number)
        return self.current

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
        if plan.big:
            digest, length = self.current.finish()
            if self.current.emit is None and self.done.get(plan.number) != digest:
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
        self._relay_error: OSError | None = None

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
                    except OSError as exc:
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


class _FarSide:
    """The far side's receiver, started over ``transport``: its handshake, its summary, its errors."""

    def __init__(self, transport: Transport, argv: list[str], url: str):
        self.argv, self.url = argv, url
        self.process: subprocess.Popen = transport.stream_into(argv)
        self._stderr: list[bytes] = []
        self._drain = threading.Thread(target=lambda: self._stderr.append(self.process.stderr.read()),
                                       name="pallet-receiver-stderr", daemon=True)
        self._drain.start()

    def handshake(self, stream_id: str) -> dict[int, bytes]:
        """Read the receiver's first line: the shards (number -> hash) it already holds for ``stream_id``."""
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise self.failure()
        try:
            reply = json.loads(line)
            if reply["stream"] != stream_id:
                raise ValueError(f"stream {reply['stream']}, not {stream_id}")
            return {int(number): bytes.fromhex(digest) for number, digest in reply["done"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PalletError(f"the far side's receiver answered {line[:200]!r} ({exc})", self.url,
                              "check that the far side runs the same pallet version, and that no shell "
                              "startup file prints to stdout") from None

    def finish(self) -> ReceiveSummary:
        """Close the stream, wait for the receiver and return its summary (its last stdout line)."""
        self.process.stdin.close()
        output = self.process.stdout.read()
        if self.process.wait() != 0:
            raise self.failure()
        try:
            return ReceiveSummary(**json.loads(output.strip().splitlines()[-1]))
        except (IndexError, ValueError, TypeError) as exc:
            raise PalletError(f"the far side's receiver printed no summary ({exc})", self.url,
                              "check that the far side runs the same pallet version") from None

    def failure(self) -> PalletError:
        """The error the receiver (or ssh) reported, once it has exited."""
        self.close()
        stderr = b"".join(self._stderr).decode(errors="replace").strip()
        status = self.process.returncode
        if status == _SSH_FAILED:
            return classify(stderr, status, self.argv, self.url, "ssh failed while streaming")
        _, found, error = stderr.partition(_ERROR_PREFIX)
        message = error if found else (stderr[-2000:] or f"it exited with status {status}")
        return ReceiverError(f"the far side's receiver failed: {message}", self.url, _RESUME_HINT)

    def close(self) -> None:
        """End our side of the stream and wait for the receiver (killing ssh if it does not exit)."""
        try:
            self.process.stdin.close()
        except (BrokenPipeError, ConnectionResetError, ValueError):
            pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._drain.join()
