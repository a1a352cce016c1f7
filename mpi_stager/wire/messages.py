"""Session requests and answers, and the listing record every far-side listing is written in."""
from __future__ import annotations

import shlex
from dataclasses import dataclass

import zstandard

from bundles.errors import StreamError
from bundles.state import STATE_DIR

from .versions import install_hint


# ---------------------------------------------------------------- session requests and answers

OK = b"ok\n"
DECLINED = b"declined\n"            # the answer to ``receive-new`` in a DEST that holds something
LISTING_TAG = b"listing"
NOT_COMPARABLE = b"INCOMPLETE"      # the listing of a DEST marked incomplete: it resumes from its journal
MAX_LISTING_HEADER = 64


@dataclass(frozen=True)
class SessionRequest:
    """One request line to a session: ``receive [noverify]`` (a bundle stream follows, up to its index frame),
    ``receive-new [noverify]`` (the same, received only into a DEST the session listed empty: else only the
    stream's prelude and skeleton follow, which are read and dropped), ``dirs N`` (N bytes of directory
    metadata follow, see :func:`encode_dirs`) or ``clear``."""

    op: str
    verify: bool = True
    size: int = 0

    def encode(self) -> bytes:
        receiving = [] if self.verify else ["noverify"]
        words = {"receive": ["receive", *receiving], "receive-new": ["receive-new", *receiving],
                 "dirs": ["dirs", str(self.size)], "clear": ["clear"]}[self.op]
        return " ".join(words).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes, source: str) -> SessionRequest:
        """The request on ``line``; StreamError for anything else."""
        op, *rest = line.decode(errors="replace").split() or [""]
        if op in ("receive", "receive-new") and rest in ([], ["noverify"]):
            return cls(op, verify=not rest)
        if op == "dirs" and len(rest) == 1 and rest[0].isdigit():
            return cls(op, size=int(rest[0]))
        if op == "clear" and not rest:
            return cls(op)
        raise StreamError(f"unknown session request {line[:80]!r}", source, install_hint(None))


def encode_dirs(entries: list[tuple[bytes, int, int]]) -> bytes:
    """``dirs`` payload: per directory, its relative path, mode (octal) and mtime in ns, each NUL-terminated."""
    return b"".join(b"%s\0%o\0%d\0" % (path, mode, mtime) for path, mode, mtime in entries)


def decode_dirs(payload: bytes) -> list[tuple[bytes, int, int]]:
    """The entries of a ``dirs`` payload (:func:`encode_dirs`)."""
    parts = payload.split(b"\0")
    return [(parts[i], int(parts[i + 1], 8), int(parts[i + 2])) for i in range(0, len(parts) - 2, 3)]


def listing_block(listed: bytes) -> bytes:
    """A session's listing as it goes on the wire: ``listing N\\n`` and N bytes, one zstd frame of ``listed``."""
    block = zstandard.ZstdCompressor(level=1).compress(listed)
    return b"%s %d\n" % (LISTING_TAG, len(block)) + block


def listing_size(header: bytes) -> int | None:
    """The N of a ``listing N`` header line; None when ``header`` is no such line."""
    tag, _, size = header.strip().partition(b" ")
    return int(size) if tag == LISTING_TAG and size.isdigit() else None


def decode_listing(block: bytes, source: str) -> bytes:
    """The listing a block's N bytes hold (decoded within a bound of their size; StreamError if damaged)."""
    from bundles.index import decode_zstd_bounded      # the client's alone: a far side starts without it
    return decode_zstd_bounded(block, source, "the session's listing", StreamError, "rerun the push")


# ---------------------------------------------------------------- the listing record (docs/wire.md, "Listing")

# Every entry under DEST except DEST/.pallet as 8 NUL-terminated fields, as GNU find's -printf writes them. The
# session lists with it, and so does every tar-tools script and repair command that lists a far-side tree.
LISTING_FIELDS = ("type", "mode", "mtime", "size", "link target", "inode", "links", "path")
LISTING_ARGV = ("find", ".", "-mindepth", "1", "-path", "./" + STATE_DIR, "-prune", "-o",
                "-printf", r"%y\0%m\0%T@\0%s\0%l\0%i\0%n\0%P\0")
FIND_RECORDS = shlex.join(LISTING_ARGV)


@dataclass(frozen=True)
class FarEntry:
    """One entry of the far side's tree as a listing record reports it."""

    kind: str            # f, d, l (or another find %y letter)
    mode: int
    mtime_ns: int
    size: int
    target: bytes
    inode: int = 0
    links: int = 1


def parse_records(records: bytes) -> dict[bytes, FarEntry]:
    """Relative path -> FarEntry, from listing records (the NUL-terminated :data:`LISTING_FIELDS` each)."""
    parts, entries, width = records.split(b"\0"), {}, len(LISTING_FIELDS)
    for at in range(0, len(parts) - width + 1, width):
        kind, mode, mtime, size, target, inode, links, path = parts[at:at + width]
        entries[path] = FarEntry(kind.decode(), int(mode, 8), _mtime_ns(mtime), int(size), target, int(inode),
                                 int(links))
    return entries


def _mtime_ns(text: bytes) -> int:
    """find's ``%T@`` (seconds with a fraction) in ns; one int() for the usual, non-negative case."""
    seconds, _, fraction = text.partition(b".")
    if not seconds.startswith(b"-"):
        return int(seconds + fraction[:9].ljust(9, b"0"))
    return int(seconds) * 1_000_000_000 - int((fraction[:9] or b"0").ljust(9, b"0"))
