"""Shard codecs: zstd (default), gzip (pigz when present) and none, one frame or member per shard."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

import zstandard

from .byte_source import Readable
from .errors import BundleError, UsageError

if TYPE_CHECKING:
    from .level_fit import LevelFit

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20
_ONE_STEP_LIMIT = 256 << 20   # a zstd shard declaring at most this is decoded in one step; larger, in _CHUNK pieces
_DAMAGED_HINT = "the archive is damaged or incomplete: transfer it again, or repack the source"


@dataclass(frozen=True)
class Codec:
    """How shards are compressed.

    ``compress`` turns one shard into one self-contained frame/member whose
    concatenation with the others is a valid stream for the matching plain
    tool; ``compress_stream`` does the same for data too large to hold in
    memory; ``decompress`` inverts one frame/member and must return exactly
    ``raw_size`` bytes or raise BundleError. Output bytes depend only on the
    data, the codec and the level — never on the number of threads.
    ``source`` names the file being decoded in those errors.

    With ``fit`` (a stream's level fitted to the link, bundles.level_fit)
    ``compress`` uses the level the fit holds when it is called; ``level``
    is the stream's starting level, which ``compress_stream`` (a shard of
    one large file) always uses. Sent to a worker process, such a codec
    goes as a plain one at the level of that moment (``__reduce__``).
    """

    name: str
    level: int
    suffix: str
    source: str | None = field(default=None, compare=False)
    fit: LevelFit | None = field(default=None, compare=False, repr=False)

    def compress(self, data: bytes) -> bytes:
        if self.fit is not None:
            return self.fit.compress(data, self.compress_at)
        return self.compress_at(data, self.level)

    def compress_at(self, data: bytes, level: int) -> bytes:
        """``data`` as one frame/member at ``level``."""
        if self.name == "zstd":
            return zstandard.ZstdCompressor(level=level).compress(data)
        if self.name == "gzip":
            return _gzip_compress(data, level)
        return bytes(data)

    def __reduce__(self):
        level = self.level if self.fit is None else self.fit.take()
        return Codec, (self.name, level, self.suffix, self.source)

    def compress_stream(self, chunks: Iterator[bytes], out: BinaryIO, threads: int) -> None:
        """Compress the concatenated ``chunks`` as one frame/member onto ``out``."""
        if self.name == "zstd":
            compressor = zstandard.ZstdCompressor(level=self.level, threads=max(1, threads))
            with compressor.stream_writer(out, closefd=False) as writer:
                for chunk in chunks:
                    writer.write(chunk)
        elif self.name == "gzip":
            _gzip_compress_stream(chunks, out, self.level, threads)
        else:
            for chunk in chunks:
                out.write(chunk)

    def decompress(self, data: bytes, raw_size: int) -> bytes:
        try:
            if self.name == "zstd":
                declared = zstandard.frame_content_size(data)      # -1: the header does not say
                if declared not in (-1, raw_size):
                    raise self.damaged(f"shard frame declares {declared} bytes, index says {raw_size}")
                result = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_size,
                                                                 allow_extra_data=False) \
                    if declared == raw_size <= _ONE_STEP_LIMIT else _unzstd_bounded(data, raw_size)
            elif self.name == "gzip":
                result = _gunzip_bounded(data, raw_size)
            else:
                result = data
        except (zstandard.ZstdError, zlib.error) as exc:
            raise self.damaged(f"cannot decompress {self.name} shard: {exc}") from exc
        except MemoryError:
            raise self.damaged(f"a shard the index says holds {raw_size} bytes does not fit in this process's "
                               "memory") from None
        if len(result) != raw_size:
            raise self.damaged(f"shard decompressed to {len(result)} bytes, index says {raw_size}")
        return result

    def open_stream(self, raw: Readable, max_window: int = 0) -> Readable:
        """Return a reader of the decompressed bytes of the frames in ``raw``; a zstd frame that needs a window
        larger than ``max_window`` bytes (0: zstd's own limit) cannot be read (its memory would not be bounded
        by the buffers)."""
        if self.name == "zstd":
            decompressor = zstandard.ZstdDecompressor(max_window_size=max_window)
            # zstandard's stubs ask for IO[bytes]; a stream reader calls only read(), as its documentation says
            return _ZstdReader(decompressor.stream_reader(raw, read_across_frames=True), self)  # type: ignore[arg-type]
        if self.name == "gzip":
            return _GzipReader(raw, self)
        return raw

    def damaged(self, message: str) -> BundleError:
        """The error for data of ``source`` that cannot be decoded."""
        return BundleError(message, self.source, _DAMAGED_HINT)


def get_codec(name: str, level: int | None = None, source: str | None = None) -> Codec:
    """Return the codec called ``name`` at ``level`` (None: the codec's default), decoding ``source``."""
    defaults = {"zstd": (3, ".tar.zst", -5, 19), "gzip": (6, ".tar.gz", 1, 9), "none": (0, ".tar", 0, 0)}
    if name not in defaults:
        raise UsageError(f"unknown codec {name!r}", hint="use one of: zstd, gzip, none")
    default, suffix, low, high = defaults[name]
    level = default if level is None else level
    if not low <= level <= high or (level == 0 and low < 0):     # zstd's 0 would mean its default
        raise UsageError(f"level {level} is out of range for {name}",
                         hint=f"use 1..{high} (or {low}..-1, its fast levels)" if low < 0 else f"use {low}..{high}")
    return Codec(name, level, suffix, source)


def sniff(head: bytes) -> str:
    """Name the codec of a stream from its first bytes: 'zstd', 'gzip' or 'none'."""
    skippable = len(head) >= 4 and 0x184D2A50 <= int.from_bytes(head[:4], "little") <= 0x184D2A5F
    if head.startswith(ZSTD_MAGIC) or skippable:
        return "zstd"
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    return "none"


def _pigz() -> str | None:
    return shutil.which("pigz")


def _gzip_compress(data: bytes, level: int) -> bytes:
    pigz = _pigz()
    if pigz:
        done = subprocess.run([pigz, "-c", "-n", f"-{level}", "-p", "1"], input=data, capture_output=True,
                              check=False)
        if done.returncode != 0:
            raise _pigz_failure(done.stderr)
        return done.stdout
    compressor = zlib.compressobj(level, zlib.DEFLATED, 31)
    return compressor.compress(data) + compressor.flush()


def _gzip_compress_stream(chunks: Iterator[bytes], out: BinaryIO, level: int, threads: int) -> None:
    pigz = _pigz()
    if not pigz:
        compressor = zlib.compressobj(level, zlib.DEFLATED, 31)
        for chunk in chunks:
            out.write(compressor.compress(chunk))
        out.write(compressor.flush())
        return
    out.flush()
    proc = subprocess.Popen([pigz, "-c", "-n", f"-{level}", "-p", str(max(1, threads))],
                            stdin=subprocess.PIPE, stdout=out.fileno(), stderr=subprocess.PIPE)
    errors: list[bytes] = []
    stderr = proc.stderr
    assert stderr is not None       # stderr=PIPE
    reader = threading.Thread(target=lambda: errors.append(stderr.read()), daemon=True)
    reader.start()
    complete = False
    try:
        complete = _feed(proc.stdin, chunks)
    finally:
        complete = _close_input(proc.stdin) and complete
        code = proc.wait()
        reader.join()
    if code != 0 or not complete:
        raise _pigz_failure(b"".join(errors))


def _feed(stdin, chunks: Iterator[bytes]) -> bool:
    """Write ``chunks`` to a compressor's input; False if it stopped reading (its exit status says why)."""
    try:
        for chunk in chunks:
            stdin.write(chunk)
    except BrokenPipeError:
        return False
    return True


def _close_input(stdin) -> bool:
    try:
        stdin.close()
    except BrokenPipeError:
        return False
    return True


def _pigz_failure(stderr: bytes) -> Exception:
    """OSError when pigz could not write its output (the caller names the file), else BundleError."""
    text = stderr.decode(errors="replace").strip()
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
        if os.strerror(code) in text:
            return OSError(code, os.strerror(code))
    return BundleError(f"pigz failed: {text or 'no message'}")


class _ZstdReader:
    """Read-only stream over zstd frames that reports damaged data as BundleError."""

    def __init__(self, reader, codec: Codec):
        self._reader, self._codec = reader, codec

    def read(self, size: int = -1) -> bytes:
        try:
            return self._reader.read(size)
        except zstandard.ZstdError as exc:
            raise self._codec.damaged(f"corrupt zstd data: {exc}") from exc


def _unzstd_bounded(data: bytes, limit: int) -> bytes:
    """The zstd frame(s) in ``data`` decompressed in 1 MiB pieces, never more than ``limit`` + 1 bytes: memory
    follows what the data really holds, never the size a header or the index claims."""
    parts, total = [], 0
    with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True) as reader:
        while total <= limit:
            piece = reader.read(min(_CHUNK, limit + 1 - total))
            if not piece:
                break
            parts.append(piece)
            total += len(piece)
    return b"".join(parts)


def _gunzip_bounded(data: bytes, limit: int) -> bytes:
    """The gzip member(s) in ``data`` decompressed, never more than ``limit`` + 1 bytes of output in memory
    (a shard that inflates beyond what the index says is refused, however small it is packed)."""
    out, rest = bytearray(), data
    while rest:
        inflate = zlib.decompressobj(31)
        out += inflate.decompress(rest, limit + 1 - len(out))
        if len(out) > limit or (inflate.unconsumed_tail and not inflate.eof):
            raise zlib.error(f"inflates beyond the {limit} bytes the index says")
        if not inflate.eof:
            raise zlib.error("the member ends early (truncated)")
        rest = inflate.unused_data
    return bytes(out)


class _GzipReader:
    """Read-only stream over concatenated gzip members; memory is bounded by the reads' sizes."""

    def __init__(self, raw: Readable, codec: Codec):
        self._raw, self._codec = raw, codec
        self._inflate = zlib.decompressobj(31)
        self._fed = False

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            return b"".join(iter(lambda: self.read(_CHUNK), b""))
        out = bytearray()
        while len(out) < size:
            data = self._next_input()
            if not data:
                break
            try:
                out += self._inflate.decompress(data, size - len(out))
            except zlib.error as exc:
                raise self._codec.damaged(f"corrupt gzip data: {exc}") from exc
        return bytes(out)

    def _next_input(self) -> bytes:
        """Input not yet inflated: the rest of the last read's input, the next member's, or fresh bytes."""
        # after a member's end, the bytes that follow it are in unused_data (unconsumed_tail may repeat them)
        if not self._inflate.eof and self._inflate.unconsumed_tail:
            return self._inflate.unconsumed_tail
        leftover = self._inflate.unused_data if self._inflate.eof else b""
        data = leftover or self._raw.read(_CHUNK)
        if not data:
            if self._fed and not self._inflate.eof:
                raise self._codec.damaged("corrupt gzip data: the stream ends inside a member (truncated)")
            return b""
        if self._inflate.eof:
            self._inflate = zlib.decompressobj(31)
        self._fed = True
        return data
