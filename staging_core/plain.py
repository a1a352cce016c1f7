"""The plain-tools route: a bundle streamed into the far side's own tar (zstd or gzip there), checked with md5sum."""
from __future__ import annotations

import hashlib
import os
import shlex
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

from bundles.errors import DestinationError, SourceError
from bundles.progress import Progress
from bundles.scan import SourceTree, scan
from bundles.tarformat import Kind
from bundles.writer import iter_shards

from .streaming import RelaySink, prepare_source
from .transports.base import Endpoint, Transport
from .transports.errors import classify

MD5_CHUNK = 256                  # files per local hashing task
ROUNDS = 2                       # a file still wrong after this many sends is an error

# $1 DEST; md5 of the NUL-separated ./names on stdin (none when stdin is empty).
# Prints find records (type, mode, mtime, size, link target, inode, links, path; NUL-terminated), an "E" record, then md5sum lines.
# Both scripts hold a flock on DEST/.pallet: a far-side tar outlives a push killed with -9 until its input ends.
_MANIFEST = r"""
cd -- "$1" 2>/dev/null || { printf 'E\0\0\0\0\0\0\0\0'; exit 0; }
if [ -d .pallet ] && [ ! -L .pallet ]; then     # wait for a tar of a killed push that is still writing
  exec 9<.pallet; flock -w 600 9 || { echo "pallet: an earlier transfer into $1 is still running" >&2; exit 6; }
fi
find . -mindepth 1 -path ./.pallet -prune -o -printf '%y\0%m\0%T@\0%s\0%l\0%i\0%n\0%P\0'
printf 'E\0\0\0\0\0\0\0\0'
xargs -0 -r md5sum --
"""

# $1 DEST, $2 decoder command ("zstd -dc", "gzip -dc" or "cat"): marks DEST incomplete, extracts stdin with GNU tar.
_RECEIVE = r"""
set -e
mkdir -p -- "$1"
cd -- "$1"
if [ -L .pallet ] || { [ -e .pallet ] && { [ ! -d .pallet ] || [ ! -O .pallet ]; }; }; then
  echo "pallet: $1/.pallet is not a directory of yours; remove it" >&2; exit 5
fi
mkdir -p .pallet
exec 9<.pallet                                  # held while tar runs, even if the push that started it is gone
flock -w 600 9 || { echo "pallet: an earlier transfer into $1 is still running" >&2; exit 6; }
rm -f .pallet/INCOMPLETE
: > .pallet/INCOMPLETE
$2 | tar -x -p --no-same-owner -f -
"""

_DECODERS = {"zstd": "zstd -dc", "gzip": "gzip -dc", "none": "cat"}
COMPRESSORS = {"zstd": "zstd -q -c", "gzip": "gzip -c", "none": "cat"}


@dataclass(frozen=True)
class FarEntry:
    """One entry of the far side's tree as `find -printf` reports it."""

    kind: str            # f, d, l (or another find %y letter)
    mode: int
    mtime_ns: int
    size: int
    target: bytes
    inode: int = 0
    links: int = 1


@dataclass
class FarTree:
    """The far side's entries (relative paths as bytes) and the md5 digests it computed."""

    entries: dict[bytes, FarEntry] = field(default_factory=dict)
    md5: dict[bytes, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class PlainRoute(AbstractContextManager):
    """Bundles go into the far side's own ``tar -x``, decoded there with ``codec``'s standard tool."""

    host: str
    codec: str
    pulling: bool = False
    streams = True

    @property
    def description(self) -> str:
        tools = (f"tar -c | {COMPRESSORS[self.codec]} at {self.host}" if self.pulling
                 else f"{_DECODERS[self.codec]} | tar -x at {self.host}")
        return f"plain tools ({tools}, checked with md5sum; `pallet remote install {self.host}` gives the faster " \
               "pallet route)"

    def cleanup(self) -> None:
        """Nothing is left at the far side to remove (a pull's stream is never stored there)."""

    def close(self) -> None:
        """Nothing to release: the route runs through the push's own transport."""

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class PlainOutcome:
    """What a plain-tools push or pull did: files sent (over all rounds), bytes moved, rounds run, seconds per stage."""

    files_sent: int = 0
    bytes_sent: int = 0
    rounds: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)


def push_plain(transport: Transport, tree: SourceTree, endpoint: Endpoint, route: PlainRoute, jobs: int,
               progress: Progress) -> PlainOutcome:
    """Make the tree at ``endpoint`` equal ``tree`` (a full scan of the source) with the far side's own tools.

    The far side lists its tree and hashes (md5sum) the files whose size,
    mtime and mode match the source; entries that are missing or differ in
    type, size, mode, mtime, link target or content are sent as one bundle
    stream into its ``tar -x`` (with their parent
    directories and whole hard-link groups), then listed and hashed again.
    What still differs is sent once more; after :data:`ROUNDS` sends it is
    an error naming the files. Directories whose mode or mtime alone differ
    are fixed with chmod/touch. DEST/.pallet/INCOMPLETE marks DEST while
    tar runs; the caller removes DEST/.pallet after success. Raises
    TransportError for the link, DestinationError for a tree that stays wrong.
    """
    outcome = PlainOutcome()
    clock = _Clock(outcome.stage_seconds)
    with clock("list"):
        far = far_tree(transport, endpoint.path, [])
        same = unchanged_files(tree, far)
        if same:
            far.md5 = far_tree(transport, endpoint.path, same).md5
    with clock("hash"):
        local_md5 = hash_local_files(tree, jobs, set(same))
    wanted = differing(tree, local_md5, far, set(same))
    while wanted:
        if outcome.rounds == ROUNDS:
            raise DestinationError(f"{len(wanted)} file(s) differ from the source after {ROUNDS} sends: "
                                   f"{_names(wanted)}", endpoint.url(),
                                   "check the far side's disk and file system; rerun to try again")
        far, wanted = _send_round(transport, tree, endpoint, route, wanted, local_md5, jobs, progress, outcome)
    with clock("check"):
        _finish_far_side(transport, endpoint, tree, far)
    return outcome


def _send_round(transport: Transport, tree: SourceTree, endpoint: Endpoint, route: PlainRoute, wanted: list[bytes],
                local_md5: dict[bytes, bytes], jobs: int, progress: Progress,
                outcome: PlainOutcome) -> tuple[FarTree, list[bytes]]:
    """Send ``wanted`` once, then list and hash them there: the far tree and what still differs."""
    clock = _Clock(outcome.stage_seconds)
    outcome.rounds += 1
    outcome.files_sent += len(wanted)
    with clock("stream"):
        sent_bytes, sent_md5 = _send(transport, tree, endpoint, route, frozenset(_with_groups(tree, wanted)),
                                     jobs, progress)
    outcome.bytes_sent += sent_bytes
    local_md5.update(sent_md5)
    files = tree_files(tree)
    sent_files = [path for path in wanted if path in files]
    with clock("check"):
        far = far_tree(transport, endpoint.path, sent_files)
        local_md5.update(hash_local_files(tree, jobs, set(sent_files) - set(local_md5)))
    return far, differing(tree, local_md5, far, set(sent_files))


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


def tree_files(tree: SourceTree) -> set[bytes]:
    """The paths of ``tree``'s regular files and hard links."""
    index = tree.index
    return {index.paths[i] for i in range(len(index)) if index.kinds[i] in (Kind.FILE, Kind.HARDLINK)}


def unchanged_files(tree: SourceTree, far: FarTree) -> list[bytes]:
    """Files of ``tree`` the far side holds with the same size, mtime and mode: only their content is in doubt."""
    index, same = tree.index, []
    for i, path in enumerate(index.paths):
        there = far.entries.get(path)
        if index.kinds[i] in (Kind.FILE, Kind.HARDLINK) and there is not None and there.kind == "f" \
                and (there.size, there.mtime_ns, there.mode) == (_size(index, i), index.mtimes[i],
                                                                 index.modes[i] & 0o7777):
            same.append(path)
    return same


def far_tree(transport: Transport, dest: str, hashed: list[bytes]) -> FarTree:
    """List the tree at ``dest`` there, with the md5 of the files ``hashed`` names (relative paths)."""
    names = b"".join(b"./" + path + b"\0" for path in hashed)
    return parse_far_tree(transport.run(["sh", "-c", _MANIFEST, "pallet-list", dest], stdin=names))


def parse_far_tree(output: bytes) -> FarTree:
    """The FarTree that the manifest script printed."""
    fields = output.split(b"\0")
    tree = FarTree()
    at = 0
    while fields[at] != b"E":
        kind, mode, mtime, size, target, inode, links, path = fields[at:at + 8]
        tree.entries[path] = FarEntry(kind.decode(), int(mode, 8), _mtime_ns(mtime), int(size), target, int(inode),
                                      int(links))
        at += 8
    for line in b"\0".join(fields[at + 8:]).splitlines():
        digest, name = _md5_line(line)
        tree.md5[name.removeprefix(b"./")] = digest
    return tree


def differing(tree: SourceTree, local_md5: dict[bytes, bytes], far: FarTree, checked: set[bytes]) -> list[bytes]:
    """Source entries the far tree lacks or holds otherwise (content compared for ``checked`` files only)."""
    index, wanted = tree.index, []
    for i, path in enumerate(index.paths):
        there = far.entries.get(path)
        kind = Kind(index.kinds[i])
        if there is None or there.kind != _FIND_KIND[kind]:
            wanted.append(path)
        elif kind == Kind.SYMLINK:
            if there.target != index.links[i]:
                wanted.append(path)
        elif kind != Kind.DIR and (there.size != _size(index, i) or there.mtime_ns != index.mtimes[i]
                                   or there.mode != index.modes[i] & 0o7777
                                   or (path in checked and far.md5.get(path) != local_md5.get(path))):
            wanted.append(path)
    return wanted


_FIND_KIND = {Kind.FILE: "f", Kind.HARDLINK: "f", Kind.DIR: "d", Kind.SYMLINK: "l"}


def hash_local_files(tree: SourceTree, jobs: int, wanted: set[bytes]) -> dict[bytes, bytes]:
    """md5 of the ``wanted`` files of ``tree`` (a hard link shares its group's), hashed by ``jobs`` workers."""
    index = tree.index
    first = {index.paths[i]: (index.paths[index.link_groups[i]] if index.kinds[i] == Kind.HARDLINK else index.paths[i])
             for i in range(len(index)) if index.paths[i] in wanted}
    digests = md5_of(tree.root, sorted(set(first.values())), jobs)
    return {path: digests[source] for path, source in first.items()}


def md5_of(root: bytes, paths: list[bytes], jobs: int) -> dict[bytes, bytes]:
    """md5 of each file ``paths`` (relative) names under ``root``, by ``jobs`` workers (0: automatic)."""
    from bundles.parallel import jobs_for, pool_for
    chunks = [MD5Chunk(root, paths[at:at + MD5_CHUNK]) for at in range(0, len(paths), MD5_CHUNK)]
    workers = jobs_for(len(paths) * 2e-5, jobs)
    digests: dict[bytes, bytes] = {}
    with pool_for(None, workers) as pool:
        for chunk, hashed in zip(chunks, pool.map(md5_files, chunks, workers == 1)):
            digests.update(zip(chunk.paths, hashed))
    return digests


@dataclass(frozen=True)
class MD5Chunk:
    """A hashing task: files (relative, bytes) under ``root``."""

    root: bytes
    paths: list[bytes]


def md5_files(chunk: MD5Chunk) -> list[bytes]:
    """The md5 digests of ``chunk``'s files, read in 1 MiB pieces; a file that cannot be read is a SourceError."""
    digests = []
    for path in chunk.paths:
        full = os.path.join(chunk.root, path)
        hasher = hashlib.md5(usedforsecurity=False)
        try:
            with open(full, "rb") as handle:
                while piece := handle.read(1 << 20):
                    hasher.update(piece)
        except OSError as exc:
            raise SourceError(f"cannot read ({exc.strerror})", os.fsdecode(full), "check its permissions") from None
        digests.append(hasher.digest())
    return digests


def _send(transport: Transport, tree: SourceTree, endpoint: Endpoint, route: PlainRoute, items: frozenset[bytes],
          jobs: int, progress: Progress) -> tuple[int, dict[bytes, bytes]]:
    """Stream the bundle of ``items`` into the far side's tar; return the bytes written and the md5 of every file
    sent (taken from the bytes packed)."""
    selected = scan(os.fsdecode(tree.root), route.codec, 0, include=items)
    source = prepare_source(os.fsdecode(tree.root), route.codec, jobs, tree=selected)
    far = transport.stream_into(["sh", "-c", _RECEIVE, "pallet-receive", endpoint.path, _DECODERS[route.codec]])
    errors: list[bytes] = []
    drain = threading.Thread(target=lambda: errors.append(far.stderr.read()), name="pallet-tar-stderr", daemon=True)
    drain.start()
    wire = RelaySink(far.stdin.write, far.stdin.flush)
    digests: dict[bytes, bytes] = {}
    progress.start("stream", len(selected.index), sum(selected.index.sizes))
    try:
        for plan, built in iter_shards(source.tree, source.plans, source.codec, source.jobs, lambda plan: wire,
                                       md5=True):
            if plan.big:
                wire.finish()                     # the compressor's relay has passed everything on
            else:
                wire.write(built.compressed)
            _record_md5(selected.index, plan, built, digests)
            progress.advance(plan.count, built.file_bytes)
        far.stdin.close()
    except BrokenPipeError:
        pass                                      # the far side stopped: its status and message say why
    finally:
        progress.finish()
        _close_quietly(far.stdin)
        code = far.wait()
        drain.join()
        far.stdout.close()
    if code != 0:
        raise classify(b"".join(errors).decode(errors="replace"), code, ["tar", "-x"], endpoint.url(),
                       f"the far side's tar failed with status {code}")
    index = selected.index
    for i in range(len(index)):
        if index.kinds[i] == Kind.HARDLINK:
            digests[index.paths[i]] = digests[index.paths[index.link_groups[i]]]
    return wire.length, digests


def _record_md5(index, plan, built, digests: dict[bytes, bytes]) -> None:
    """File by file, the md5 digests a built shard carries."""
    files = (index.paths[i] for i in range(plan.first, plan.first + plan.count) if index.kinds[i] == Kind.FILE)
    for number, path in enumerate(files):
        digests[path] = built.md5s[16 * number:16 * (number + 1)]


def _finish_far_side(transport: Transport, endpoint: Endpoint, tree: SourceTree, far: FarTree) -> None:
    """chmod/touch the far directories whose mode or mtime differ (tar restored those it extracted), then take
    the INCOMPLETE mark away (and DEST/.pallet when that empties it): one remote command."""
    index, lines = tree.index, []
    for i, path in enumerate(index.paths):
        there = far.entries.get(path)
        if index.kinds[i] != Kind.DIR or there is None:
            continue
        name = shlex.quote(os.fsdecode(b"./" + path))
        seconds, nanos = divmod(index.mtimes[i], 1_000_000_000)
        if there.mode != index.modes[i] & 0o7777:
            lines.append(f"chmod {index.modes[i] & 0o7777:o} -- {name}")
        if there.mtime_ns != index.mtimes[i] or there.mode != index.modes[i] & 0o7777:
            lines.append(f"touch -m -d @{seconds}.{nanos:09d} -- {name}")
    lines.append("rm -f .pallet/INCOMPLETE && { rmdir .pallet 2>/dev/null || true; }")
    script = f"cd -- {shlex.quote(endpoint.path)} || exit 0\nset -e\n" + "\n".join(lines) + "\n"
    transport.run(["sh", "-s"], stdin=os.fsencode(script))


def _with_groups(tree: SourceTree, wanted: list[bytes]) -> set[bytes]:
    """``wanted`` plus every member of the hard-link groups it touches (tar links them only together)."""
    index, chosen = tree.index, set(wanted)
    groups = {index.link_groups[i] if index.kinds[i] == Kind.HARDLINK else i
              for i, path in enumerate(index.paths) if path in chosen}
    for i in range(len(index)):
        if index.kinds[i] == Kind.HARDLINK and index.link_groups[i] in groups:
            chosen.update((index.paths[i], index.paths[index.link_groups[i]]))
    return chosen


def _size(index, i: int) -> int:
    return index.sizes[i] if index.kinds[i] == Kind.FILE else index.sizes[index.link_groups[i]]


def _mtime_ns(text: bytes) -> int:
    seconds, _, fraction = text.partition(b".")
    sign = -1 if seconds.startswith(b"-") else 1
    return int(seconds) * 1_000_000_000 + sign * int((fraction[:9] or b"0").ljust(9, b"0"))


def _md5_line(line: bytes) -> tuple[bytes, bytes]:
    """md5sum's ``DIGEST  NAME``; a leading backslash means NAME has \\\\, \\n or \\r escaped."""
    escaped = line.startswith(b"\\")
    digest, name = line[escaped:].split(b"  ", 1)
    if escaped:
        name = name.replace(b"\\\\", b"\0").replace(b"\\n", b"\n").replace(b"\\r", b"\r").replace(b"\0", b"\\")
    return bytes.fromhex(digest.decode()), name


def _names(paths: list[bytes]) -> str:
    shown = ", ".join(os.fsdecode(p) for p in paths[:5])
    return shown + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _close_quietly(pipe) -> None:
    try:
        pipe.close()
    except OSError:
        pass

