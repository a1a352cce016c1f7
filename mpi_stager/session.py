"""`mpi_stager session DEST`: one far-side process for a whole push — lock, listing, stream and finishing touches."""
from __future__ import annotations

import os
import subprocess
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO

import zstandard

from bundles.errors import DestinationError, StreamError
from bundles.safety import path_problem, safe_mode
from bundles.state import INCOMPLETE, STATE_DIR, holding_lock, remove_state, state_path
from bundles.stream import FrameKind, FrameReader

from .receive import receive
from .summaries import encode

SESSION_VERSION = 2
HELLO = b"pallet-session %d\n" % SESSION_VERSION
HELLO_PREFIX = b"pallet-session "
LISTING_TAG = b"listing"
NOT_COMPARABLE = b"INCOMPLETE"      # the listing of a DEST marked incomplete: it resumes from its journal
OK = b"ok\n"
DECLINED = b"declined\n"      # the answer to ``receive-new`` in a DEST that holds something

# Every entry under DEST except DEST/.pallet as 8 NUL-terminated fields: type, mode, mtime, size, link target,
# inode, links, path (staging_core.routes.tar_tools.parse_records reads them; its far-side scripts run the same find).
LISTING_ARGV = ("find", ".", "-mindepth", "1", "-path", "./" + STATE_DIR, "-prune", "-o",
                "-printf", r"%y\0%m\0%T@\0%s\0%l\0%i\0%n\0%P\0")


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
    def decode(cls, line: bytes, source: str) -> "SessionRequest":
        """The request on ``line``; StreamError for anything else."""
        op, *rest = line.decode(errors="replace").split()
        if op in ("receive", "receive-new") and rest in ([], ["noverify"]):
            return cls(op, verify=not rest)
        if op == "dirs" and len(rest) == 1 and rest[0].isdigit():
            return cls(op, size=int(rest[0]))
        if op == "clear" and not rest:
            return cls(op)
        raise StreamError(f"unknown session request {line[:80]!r}", source, "run the same pallet version on both sides")


def run_session(dest: str, inp: BinaryIO, out: BinaryIO, wait: bool = False, listing: bool = False) -> int:
    """Serve one push into ``dest`` over ``inp``/``out`` (session protocol v2, docs/bundle-format.md §8) and return
    the number of requests served.

    DEST is made if missing and locked (the flock `pallet push` takes;
    DestinationLocked at once if another operation holds it, or with
    ``wait`` once it is free) for as long as the session runs, so the lock
    dies with it. Then ``HELLO`` is written, and with ``listing`` one block
    ``listing N\\n`` + N bytes, one zstd frame of DEST's entries as
    :data:`LISTING_ARGV` prints them, or of ``INCOMPLETE`` for a DEST marked
    incomplete. Then
    :class:`SessionRequest` lines are served until ``inp`` ends: ``receive``
    runs :func:`mpi_stager.receive.receive` on the stream that follows and
    answers its JSON summary; ``receive-new``, as the first request after
    an empty listing, does the same, and otherwise drops the prelude and
    skeleton that follow and answers ``declined``; ``dirs`` gives
    directories their mode and mtime; ``clear`` removes DEST/.pallet; both
    answer ``ok``. Requests may arrive before the hello is read. A failed
    request raises (PalletError): the session ends, and the lock with it.
    """
    source = f"session at {dest}"
    served = 0
    with _locked(dest, wait):
        out.write(HELLO)
        listed = _listing(dest) if listing else NOT_COMPARABLE
        if listing:
            block = zstandard.ZstdCompressor(level=1).compress(listed)
            out.write(b"%s %d\n" % (LISTING_TAG, len(block)) + block)
        out.flush()
        for line in iter(inp.readline, b""):
            request = SessionRequest.decode(line, source)
            out.write(_serve(request, dest, inp, out, empty=served == 0 and listed == b""))
            out.flush()
            served += 1
    return served


def _serve(request: SessionRequest, dest: str, inp: BinaryIO, out: BinaryIO, empty: bool = False) -> bytes:
    """Carry out ``request`` (``empty``: DEST was listed empty and nothing has been served since); its answer."""
    if request.op == "receive-new" and not empty:
        drop_offer(inp, f"session at {dest}")
        return DECLINED
    if request.op in ("receive", "receive-new"):
        summary = receive(inp, out, dest, request.verify, lock_held=True, ends_at_index=True)
        return encode(summary).encode() + b"\n"
    if request.op == "dirs":
        set_directories(dest, decode_dirs(read_exactly(inp, request.size, f"session at {dest}")))
    else:
        remove_state(dest)
    return OK


def encode_dirs(entries: list[tuple[bytes, int, int]]) -> bytes:
    """``dirs`` payload: per directory, its relative path, mode (octal) and mtime in ns, each NUL-terminated."""
    return b"".join(b"%s\0%o\0%d\0" % (path, mode, mtime) for path, mode, mtime in entries)


def decode_dirs(payload: bytes) -> list[tuple[bytes, int, int]]:
    fields = payload.split(b"\0")
    return [(fields[i], int(fields[i + 1], 8), int(fields[i + 2])) for i in range(0, len(fields) - 2, 3)]


def set_directories(dest: str, entries: list[tuple[bytes, int, int]]) -> None:
    """Give DEST's directories ``entries`` (relative path, mode, mtime ns) that mode (without setuid and setgid)
    and mtime; an entry that is not a safe name, not a directory, or reached through a link, is left alone."""
    root = os.fsencode(dest)
    for path, mode, mtime in entries:
        if path_problem(path) is not None:
            continue
        target = os.path.join(root, path)
        if os.path.realpath(target) != os.path.join(os.path.realpath(root), path) or not os.path.isdir(target):
            continue
        try:
            os.chmod(target, safe_mode(mode))
            os.utime(target, ns=(mtime, mtime))
        except OSError as exc:
            raise DestinationError(f"cannot set a directory's mode and time ({exc.strerror})", os.fsdecode(target),
                                   "make it yours and writable, then rerun") from None


def drop_offer(inp: BinaryIO, source: str) -> None:
    """Read and drop a declined stream's prelude and skeleton (all that a ``receive-new`` sender writes before
    it reads the listing); StreamError if anything else follows the request."""
    reader = FrameReader(inp, source)
    reader.prelude()
    frame = reader.next()
    if frame is None or frame.kind != FrameKind.SKELETON:
        raise StreamError("a receive-new request is not followed by a stream's skeleton", source,
                          "run the same pallet version on both sides")


def read_exactly(inp: BinaryIO, size: int, source: str) -> bytes:
    data = inp.read(size)
    if len(data) != size:
        raise StreamError(f"a request ends after {len(data)} of {size} bytes", source, "rerun the push")
    return data


def _locked(dest: str, wait: bool) -> AbstractContextManager:
    """DEST made if missing, then its lock (:func:`bundles.state.holding_lock`)."""
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as exc:
        raise DestinationError(f"cannot create the destination ({exc.strerror})", dest,
                               "check that DEST is a directory you can write, or can be made") from None
    return holding_lock(dest, wait=wait)


def _listing(dest: str) -> bytes:
    if os.path.lexists(state_path(dest, INCOMPLETE)):
        return NOT_COMPARABLE
    found = subprocess.run(LISTING_ARGV, cwd=dest, stdin=subprocess.DEVNULL, capture_output=True)
    if found.returncode != 0:
        said = found.stderr.decode(errors="replace").strip().splitlines()
        raise DestinationError(f"cannot list the destination ({said[-1] if said else found.returncode})", dest,
                               "make everything under DEST readable to you, then rerun")
    return found.stdout
