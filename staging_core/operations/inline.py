"""Small selections moved inline over a warm host session: one `put` or `get`, one round trip, no probe."""
from __future__ import annotations

import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bundles.errors import SourceError
from bundles.inline import InlineDirectory, InlineFile, digest, selection_entries, stable_read, write_inline
from bundles.state import holding_lock
from mpi_stager.wire import TooLarge, decode_files, encode_get, encode_put

from staging_core.far_side.host_session import HostSession, NoHostSession
from staging_core.options import StagingOptions
from staging_core.planning.local_profile import route_profile
from staging_core.planning.planner import INLINE_MAX_BYTES, Plan, TreeStats, inline_fits, plan
from staging_core.results import StagingResult
from staging_core.transports.base import Endpoint


@dataclass(frozen=True)
class LocalSelection:
    """What a send would put inline: files (absolute path, relative path) and directories to give their times."""

    files: list[tuple[str, str]]
    dirs: list[InlineDirectory]
    nbytes: int


def send_inline(session: HostSession, src_root: str, items: Sequence[str], dest: Endpoint,
                options: StagingOptions) -> StagingResult | None:
    """Send ``src_root/<item>`` to ``dest``'s path in one ``put`` when the planner picks inline for it (small
    plain files and directories; ``options.strategy`` auto); None when it does not, and NoHostSession when the
    far side cannot serve a host session: the caller sends the usual way. The files are read stably and checked
    at the far side against their digests; DEST's lock is taken there for the put alone."""
    started = time.monotonic()
    selection = local_selection(src_root, items)
    if selection is None:
        return None
    chosen = _plan(dest, options, len(selection.files), selection.nbytes)
    if chosen is None or session.refused:
        return None
    files, contents = [], []
    for full, rel in selection.files:
        data, info = stable_read(full)
        files.append(InlineFile(rel, stat.S_IMODE(info.st_mode), info.st_mtime_ns, len(data), digest(data)))
        contents.append(data)
    payload = encode_put(dest.path, files, selection.dirs, True, contents)
    session.request("put", payload)
    return _result(dest.url(), chosen, files, len(payload), started)


def fetch_inline(session: HostSession, src: Endpoint, items: Sequence[str], dest_root: str,
                 options: StagingOptions, sizes: Sequence[int] | None) -> StagingResult | None:
    """Bring ``items`` below ``src`` into ``dest_root`` in one ``get`` when the planner picks inline for them
    (``sizes`` known: from them; unknown: the far side refuses a selection over the inline limit); None when it
    does not, or the far side cannot serve: the caller fetches the usual way. Each file is checked against the
    digest the far side read it with and put in place whole (bundles.inline), under ``dest_root``'s lock;
    NoHostSession as for :func:`send_inline`."""
    started = time.monotonic()
    known = sum(sizes) if sizes is not None else 0
    chosen = _plan(src, options, len(items), known, local_dest=dest_root)
    if chosen is None or session.refused:
        return None
    try:
        body = session.request("get", encode_get(src.path, items, INLINE_MAX_BYTES))
    except TooLarge:
        return None
    files, at = decode_files(body, src.url())
    dirs = [InlineDirectory(f.path, f.mode, f.mtime_ns) for f in files if f.kind == "d"]
    os.makedirs(dest_root, exist_ok=True)
    with holding_lock(dest_root, wait=True):
        write_inline(dest_root, files, memoryview(body)[at:], dirs, src.url())
    return _result(dest_root, chosen, [f for f in files if f.kind == "f"], len(body), started)


def inline_or_none(session: HostSession | None, work) -> StagingResult | None:
    """``work(session)`` when there is a session; None when there is none or its far side cannot serve one."""
    if session is None:
        return None
    try:
        return work(session)
    except NoHostSession:
        return None


def local_selection(src_root: str, items: Sequence[str]) -> LocalSelection | None:
    """The regular files and directories ``items`` name below ``src_root`` (a directory with everything in it),
    and their parents up to the root; None when anything else is selected (links, devices: the usual way
    carries those) or the selection is larger than inline carries. SourceError names items that do not exist."""
    entries, missing = selection_entries(src_root, items)
    if missing:
        raise SourceError(f"{len(missing)} local path(s) do not exist: {', '.join(missing[:5])}", src_root,
                          "check the paths, and that what writes them has run")
    files: list[tuple[str, str]] = []
    dirs: dict[str, InlineDirectory] = {}
    nbytes = 0
    for rel, info in entries:
        if stat.S_ISREG(info.st_mode):
            files.append((os.path.join(src_root, rel), rel))
            nbytes += info.st_size
        elif stat.S_ISDIR(info.st_mode):
            dirs[rel] = InlineDirectory(rel, stat.S_IMODE(info.st_mode), info.st_mtime_ns)
        else:
            return None
        if nbytes > INLINE_MAX_BYTES:
            return None
    return LocalSelection(files, list(dirs.values()), nbytes)


def _plan(endpoint: Endpoint, options: StagingOptions, files: int, nbytes: int,
          local_dest: str | None = None) -> Plan | None:
    """The planner's choice with inline possible, when it is inline (and no strategy was asked for)."""
    if options.strategy != "auto":
        return None
    stats = TreeStats(files, nbytes)
    if not inline_fits(stats):
        return None
    profile, bundle_possible = route_profile(endpoint, options, True, local_dest, measure=False)
    chosen = plan(stats, profile, 1.0, max(1, options.ranks), bundle_possible, inline_possible=True)
    return chosen if chosen.strategy == "inline" else None


def _result(dest: str, chosen: Plan, files: list[InlineFile], wire_bytes: int, started: float) -> StagingResult:
    return StagingResult(dest, chosen, "inline", "host session", len(files), sum(f.size for f in files), 1,
                         time.monotonic() - started, bytes_sent=wire_bytes)
