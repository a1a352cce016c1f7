"""Members of a plain tar archive read in stream order through a bounded window of its decompressed bytes."""
from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

from .errors import BundleError
from .pax_check import DIGIT_COST_LIMIT, GLOBAL_LIMIT, applied_records, digit_cost, framing_problem
from .read_ahead import ReadAhead

TRUNCATED_HINT = "the archive is incomplete or not a tar file: transfer it again or check what it is"
WINDOW_FILL = 4 << 20          # decompressed bytes asked of the codec per refill
MEMBER_CHUNK = 8 << 20         # the most of one member's data held at once
HEADER_LIMIT = 1 << 20         # the most header bytes (extended headers, sparse maps) read for one member
_BLOCK = tarfile.BLOCKSIZE
_ZERO_BLOCK = bytes(_BLOCK)
_CRAFTED_HINT = "the archive is damaged or crafted; extract it with GNU tar if you trust it"
_PAX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
_EXTENSION_TYPES = _PAX_TYPES + (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_GNU_MAGIC = b"ustar  \0"


class Window:
    """The archive's decompressed bytes from the current position: a buffer refilled from the codec stream.

    ``data[pos:]`` are the bytes not yet consumed; ``tell()`` is the position in the whole stream. The buffer
    holds at most what one refill or one read asked for beyond the unconsumed rest.
    """

    def __init__(self, stream):
        self.stream, self.data, self.pos, self.base = stream, b"", 0, 0

    def tell(self) -> int:
        return self.base + self.pos

    def available(self) -> int:
        return len(self.data) - self.pos

    def fill(self, wanted: int) -> None:
        """Make ``wanted`` bytes available, fewer only at the end of the stream."""
        if self.available() >= wanted:
            return
        parts, have = [self.data[self.pos:]], self.available()
        while have < wanted:
            chunk = self.stream.read(max(wanted - have, WINDOW_FILL))
            if not chunk:
                break
            parts.append(chunk)
            have += len(chunk)
        self.base, self.data, self.pos = self.base + self.pos, b"".join(parts), 0

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes (fewer only at the end of the stream); ValueError for a negative size."""
        if size < 0:
            raise ValueError(f"negative length {size}")
        self.fill(size)
        out = self.data[self.pos:self.pos + size]
        self.pos += len(out)
        return out

    def read_some(self, size: int) -> bytes:
        """Between 1 and ``size`` bytes (none only at the end of the stream), copied as little as possible: a
        decoded chunk no larger than ``size`` is handed over as it came."""
        if not self.available():
            chunk = self.stream.read(WINDOW_FILL)
            self.base, self.data, self.pos = self.tell(), chunk, 0
            if len(chunk) <= size:
                self.base, self.data = self.base + len(chunk), b""
                return chunk
        out = self.data[self.pos:self.pos + size]
        self.pos += len(out)
        return out

    def peek(self, offset: int, size: int) -> bytes:
        """The ``size`` bytes ``offset`` bytes ahead, left unconsumed (fewer at the end of the stream)."""
        self.fill(offset + size)
        return self.data[self.pos + offset:self.pos + offset + size]

    def consume(self, count: int) -> None:
        """Mark ``count`` available bytes as read."""
        self.pos += count

    def next_chunk(self) -> bytes:
        """The stream's next decoded chunk, not yet part of the window (see continue_in and extend)."""
        return self.stream.read(WINDOW_FILL)

    def continue_in(self, chunk: bytes, offset: int) -> None:
        """The rest of the window and ``chunk`` up to ``offset`` were read elsewhere: go on from there."""
        self.base, self.data, self.pos = self.base + len(self.data), chunk, offset

    def extend(self, chunk: bytes) -> None:
        """Append ``chunk`` to the unconsumed rest."""
        self.base, self.data, self.pos = self.tell(), self.data[self.pos:] + chunk, 0

    def skip(self, count: int) -> int:
        """Consume ``count`` bytes without holding more than one chunk; return how many there were."""
        skipped = 0
        while skipped < count:
            step = len(self.read_some(min(count - skipped, MEMBER_CHUNK)))
            if not step:
                break
            skipped += step
        return skipped


class DecodedAhead(ReadAhead[bytes]):
    """A codec stream decoded one chunk ahead by a thread (the codecs release the GIL), so decoding overlaps
    extraction. It is joined when left, so only for local files (see :class:`bundles.read_ahead.ReadAhead`).
    ``read`` returns the next decoded chunk whatever size is asked, b"" at the end, and raises what decoding
    raised."""

    def __init__(self, stream):
        super().__init__(lambda: stream.read(WINDOW_FILL) or None, depth=2, name="pallet-plain-decode", join=True)

    def read(self, size: int = -1) -> bytes:
        return self.next() or b""


class _HeaderReads:
    """The window as ``tarfile`` reads a member's headers through it: at most ``budget`` bytes, then an error."""

    def __init__(self, window: Window, path: str):
        self.window, self.path, self.budget = window, path, HEADER_LIMIT

    def tell(self) -> int:
        return self.window.tell()

    def read(self, size: int) -> bytes:
        self.budget -= size
        if self.budget < 0:
            raise BundleError(f"a member's headers (at byte {self.window.tell():,}) are longer than pallet reads "
                              f"({HEADER_LIMIT:,} bytes)", self.path, _CRAFTED_HINT)
        return self.window.read(size)


class _Cursor:
    """What ``tarfile.TarInfo.fromtarfile`` reads a member through (a TarFile's reading state)."""

    def __init__(self, window: Window, path: str):
        self.fileobj, self.offset = _HeaderReads(window, path), 0
        self.pax_headers: dict[str, str] = {}
        self.encoding, self.errors = tarfile.ENCODING, "surrogateescape"


@dataclass
class NativeRun:
    """What the native engine wrote in one or more runs: counts, and the directory members with their mode and
    mtime (ns), which are applied last."""

    entries: int = 0
    files: int = 0
    file_bytes: int = 0
    directories: list[tuple[bytes, int, int]] = field(default_factory=list)

    def add(self, entries: int, files: int, file_bytes: int, directories: list) -> None:
        self.entries, self.files = self.entries + entries, self.files + files
        self.file_bytes += file_bytes
        self.directories.extend(directories)


class PlainReader:
    """The members of one plain archive, in stream order; a member's data is read or skipped before the next.

    ``next_member`` returns None at the end-of-archive block and raises BundleError for anything that is
    not a complete tar archive (naming the archive).
    """

    def __init__(self, path: str, stream):
        self.path, self.window = path, Window(stream)
        self.cursor = _Cursor(self.window, path)
        self._data_end = 0            # where the current member's data and padding end
        self._digit_cost = 0          # see bundles/pax_check.py
        self._global_bytes = 0        # global pax headers read so far, at most GLOBAL_LIMIT

    def next_member(self) -> tarfile.TarInfo | None:
        self._skip_to(self._data_end)
        header = self._peek_header()
        if header == _ZERO_BLOCK:
            return None
        start = self.window.tell()
        self._check_extensions(start)
        self.cursor.fileobj.budget = HEADER_LIMIT
        try:
            member = tarfile.TarInfo.fromtarfile(cast(tarfile.TarFile, self.cursor))  # as a TarFile: see _Cursor
        except (tarfile.TarError, EOFError, OSError, ValueError, RecursionError) as exc:
            raise self._damaged(exc, start) from None
        if member.size < 0 or self.cursor.offset < self.window.tell():
            raise self._damaged(f"negative size {member.size}", start)
        self._data_end = self.cursor.offset
        if self.cursor.pax_headers:         # global records: only those tarfile applies follow later members
            self.cursor.pax_headers = applied_records(self.cursor.pax_headers)
        if member.pax_headers:              # a member kept for later (a link) keeps no more than those either
            member.pax_headers = applied_records(member.pax_headers)
        return member

    def data_chunks(self, member: tarfile.TarInfo) -> Iterator[bytes]:
        """A regular member's data in chunks of at most MEMBER_CHUNK bytes; BundleError if the archive ends."""
        remaining = member.size
        while remaining:
            chunk = self.window.read_some(min(remaining, MEMBER_CHUNK))
            if not chunk:
                raise BundleError(f"archive is truncated inside {member.name!r}", self.path, TRUNCATED_HINT)
            remaining -= len(chunk)
            yield chunk

    def run_native(self, extraction) -> NativeRun:
        """Let the native ``extraction`` write the simple members from here (see bundles/native/src/plain_run.rs)
        and return what it wrote."""
        done = NativeRun()
        self._skip_to(self._data_end)
        while not self.cursor.pax_headers:          # a global pax header changes every member: Python reads
            window = self.window
            consumed, needed, entries, files, size, made = extraction.run(window.data, window.pos)
            window.consume(consumed)
            done.add(entries, files, size, made)
            if not needed or needed > MEMBER_CHUNK:
                break
            if self._run_straddling(extraction, needed, done):
                continue
            window.fill(needed)
            if window.available() < needed:
                break                                # the archive ends: Python reports how
        self._data_end = self.window.tell()
        return done

    def _run_straddling(self, extraction, needed: int, done: NativeRun) -> bool:
        """Write the member that starts at the window's rest and ends in the stream's next chunk from a copy of
        that member alone, then go on in the next chunk where it ended (so chunks are not copied whole); True
        when it was written, or when the window was empty and now holds the chunk. Otherwise the window holds
        the rest and the chunk, joined."""
        window = self.window
        have, chunk = window.available(), window.next_chunk()
        if not have:
            window.continue_in(chunk, 0)
            return bool(chunk)
        rest = window.peek(0, have)
        while have + len(chunk) >= needed:
            consumed, longer, entries, files, size, made = extraction.run(rest + chunk[:needed - have], 0)
            if consumed == needed:
                done.add(entries, files, size, made)
                window.continue_in(chunk, needed - have)
                return True
            if consumed or longer <= needed:
                break                                 # a member for Python
            needed = longer                           # only its header was there: now its whole length
        window.extend(chunk)
        return False

    def _skip_to(self, position: int) -> None:
        behind = position - self.window.tell()
        if behind > 0 and self.window.skip(behind) < behind:
            raise BundleError("archive is truncated inside its last member", self.path, TRUNCATED_HINT)

    def _peek_header(self) -> bytes:
        header = self.window.peek(0, _BLOCK)
        if len(header) < _BLOCK:
            raise (self._damaged("shorter than one tar header", 0) if self.window.tell() == 0 else
                   BundleError("archive is truncated (it ends without end-of-archive blocks)", self.path,
                               TRUNCATED_HINT))
        return header

    def _check_extensions(self, start: int) -> None:
        """Before tarfile parses them, look over the extended headers that precede the next member (pax records,
        GNU long names): refuse negative or over-budget sizes, pax records tarfile might parse in quadratic
        time (see bundles/pax_check.py), and a GNU header whose prefix field holds times (``tar -G``), which
        tarfile would read as part of the name. Headers tarfile cannot read are left to it to report."""
        offset = 0
        while True:
            header = self.window.peek(offset, _BLOCK)
            try:
                info = tarfile.TarInfo.frombuf(header, self.cursor.encoding, self.cursor.errors)
            except tarfile.HeaderError:
                return
            if header[257:265] == _GNU_MAGIC and header[345] and info.type not in tarfile.GNU_TYPES:
                raise BundleError(f"member {info.name!r} (at byte {start + offset:,}) is from a GNU incremental "
                                  "archive (tar -G), which pallet does not extract", self.path,
                                  "extract it with GNU tar")
            if info.type not in _EXTENSION_TYPES:
                return
            if not 0 <= info.size <= HEADER_LIMIT - offset - _BLOCK:
                raise BundleError(f"a member's headers (at byte {start:,}) are longer than pallet reads "
                                  f"({HEADER_LIMIT:,} bytes) or of negative length", self.path, _CRAFTED_HINT)
            padded = -(-info.size // _BLOCK) * _BLOCK
            if info.type == tarfile.XGLTYPE:
                self._count_global(info.size, start + offset)
            if info.type in _PAX_TYPES:
                data = self.window.peek(offset + _BLOCK, padded)
                if len(data) < padded:
                    raise BundleError("archive is truncated inside an extended header", self.path, TRUNCATED_HINT)
                self._check_pax(data, start + offset)
            offset += _BLOCK + padded

    def _count_global(self, size: int, where: int) -> None:
        """Count a global pax header of ``size`` bytes against GLOBAL_LIMIT, for the whole archive: every later
        member inherits its records, so repeating them must not make the reader's time or memory grow."""
        self._global_bytes += size
        if self._global_bytes > GLOBAL_LIMIT:
            raise BundleError(f"its global pax headers (the one at byte {where:,} and those before it) hold more "
                              f"than {GLOBAL_LIMIT:,} bytes in all, more than pallet reads", self.path, _CRAFTED_HINT)

    def _check_pax(self, data: bytes, where: int) -> None:
        problem = framing_problem(data)
        self._digit_cost += digit_cost(data)
        if problem is None and self._digit_cost > DIGIT_COST_LIMIT:
            problem = "its pax headers hold runs of digits too long to parse in reasonable time"
        if problem:
            raise BundleError(f"a pax header (at byte {where:,}) is malformed: {problem}", self.path, _CRAFTED_HINT)

    def _damaged(self, exc: Exception | str, start: int) -> BundleError:
        if start == 0:
            return BundleError(f"not a tar archive or pallet bundle ({exc})", self.path, TRUNCATED_HINT)
        return BundleError(f"archive is damaged or truncated ({exc})", self.path, TRUNCATED_HINT)
