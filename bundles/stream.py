"""Bundle stream v2: a bundle framed for unpacking while it is still being packed (docs/bundle-format.md §7)."""
from __future__ import annotations

import enum
import json
import struct
import time
from array import array
from dataclasses import dataclass
from typing import BinaryIO, Protocol, cast

import zstandard

from .codecs import get_codec
from .errors import PalletError, StreamError
from .index import HASH_SIZE, MAX_DECODE_RATIO, READABLE_FORMATS, Index, content_hash, decoded_size_limit, little_endian
from .shards import HELD_RAW_LIMIT, MAX_AUTO_SHARD, BuiltShard, ShardPlan
from .stream_reply import STREAM_VERSION
from .tarformat import BLOCK, Kind

SKELETON_COLUMNS = ["path", "kind", "mode", "mtime_ns", "size", "link", "link_group"]
DATA_CHUNK = 4 << 20                     # largest DATA frame payload
MAX_STREAMED_SHARD_SIZE = MAX_AUTO_SHARD  # the largest --shard-size a stream carries (beyond: store and forward)
_PRELUDE = struct.Struct("<8sI")         # magic, version
_MAGIC = b"PALLETST"
_FRAME = struct.Struct("<B3xIQ")         # kind, shard number, payload length
_SHARD_HEAD = struct.Struct("<IQQQ16s")  # entries, raw size, file bytes, compressed length, shard hash
_U32 = struct.Struct("<I")
_LEN = struct.Struct("<Q")
_MAX_SKELETON = 1 << 32                  # compressed or not: far above any real tree (10M entries ~ 1 GB)
_READ_CHUNK = 16 << 20
_HEADER_MINIMUMS = {"shard_size": 1, "entries": 0, "shards": 1}
_HINT = "the stream was damaged or cut short: rerun the push (finished shards are not sent again)"


class FrameKind(enum.IntEnum):
    """What a frame carries."""

    SKELETON = 1     # entries without hashes, codec, shard plan
    SHARD = 2        # one shard's columns and hash, and (small shards) its compressed bytes
    DATA = 3         # a piece of a big shard's compressed bytes, before its SHARD frame
    SKIP = 4         # one shard's columns and hash; its files are already at the receiver
    INDEX = 5        # the full index payload (.pidx), last


@dataclass(frozen=True)
class Frame:
    """One frame: its kind, the shard it belongs to (0 for SKELETON and INDEX) and its payload."""

    kind: FrameKind
    number: int
    payload: bytes


@dataclass(frozen=True)
class Skeleton:
    """The first frame, decoded: entry columns (no hashes or offsets yet), codec, shard plan and stream id.

    ``stream_id`` is a hash of the skeleton's bytes but its level: the same
    tree, codec and shard plan give the same id, whatever the file contents
    and the level the stream starts at (a stream's level is fitted to the
    link, so a rerun may start at another; bundles.level_fit).
    """

    index: Index
    plans: list[ShardPlan]
    stream_id: str


@dataclass(frozen=True)
class ShardRecord:
    """A shard as a SHARD or SKIP frame describes it; ``built.compressed`` holds the inline bytes, if any."""

    built: BuiltShard
    length: int
    hash: bytes


def encode_skeleton(index: Index, plans: list[ShardPlan]) -> tuple[bytes, str]:
    """The SKELETON payload for ``index`` (entry columns filled, codec and shard size set) and its stream id."""
    header = json.dumps({"stream": STREAM_VERSION, "format": index.format, "codec": index.codec,
                         "level": index.level,
                         "shard_size": index.shard_size, "entries": len(index), "shards": len(plans),
                         "columns": SKELETON_COLUMNS}, sort_keys=True, separators=(",", ":")).encode()
    counts, big = array("I", (p.count for p in plans)), array("B", (p.big for p in plans))
    parts = [_U32.pack(len(header)), header, *index.column_parts(SKELETON_COLUMNS)]
    for column in (memoryview(little_endian(counts)).cast("B"), memoryview(big)):
        parts += [_LEN.pack(column.nbytes), column]
    blob = b"".join(parts)
    return zstandard.ZstdCompressor(level=3, write_checksum=True).compress(blob), _stream_id(blob)


def decode_skeleton(payload: bytes, source: str | None) -> Skeleton:
    """Decode a SKELETON payload; raise StreamError (or CorruptBundleError) naming ``source`` if it is invalid.

    Checked here: the encoding, the version, the codec, and that the shard
    plan covers every entry once, in order, with big shards holding one file.
    Whether the entries are safe to extract is the receiver's check.
    """
    blob = memoryview(_decompress(payload, source))
    header, pos = _skeleton_header(blob, source)
    index = Index(header["codec"], header["level"], header["shard_size"], format=header["format"])
    pos += index.load_columns(blob[pos:], SKELETON_COLUMNS, header["entries"], source)
    counts, pos = _plan_column(blob, pos, "I", header["shards"], source)
    big, pos = _plan_column(blob, pos, "B", header["shards"], source)
    if pos != len(blob):
        raise StreamError("skeleton has bytes after its last column", source, _HINT)
    return Skeleton(index, _plans(index, counts, big, source), _stream_id(blob))


def encode_shard_record(plan: ShardPlan, built: BuiltShard, length: int, digest: bytes) -> list:
    """The parts of a SHARD or SKIP payload: head, then hashes, offsets and data offsets of the shard's entries.

    A SHARD frame of a small shard appends the ``length`` compressed bytes.
    """
    return [_SHARD_HEAD.pack(plan.count, built.raw_size, built.file_bytes, length, digest), built.hashes,
            memoryview(little_endian(built.offsets)).cast("B"), memoryview(little_endian(built.data_offsets)).cast("B")]


def decode_shard_record(payload: bytes, index: Index, plan: ShardPlan, inline: bool, source: str | None) -> ShardRecord:
    """Decode a SHARD (``inline``: with its compressed bytes) or SKIP payload for ``plan``.

    Raises StreamError naming the shard if the payload does not fit the
    plan: entry count, column sizes, compressed length, or sizes beyond
    what the shard's entries can occupy (so nothing huge is ever allocated).
    """
    view = memoryview(payload)
    if len(view) < _SHARD_HEAD.size:
        raise _bad_shard(plan, "its frame is too short", source)
    count, raw_size, file_bytes, length, digest = _SHARD_HEAD.unpack_from(view)
    columns_end = _SHARD_HEAD.size + count * (HASH_SIZE + 16)
    limit = raw_bound(index, plan)
    if count != plan.count or raw_size > limit or length > compressed_bound(limit):
        raise _bad_shard(plan, "its sizes do not fit the skeleton", source)
    if len(view) != columns_end + (length if inline else 0):
        raise _bad_shard(plan, "its frame length does not match its contents", source)
    hashes_end = _SHARD_HEAD.size + count * HASH_SIZE
    offsets = _u64_column(view[hashes_end:hashes_end + 8 * count])
    data_offsets = _u64_column(view[hashes_end + 8 * count:columns_end])
    inline_bytes = cast(bytes, view[columns_end:]) if inline else b""     # a view of the payload, not a copy
    built = BuiltShard(inline_bytes, raw_size, file_bytes, bytes(view[_SHARD_HEAD.size:hashes_end]), offsets,
                       data_offsets)
    return ShardRecord(built, length, digest)


def raw_bound(index: Index, plan: ShardPlan) -> int:
    """An upper bound of the shard's uncompressed size: headers (with pax records), data, padding, end; the
    sum of :func:`bundles.shards.entry_bound` over its entries, taken column by column."""
    lo, hi, file = plan.first, plan.first + plan.count, int(Kind.FILE)
    names = sum(map(len, index.paths[lo:hi])) + sum(map(len, index.links[lo:hi]))
    pairs = zip(index.kinds[lo:hi], index.sizes[lo:hi], strict=True)
    data = sum(size + -size % BLOCK for kind, size in pairs if kind == file)
    return 2 * BLOCK + 4 * BLOCK * plan.count + names + data


def compressed_bound(raw: int) -> int:
    """An upper bound of the compressed size of ``raw`` bytes for every codec (zstd, gzip, none)."""
    return raw + raw // 64 + 65536


class WriteMeter(Protocol):
    """What a stream's writer reports each frame to (bundles.level_fit.LevelFit): seconds since the previous
    frame ended, seconds spent writing this one, whether it ends a shard, and whether that shard was sent."""

    def wrote(self, waited_s: float, blocked_s: float, ends_shard: bool, moves: bool = True) -> None: ...


class FrameWriter:
    """Writes a stream onto a binary file object; ``bytes_written`` counts everything written. ``meter``
    (None: none) is told how long each shard's frames waited and how long writing them took."""

    def __init__(self, out: BinaryIO):
        self.out = out
        self.bytes_written = 0
        self.meter: WriteMeter | None = None
        self._ended = time.monotonic()
        self._flushing = 0.0

    def prelude(self) -> None:
        """The stream's first bytes: magic and version."""
        self._write(_PRELUDE.pack(_MAGIC, STREAM_VERSION))

    def frame(self, kind: FrameKind, number: int, *parts) -> None:
        """Write one frame whose payload is the concatenation of ``parts`` (bytes-like)."""
        started = time.monotonic()
        self._write(_FRAME.pack(kind, number, sum(memoryview(p).nbytes for p in parts)))
        for part in parts:
            self._write(part)
        self._measured(kind, started)

    def flush(self) -> None:
        started = time.monotonic()
        self.out.flush()
        if self.meter is not None:
            self._flushing += time.monotonic() - started

    def _measured(self, kind: FrameKind, started: float) -> None:
        ended = time.monotonic()
        if self.meter is not None and kind in (FrameKind.SHARD, FrameKind.DATA, FrameKind.SKIP):
            waited = max(0.0, started - self._ended - self._flushing)
            self.meter.wrote(waited, ended - started + self._flushing, kind != FrameKind.DATA,
                             kind != FrameKind.SKIP)
        self._ended, self._flushing = ended, 0.0

    def _write(self, data) -> None:
        self.out.write(data)
        self.bytes_written += memoryview(data).nbytes


class FrameReader:
    """Reads a stream from a binary file object, refusing frames longer than their kind allows.

    ``shard_limit`` caps SHARD and SKIP payloads (set it from the skeleton,
    see :func:`frame_limit`); DATA payloads are capped at DATA_CHUNK.
    ``bytes_read`` counts everything read.
    """

    def __init__(self, inp: BinaryIO, source: str | None):
        self.inp, self.source = inp, source
        self.shard_limit = 0
        self.bytes_read = 0

    def prelude(self) -> None:
        """Read and check the magic and version; raise StreamError if this is not a v1 stream."""
        data = self._read(_PRELUDE.size)
        if len(data) < _PRELUDE.size or data[:8] != _MAGIC:
            raise StreamError("input is not a pallet bundle stream", self.source,
                              "feed the output of a pallet stream sender (pallet push --stream)")
        (version,) = _U32.unpack_from(data, 8)
        if version != STREAM_VERSION:
            raise StreamError(f"bundle stream version {version} is not supported (this pallet reads "
                              f"{STREAM_VERSION})", self.source, "use the same pallet version on both sides")

    def next(self) -> Frame | None:
        """The next frame, or None at a clean end of input; StreamError if the input ends inside a frame."""
        head = self._read(_FRAME.size)
        if not head:
            return None
        if len(head) < _FRAME.size:
            raise StreamError("stream ends inside a frame header", self.source, _HINT)
        code, number, length = _FRAME.unpack(head)
        try:
            kind = FrameKind(code)
        except ValueError:
            raise StreamError(f"unknown frame kind {code}", self.source, _HINT) from None
        if length > self._limit(kind):
            raise StreamError(f"{kind.name} frame of {length} bytes is longer than allowed", self.source, _HINT)
        payload = self._read(length)
        if len(payload) < length:
            raise StreamError(f"stream ends inside a {kind.name} frame", self.source, _HINT)
        return Frame(kind, number, payload)

    def _limit(self, kind: FrameKind) -> int:
        if kind in (FrameKind.SKELETON, FrameKind.INDEX):
            return _MAX_SKELETON
        return DATA_CHUNK if kind == FrameKind.DATA else self.shard_limit

    def _read(self, size: int) -> bytes:
        data = self.inp.read(size) if size <= _READ_CHUNK else self._read_growing(size)
        self.bytes_read += len(data)
        return data

    def _read_growing(self, size: int) -> bytes:
        """Up to ``size`` bytes, the buffer grown with what arrives, never by what a header claims."""
        data = bytearray()
        while len(data) < size:
            chunk = self.inp.read(min(_READ_CHUNK, size - len(data)))
            if not chunk:
                break
            data += chunk
        return cast(bytes, data)        # read as bytes are: not copied again


def frame_limit(skeleton: Skeleton, source: str | None) -> int:
    """The largest SHARD or SKIP payload the skeleton's plan allows (a big shard's SHARD frame carries its
    columns only; its bytes come in DATA frames). A receiver holds a shard sent whole, so a plan whose shard
    sent whole could decode to more than HELD_RAW_LIMIT is refused (StreamError): pallet's planner never
    makes one (bundles.shards.plan_shards, docs/bundle-format.md §7)."""
    index, largest = skeleton.index, 0
    for plan in skeleton.plans:
        columns = _SHARD_HEAD.size + plan.count * (HASH_SIZE + 16)
        if plan.big:
            largest = max(largest, columns)
            continue
        bound = raw_bound(index, plan)
        if bound > HELD_RAW_LIMIT:
            raise StreamError(f"shard {plan.number} could decode to {bound} bytes, more than a receiver holds "
                              f"({HELD_RAW_LIMIT >> 20} MiB)", source,
                              "the sender is not a pallet that plans shards within that; use the same pallet "
                              "version on both sides")
        largest = max(largest, columns + compressed_bound(bound))
    return largest


def _stream_id(blob) -> str:
    """A hash of a skeleton's bytes with its header's level left out (the blob is checked or made already)."""
    (length,) = _U32.unpack_from(blob)
    header = json.loads(bytes(blob[_U32.size:_U32.size + length]))
    header.pop("level", None)
    identity = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return content_hash(b"".join([_U32.pack(len(identity)), identity, blob[_U32.size + length:]])).hex()[:24]


def shard_key(index: Index, plan: ShardPlan) -> bytes:
    """What shard ``plan`` of a stream holds, as a hash: its entries' skeleton columns, codec and place (big,
    last), not the level (a fitted stream's shards each have their own). Two streams' shards with one key hold
    the same entries with the same metadata, so a shard that one stream finished at a DEST can answer for the
    other's (the sender still compares the bytes' hashes before it skips one)."""
    head = json.dumps([index.codec, plan.big, plan.last]).encode()
    return content_hash(b"".join([head, *index.slice(plan.first, plan.count).column_parts(SKELETON_COLUMNS)]))


def _decompress(payload: bytes, source: str | None) -> bytes:
    try:
        declared = zstandard.frame_content_size(payload)
        if not 0 <= declared <= min(_MAX_SKELETON, decoded_size_limit(len(payload))):
            raise zstandard.ZstdError(f"frame declares {declared} bytes for {len(payload)} stored, more than "
                                      f"{MAX_DECODE_RATIO} times")
        return zstandard.ZstdDecompressor().decompress(payload, max_output_size=declared)
    except zstandard.ZstdError as exc:
        raise StreamError(f"skeleton is damaged ({exc})", source, _HINT) from exc


def _skeleton_header(blob: memoryview, source: str | None) -> tuple[dict, int]:
    try:
        (length,) = _U32.unpack_from(blob)
        header = json.loads(bytes(blob[_U32.size:_U32.size + length]))
        version = header["stream"]
        if version != STREAM_VERSION:
            raise StreamError(f"skeleton version {version} is not supported", source,
                              "use the same pallet version on both sides")
        get_codec(header["codec"], header["level"])
        if header["format"] not in READABLE_FORMATS:
            raise ValueError(f"bundle format {header['format']!r} is not one this pallet reads")
        for key, least in _HEADER_MINIMUMS.items():
            if not isinstance(header[key], int) or header[key] < least:
                raise ValueError(f"{key} is {header[key]!r}")
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise StreamError(f"skeleton header is invalid ({exc})", source, _HINT) from None
    except PalletError as exc:
        raise StreamError(f"skeleton header is invalid ({exc.message})", source, _HINT) from None
    return header, _U32.size + length


def _plan_column(blob: memoryview, pos: int, typecode: str, count: int, source: str | None) -> tuple[array, int]:
    values = array(typecode)
    end = pos + _LEN.size + count * values.itemsize
    if end > len(blob) or _LEN.unpack_from(blob, pos)[0] != count * values.itemsize:
        raise StreamError("skeleton's shard plan is cut short", source, _HINT)
    values.frombytes(blob[pos + _LEN.size:end])
    return little_endian(values), end


def _plans(index: Index, counts: array, big: array, source: str | None) -> list[ShardPlan]:
    plans, first = [], 0
    for n, (count, is_big) in enumerate(zip(counts, big, strict=True)):
        if first + count > len(index) or (count == 0 and len(index)):
            raise StreamError(f"skeleton's shard {n} does not fit its entries", source, _HINT)
        if is_big and (count != 1 or index.kinds[first] != Kind.FILE):
            raise StreamError(f"skeleton's shard {n} is marked big but is not one file", source, _HINT)
        plans.append(ShardPlan(n, first, count, bool(is_big), n == len(counts) - 1))
        first += count
    if first != len(index):
        raise StreamError(f"skeleton's shard plan covers {first} of {len(index)} entries", source, _HINT)
    return plans


def _u64_column(view: memoryview) -> array:
    values = array("Q")
    values.frombytes(view)
    return little_endian(values)


def _bad_shard(plan: ShardPlan, why: str, source: str | None) -> StreamError:
    return StreamError(f"shard {plan.number}: {why}", source, _HINT)
