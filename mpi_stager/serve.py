"""`mpi_stager serve`: one far-side process for a whole workflow run — stat, list, put and get, one after another."""
from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from typing import BinaryIO

from bundles.errors import DestinationError, PalletError, SourceError, StreamError
from bundles.inline import InlineFile, digest, selection_entries, stable_read, write_inline
from bundles.safety import path_problem
from bundles.state import holding_lock

from .wire import (MAX_LINE, TooLarge, decode_get, decode_put, encode_error, encode_files, far_hello, frame,
                   parse_header, read_exactly)

_SOURCE = "host session"


def run_serve(inp: BinaryIO, out: BinaryIO, client: str | None) -> int:
    """Serve requests on ``inp`` until it ends (docs/wire.md, "The host session"); 0, or 1 when the client
    (its hello ``client``, None: none) shares no host-session version with this far side.

    The hello line comes first. Each request is ``OP SIZE`` and SIZE bytes;
    each answer ``ok SIZE`` or ``error SIZE`` and SIZE bytes, in order. An
    operation that fails answers ``error`` (a PalletError's kind, message,
    path and hint) and the session goes on; a request that cannot be read
    ends it (StreamError). ``put`` holds its DEST's lock while it writes, so
    each operation has its own lock; nothing else is locked.
    """
    hello = far_hello(client)
    out.write(hello.line())
    out.flush()
    if not hello.speaks:
        return 1
    handlers: dict[str, Callable[[bytes], bytes]] = {"stat": stat_paths, "list": list_tree, "put": put_files,
                                                      "get": get_files}
    for line in iter(lambda: inp.readline(MAX_LINE), b""):
        op, size = parse_header(line, _SOURCE)
        payload = read_exactly(inp, size, _SOURCE)
        handler = handlers.get(op)
        try:
            if handler is None:
                raise StreamError(f"unknown host-session request {op!r}", _SOURCE, "use the same pallet on both sides")
            answer = frame("ok", handler(payload))
        except PalletError as exc:
            answer = frame("error", encode_error(exc))
        except OSError as exc:
            answer = frame("error", encode_error(DestinationError(exc.strerror or str(exc), exc.filename,
                                                                  "check the path's permissions and free space")))
        out.write(answer)
        out.flush()
    return 0


# ---------------------------------------------------------------- queries

def stat_paths(payload: bytes) -> bytes:
    """Listing records (mpi_stager.wire.LISTING_FIELDS) of each NUL-separated absolute path that exists."""
    records = []
    for path in filter(None, payload.split(b"\0")):
        try:
            records.append(_record(path, os.lstat(path), path))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return b"".join(records)


def list_tree(payload: bytes) -> bytes:
    """``+`` and the records of everything below the directory ``payload`` (paths relative to it), or ``-`` when
    it does not exist."""
    try:
        return b"+" + b"".join(_record(rel, info, full) for rel, info, full in _walk(payload, b""))
    except (FileNotFoundError, NotADirectoryError):
        return b"-"


def _walk(top: bytes, rel: bytes) -> Iterator[tuple[bytes, os.stat_result, bytes]]:
    with os.scandir(os.path.join(top, rel) if rel else top) as entries:
        for entry in entries:
            name = os.path.join(rel, entry.name) if rel else entry.name
            info = entry.stat(follow_symlinks=False)
            yield name, info, entry.path
            if stat.S_ISDIR(info.st_mode):
                yield from _walk(top, name)


def _record(name: bytes, info: os.stat_result, full: bytes) -> bytes:
    kind = {stat.S_IFREG: b"f", stat.S_IFDIR: b"d", stat.S_IFLNK: b"l"}.get(stat.S_IFMT(info.st_mode), b"o")
    seconds, nanos = divmod(info.st_mtime_ns, 1_000_000_000)
    target = os.readlink(full) if kind == b"l" else b""
    return b"\0".join([kind, b"%o" % stat.S_IMODE(info.st_mode), b"%d.%09d" % (seconds, nanos), b"%d" % info.st_size,
                       target, b"%d" % info.st_ino, b"%d" % info.st_nlink, name, b""])


# ---------------------------------------------------------------- put and get

def put_files(payload: bytes) -> bytes:
    """Write a ``put``'s files under its DEST (made if missing) while holding DEST's lock, as
    :func:`bundles.inline.write_inline` does; the answer is ``FILES BYTES`` written."""
    request = decode_put(payload, _SOURCE)
    for name in [f.path for f in request.files] + [d.path for d in request.dirs]:
        problem = path_problem(os.fsencode(name))
        if problem is not None:
            raise StreamError(f"{name!r} cannot be written ({problem})", request.dest, "rerun with the same pallet")
    try:
        os.makedirs(request.dest, exist_ok=True)
    except OSError as exc:
        raise DestinationError(f"cannot create the destination ({exc.strerror})", request.dest,
                               "check that DEST is a directory you can write, or can be made") from None
    with holding_lock(request.dest, wait=request.wait):
        files, nbytes = write_inline(request.dest, request.files, memoryview(payload)[request.body_at:],
                                     request.dirs, _SOURCE)
    return b"%d %d" % (files, nbytes)


def get_files(payload: bytes) -> bytes:
    """The files (and directories, and the parents of each selected path below the root) of a ``get`` selection
    with their bytes, each file read stably (:func:`bundles.inline.stable_read`). SourceError names paths that
    do not exist; TooLarge when the selection holds more bytes than its limit, or anything but files and
    directories."""
    root, paths, limit = decode_get(payload, _SOURCE)
    entries, missing = selection_entries(root, paths)
    if missing:
        raise SourceError(f"{len(missing)} path(s) do not exist: {', '.join(missing[:5])}", root,
                          "check the URL, and that what makes it has run")
    if any(not (stat.S_ISREG(i.st_mode) or stat.S_ISDIR(i.st_mode)) for _, i in entries) or \
            sum(i.st_size for _, i in entries if stat.S_ISREG(i.st_mode)) > limit:
        raise TooLarge("the selection is not small plain files", root)
    files, contents = [], []
    for rel, info in entries:
        if stat.S_ISDIR(info.st_mode):
            files.append(InlineFile(rel, stat.S_IMODE(info.st_mode), info.st_mtime_ns, 0, "", "d"))
            continue
        data, info = stable_read(os.path.join(root, rel))
        files.append(InlineFile(rel, stat.S_IMODE(info.st_mode), info.st_mtime_ns, len(data), digest(data)))
        contents.append(data)
    return encode_files(files, contents)
