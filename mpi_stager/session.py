"""`mpi_stager session DEST`: one far-side process for a whole push — lock, listing, stream and finishing touches."""
from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import BinaryIO

from bundles.errors import DestinationError, StreamError
from bundles.state import INCOMPLETE, STATE_DIR, holding_lock, remove_state, state_path

from .wire import (DECLINED, LISTING_ARGV, NOT_COMPARABLE, OK, Hello, SessionRequest, WireVersionError, far_hello_for,
                   install_hint, listing_block)

# What serves the requests (the receiver, the stream's framing) is loaded after the hello and the listing are out,
# so that it loads while they travel: the client answers them with the stream's first shard.


def run_session(dest: str, inp: BinaryIO, out: BinaryIO, wait: bool = False, listing: bool = False,
                client: Hello | None = None) -> int:
    """Serve one push into ``dest`` over ``inp``/``out`` (the session protocol, docs/wire.md) and return the
    number of requests served.

    DEST is made if missing and locked (the flock `pallet push` takes;
    DestinationLocked at once if another operation holds it, or with
    ``wait`` once it is free) for as long as the session runs, so the lock
    dies with it. Then the far side's hello is written: its versions and
    capabilities, opening with the session version it speaks to ``client``
    (the client's hello, None: it sent none). A client it has no common
    version with is then refused (WireVersionError). With ``listing`` one
    block follows, ``listing N\\n`` + N bytes, one zstd frame of DEST's
    entries as :data:`mpi_stager.wire.LISTING_ARGV` prints them, or of
    ``INCOMPLETE`` for a DEST marked incomplete. Then
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
        _hello(out, client, source)
        listed = _listing(dest) if listing else NOT_COMPARABLE
        if listing:
            out.write(listing_block(listed))
        out.flush()
        for line in iter(inp.readline, b""):
            request = SessionRequest.decode(line, source)
            out.write(_serve(request, dest, inp, out, empty=served == 0 and listed == b""))
            out.flush()
            served += 1
    return served


def _hello(out: BinaryIO, client: Hello | None, source: str) -> None:
    """Write the far side's hello to ``client``; WireVersionError (after it) when they share no version."""
    hello, agreed = far_hello_for(client)
    out.write(hello.far_line())
    if not agreed.ok:
        out.flush()
        raise WireVersionError(agreed.problem(client_side=False), source, install_hint(None))


def _serve(request: SessionRequest, dest: str, inp: BinaryIO, out: BinaryIO, empty: bool = False) -> bytes:
    """Carry out ``request`` (``empty``: DEST was listed empty and nothing has been served since); its answer."""
    if request.op == "receive-new" and not empty:
        drop_offer(inp, f"session at {dest}")
        return DECLINED
    if request.op in ("receive", "receive-new"):
        from .receive import receive
        from .wire import encode_summary
        summary = receive(inp, out, dest, request.verify, lock_held=True, ends_at_index=True)
        return encode_summary(summary).encode() + b"\n"
    if request.op == "dirs":
        from .wire import decode_dirs, read_exactly
        set_directories(dest, decode_dirs(read_exactly(inp, request.size, f"session at {dest}")))
    else:
        remove_state(dest)
    return OK


def set_directories(dest: str, entries: list[tuple[bytes, int, int]]) -> None:
    """Give DEST's directories ``entries`` (relative path, mode, mtime ns) that mode (without setuid and setgid)
    and mtime; an entry that is not a safe name, not a directory, or reached through a link, is left alone."""
    from bundles.safety import path_problem, safe_mode
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
    from bundles.stream import FrameKind, FrameReader
    reader = FrameReader(inp, source)
    reader.prelude()
    frame = reader.next()
    if frame is None or frame.kind != FrameKind.SKELETON:
        raise StreamError("a receive-new request is not followed by a stream's skeleton", source,
                          install_hint(None))


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
    if _holds_nothing(dest):
        return b""                  # what find prints there, without starting it (a push into a new DEST)
    import subprocess
    found = subprocess.run(LISTING_ARGV, cwd=dest, stdin=subprocess.DEVNULL, capture_output=True)
    if found.returncode != 0:
        said = found.stderr.decode(errors="replace").strip().splitlines()
        raise DestinationError(f"cannot list the destination ({said[-1] if said else found.returncode})", dest,
                               "make everything under DEST readable to you, then rerun")
    return found.stdout


def _holds_nothing(dest: str) -> bool:
    """Whether DEST holds no entry but DEST/.pallet (False when it cannot be read: find then says why)."""
    try:
        with os.scandir(dest) as entries:
            return all(entry.name == STATE_DIR for entry in entries)
    except OSError:
        return False
