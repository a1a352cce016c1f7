"""Push with the tar-tools route: one far-side shell session, shards into its tar, md5sum checks alongside."""
from __future__ import annotations

import os
import time
from binascii import hexlify
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import BinaryIO

from bundles.codecs import get_codec
from bundles.errors import DestinationError, PalletError
from bundles.progress import Progress
from bundles.scan import SourceTree, scan
from bundles.tarformat import Kind, member_header
from bundles.writer import iter_shards
from mpi_stager.send import RelaySink, prepare_source
from mpi_stager.wire import parse_records

from staging_core.routes.tar_tools import (DECODERS, ROUNDS, FarTree, TarToolsOutcome, TarToolsRoute, differing,
                                           hash_local_files, link_groups, parse_md5_lines, regrouped, shown_names,
                                           unchanged_files, with_link_groups)
from staging_core.routes.tar_tools_session import FarSession, FrameWriter
from staging_core.transports.base import Endpoint, Transport

TAR_RUN_BYTES = 16 << 20  # shard bytes (uncompressed) per far-side tar run; its files are checked as the next arrives
OWNER_RWX = 0o700          # directories are extracted writable by us; their own modes are set last


def push_tar_tools(transport: Transport, tree: SourceTree, endpoint: Endpoint, route: TarToolsRoute, jobs: int,
                   progress: Progress, clear_state: bool = True) -> TarToolsOutcome:
    """Make the tree at ``endpoint`` equal ``tree`` (a full scan of the source) with the far side's own tools.

    Everything runs in one far-side shell session (tar_tools_session.py). It
    lists its tree and hashes (md5sum) the files whose size, mtime and mode
    match the source; entries that are missing or differ in type, size,
    mode, mtime, link target or content are sent as bundle shards (with
    their parent directories and whole hard-link groups) in runs of about
    :data:`TAR_RUN_BYTES`, each run extracted by one ``tar -x``, its files
    hashed there while the next run arrives. Directory modes and mtimes are set last, by one
    more tar of directory entries only. A file whose digest differs from
    the one taken while packing is sent once more; after :data:`ROUNDS`
    sends it is an error naming the files. DEST/.pallet/INCOMPLETE marks
    DEST while tar runs; with ``clear_state`` all of DEST/.pallet goes at
    the end. Raises TransportError for the link, DestinationError for a
    tree that stays wrong or a far side that refuses.
    """
    outcome = TarToolsOutcome()
    clock = _Clock(outcome.stage_seconds)
    with route.sessions.attempt(transport, endpoint, DECODERS[route.codec]) as session:
        with clock("list"):
            far = FarTree(parse_records(session.listing()))
            same = unchanged_files(tree, far, whole_seconds=True)
        with clock("hash"):
            local_md5 = hash_local_files(tree, jobs, set(same))
            checks = FarChecks(session, endpoint)
            checks.queue(same, local_md5)
            wrong = set(checks.wait(local_md5))
            far.md5 = {path: local_md5[path] for path in same if path not in wrong}
        wanted = sorted(set(differing(tree, local_md5, far, set(same), whole_seconds=True))
                        | regrouped(link_groups(tree), far.entries))
        restamped = _directories_there(tree, far, wanted)
        wanted = [path for path in wanted if path not in restamped]
        _count_files(tree, wanted, outcome)
        while wanted:
            if outcome.rounds == ROUNDS:
                raise DestinationError(f"{len(wanted)} file(s) differ from the source after {ROUNDS} sends: "
                                       f"{shown_names(wanted)}", endpoint.url(),
                                       "check the far side's disk and file system; rerun to try again")
            wanted = _send_round(checks, tree, route, wanted, local_md5, jobs, progress, outcome, restamped)
        if restamped and not outcome.rounds:
            outcome.bytes_sent += _send_directories(session, tree.index, restamped, get_codec(route.codec))
        with clock("finish"):
            session.finish(clear_state, os.stat(tree.root).st_mtime_ns if clear_state else None)
    return outcome


class FarChecks:
    """Files queued for checking at the far side since the last :meth:`wait`, in order: each as an md5sum check
    line (its digest taken here) that the far side's ``md5sum -c`` checks, so that only failures come back; a
    name a check line cannot carry (a newline, carriage return or backslash in it) is hashed there instead and
    its digest comes back."""

    def __init__(self, session: FarSession, endpoint: Endpoint):
        self.session, self.endpoint = session, endpoint
        self.lines: list[bytes] = []        # the paths of the check lines queued, in order
        self.odd: list[bytes] = []          # the paths to hash there

    def queue(self, paths: list[bytes], digests: dict[bytes, bytes]) -> None:
        """Queue ``paths`` (files already there) with their ``digests``."""
        plain = [path for path in paths if not _odd(path)]
        odd = [path for path in paths if _odd(path)] if len(plain) != len(paths) else []
        lines = b"".join(b"%s  ./%s\n" % (hexlify(digests[path]), path) for path in plain)
        self.session.queue_check(lines, _names_input(odd))
        self.lines += plain
        self.odd += odd

    def wait(self, digests: dict[bytes, bytes]) -> list[bytes]:
        """Wait for the far side's checks of what was queued: the paths whose content there is not ``digests``'s.
        Raises DestinationError when its md5sum did not check every line (it cannot vouch for the files)."""
        if not self.lines and not self.odd:
            return []
        reply, lines, odd = self.session.checked(), self.lines, self.odd
        self.lines, self.odd = [], []
        if reply.count != len(lines) or (reply.status != 0 and not reply.failed) \
                or any(not 0 < number <= len(lines) for number in reply.failed):
            raise DestinationError(f"the far side's md5sum -c checked {reply.count} of {len(lines)} files "
                                   f"(status {reply.status}): it cannot vouch for them", self.endpoint.url(),
                                   "check that md5sum there is GNU coreutils' (md5sum -c), then rerun")
        there = parse_md5_lines(reply.sums) if odd else {}
        return [lines[number - 1] for number in reply.failed] + [path for path in odd
                                                                 if there.get(path) != digests[path]]


def _odd(path: bytes) -> bool:
    """Whether md5sum -c cannot read ``path`` back as it is in a check line (a newline, carriage return or
    backslash in it)."""
    return b"\n" in path or b"\r" in path or b"\\" in path


def _count_files(tree: SourceTree, wanted: list[bytes], outcome: TarToolsOutcome) -> None:
    """Count the source's regular files the far side lacks or holds otherwise (``wanted``, with whole hard-link
    groups) as sent, and the others as in place, as every route counts them."""
    index, sending = tree.index, set(with_link_groups(tree, wanted))
    for i in range(len(index)):
        if index.kinds[i] == Kind.FILE:
            if index.paths[i] in sending:
                outcome.files_sent += 1
                outcome.file_bytes += index.sizes[i]
            else:
                outcome.in_place += 1


def _directories_there(tree: SourceTree, far: FarTree, wanted: list[bytes]) -> frozenset[bytes]:
    """The directories of ``wanted`` the far side holds as directories: only their mode or mtime differ. They go
    as directory headers alone (sending one as an entry would send everything under it again)."""
    index, entries = tree.index, far.entries
    dirs = {index.paths[i] for i in range(len(index)) if index.kinds[i] == Kind.DIR}
    return frozenset(path for path in wanted if path in dirs and getattr(entries.get(path), "kind", "") == "d")


def _send_round(checks: FarChecks, tree: SourceTree, route: TarToolsRoute, wanted: list[bytes],
                local_md5: dict[bytes, bytes], jobs: int, progress: Progress, outcome: TarToolsOutcome,
                restamped: frozenset[bytes] = frozenset()) -> list[bytes]:
    """Send ``wanted`` once (and the headers of the directories ``restamped``); the files whose digest there
    still differs from the source's."""
    clock = _Clock(outcome.stage_seconds)
    outcome.rounds += 1
    with clock("stream"):
        sent = _send(checks, tree, route, frozenset(with_link_groups(tree, wanted)), jobs, progress, restamped)
    outcome.bytes_sent += sent.bytes
    local_md5.update(sent.md5)
    with clock("check"):
        return checks.wait(local_md5)


class _Clock:
    """``with clock(name):`` adds the block's wall seconds to ``seconds[name]``."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    @contextmanager
    def __call__(self, name: str):
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started


@dataclass
class SentShards:
    """What one send round wrote: bytes on the wire and the md5 of every file sent (taken while packing)."""

    md5: dict[bytes, bytes] = field(default_factory=dict)     # before ``bytes``, which names an int in here
    bytes: int = 0


def _send(checks: FarChecks, tree: SourceTree, route: TarToolsRoute, items: frozenset[bytes], jobs: int,
          progress: Progress, restamped: frozenset[bytes]) -> SentShards:
    """Stream the bundle of ``items`` into the session in runs of shards, each run extracted by one tar and its
    files queued for checking; then one tar of directories alone (those the bundle held, and ``restamped``)
    sets their modes and mtimes."""
    root = os.fsdecode(tree.root)
    selected = tree if len(items) == len(tree.index) else scan(root, route.codec, 0, include=items)
    source = prepare_source(root, route.codec, jobs, tree=selected)
    index, sent = selected.index, SentShards()
    digests = _ShardDigests(index, sent.md5)
    runs = _TarBatches(checks, sent.md5, sum(index.sizes) + 1024 * len(index))
    dir_modes = _writable_dirs(index)
    progress.start("stream", len(index), sum(index.sizes))
    try:
        for plan, built in iter_shards(source.tree, source.plans, source.codec, source.jobs, runs.open_big,
                                       md5=True):
            sent.bytes += runs.add(plan, built, digests.record(plan, built))
            progress.advance(plan.count, built.file_bytes)
        digests.check_all_taken(root)
    finally:
        for i, mode in dir_modes.items():
            index.modes[i] = mode
        progress.finish()
    stamped = restamped | {index.paths[i] for i in range(len(index)) if index.kinds[i] == Kind.DIR}
    sent.bytes += _send_directories(checks.session, tree.index, stamped, source.codec)
    return sent


class _TarBatches:
    """Consecutive shards grouped into far-side tar runs of about :data:`TAR_RUN_BYTES`; each run's files are
    queued for checking (with their ``digests``) when it ends. Toward the end a run also ends once it holds as
    much as is left to send (about ``total`` bytes in all), so the last runs halve and the check of the last,
    which nothing overlaps, is short. A big shard's compressor output is relayed into the open run."""

    def __init__(self, checks: FarChecks, digests: dict[bytes, bytes], total: int):
        self.checks, self.session, self.digests = checks, checks.session, digests
        self.frames: FrameWriter | None = None
        self.relay: RelaySink | None = None
        self.names: list[bytes] = []
        self.run_bytes = 0
        self.left = total

    def open_big(self, plan) -> BinaryIO:
        """iter_shards' sink for a big shard: relay the compressor's output into the open run."""
        self.relay = RelaySink(self._open().write)
        return self.relay.as_file()

    def add(self, plan, built, files: list[bytes]) -> int:
        """Send a built shard (a big one has gone through the relay); the compressed bytes it took."""
        if plan.big and self.relay is not None:         # open_big made it for this shard
            sent = self.relay.finish()[1]
        else:
            self._open().write(built.compressed)
            sent = len(built.compressed)
        self.names.extend(files)
        taken = built.file_bytes + 1024 * plan.count
        self.run_bytes, self.left = self.run_bytes + taken, self.left - taken
        if self.run_bytes >= min(TAR_RUN_BYTES, self.left) or plan.last:
            self.end()
        return sent

    def end(self) -> None:
        """End the open run there and queue its files for checking."""
        if self.frames is not None:
            self.session.end_shard(self.frames)
            self.checks.queue(self.names, self.digests)
        self.frames, self.names, self.run_bytes = None, [], 0

    def _open(self) -> FrameWriter:
        if self.frames is None:
            self.frames = self.session.shard()
        return self.frames


def _writable_dirs(index) -> dict[int, int]:
    """Make every directory of ``index`` owner-writable (later shards write into it); the modes it had."""
    kinds, modes = index.kinds, index.modes
    changed = {i: modes[i] for i in range(len(index)) if kinds[i] == Kind.DIR and modes[i] & OWNER_RWX != OWNER_RWX}
    for i in changed:
        index.modes[i] |= OWNER_RWX
    return changed


def _send_directories(session: FarSession, index, chosen: frozenset[bytes] | set[bytes], codec) -> int:
    """One tar of the directories of ``index`` that are ``chosen`` alone, in the tree's order, so the far tar
    sets their true modes and mtimes last."""
    paths, kinds, modes, mtimes = index.paths, index.kinds, index.modes, index.mtimes
    headers = b"".join(member_header(paths[i], Kind.DIR, modes[i], mtimes[i], 0, b"")
                       for i in range(len(index)) if kinds[i] == Kind.DIR and paths[i] in chosen)
    if not headers:
        return 0
    compressed = codec.compress(headers + bytes(1024))
    frames = session.shard()
    frames.write(compressed)
    session.end_shard(frames)
    return len(compressed)


class _ShardDigests:
    """Records, shard by shard in order, the md5 digests a built shard carries (one per regular file, in entry
    order) under the files' paths, and a hard link's under its name (its group's, recorded before it: tar
    order puts the file first); :meth:`record` returns the shard's files and hard links, to check there."""

    def __init__(self, index, digests: dict[bytes, bytes]):
        self.index, self.digests, self.taken = index, digests, 0
        self.files = [index.paths[i] for i in range(len(index)) if index.kinds[i] == Kind.FILE]

    def record(self, plan, built) -> list[bytes]:
        md5s, count = built.md5s, len(built.md5s) // 16
        files = self.files[self.taken:self.taken + count]
        self.taken += count
        self.digests.update(zip(files, [md5s[at:at + 16] for at in range(0, 16 * count, 16)], strict=False))
        kinds = self.index.kinds
        if Kind.HARDLINK in kinds[plan.first:plan.first + plan.count]:
            paths, groups = self.index.paths, self.index.link_groups
            links = [i for i in range(plan.first, plan.first + plan.count) if kinds[i] == Kind.HARDLINK]
            self.digests.update((paths[i], self.digests[paths[groups[i]]]) for i in links)
            files += [paths[i] for i in links]
        return files

    def check_all_taken(self, source: str) -> None:
        """Raise unless every regular file got its digest: one left without would go unchecked there."""
        if self.taken != len(self.files):
            raise PalletError(f"the packer gave md5 digests for {self.taken} of {len(self.files)} files", source,
                              "report this as a defect of pallet")


def _names_input(paths: list[bytes]) -> bytes:
    """``paths`` as the far side's xargs -0 takes them: ./NAME, each ended by a NUL."""
    return b"./" + b"\0./".join(paths) + b"\0" if paths else b""
