"""Check a bundle against its index, and a destination tree against a bundle's index."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from . import container, native
from .errors import BundleError, CorruptBundleError, PalletError
from .extract import check_members, held_whole, members_end
from .extract_common import SHARD_WINDOW, RangeReader, hash_range, read_up_to
from .index import Index, Shard, content_hash, new_hasher
from .jobs import ShardJob, shard_jobs
from .parallel import WorkerPool, jobs_for
from .reader import Bundle
from .safety import safe_mode
from .shards import entry_header
from .tarformat import END_OF_ARCHIVE, Kind
from .state import STATE_DIR
from .unpacking import shard_cost


@dataclass
class VerifyReport:
    """Problems found (empty when all is well) and how much was checked."""

    problems: list[str] = field(default_factory=list)
    shards: int = 0
    entries: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_bundle(bundle: Bundle, jobs: int = 0) -> VerifyReport:
    """Check every shard's bytes, headers and file hashes, the index section at the end, and the sidecar.

    A damaged shard is reported with the files it holds, and each file that
    no longer matches its hash is named.
    """
    index = bundle.index
    if index is None:
        raise BundleError("has no pallet index, so it cannot be verified", bundle.path,
                          "bundles written by `pallet pack` end with their index: if this is one, its end is "
                          "cut or damaged; fetch it again, or put its .pidx next to it")
    report = VerifyReport(shards=len(index.shards), entries=len(index))
    report.problems += _sidecar_problems(bundle)
    report.problems += _index_section_problems(bundle, index)
    jobs = min(jobs_for(sum(map(shard_cost, index.shards)), jobs), max(1, len(index.shards)))
    with WorkerPool(jobs, native.releases_gil()) as pool:
        for problems in pool.map(_check_job, shard_jobs(bundle, index.shards)):
            report.problems += problems
    expected_end = index.shards[-1].offset + index.shards[-1].length if index.shards else 0
    if index.shards and expected_end > bundle.size:
        report.problems.append(f"bundle is truncated: shards end at byte {expected_end}, file has {bundle.size}")
    return report


def _sidecar_problems(bundle: Bundle) -> list[str]:
    sidecar = bundle.path + ".pidx"
    if not os.path.exists(sidecar):
        return []
    if bundle.sidecar_index is None:
        return [f"sidecar index {sidecar} is damaged (it differs from the index embedded in the bundle)"]
    return []


def _index_section_problems(bundle: Bundle, index: Index) -> list[str]:
    """The bytes after the last shard must be the index section and the locator pack writes: the stored index
    right after the last shard, in its codec's wrapper, holding this index (compared decoded: another zstd
    may compress the same index into other bytes), then exactly the locator that points to it."""
    end = max((s.offset + s.length for s in index.shards), default=0)
    try:
        loc = container.read_locator(bundle.fd, bundle.size, index.codec)
        if loc is not None and loc.index_offset == end:
            stored = os.pread(bundle.fd, loc.index_length, end)
            expected = container.located(index.codec, stored, end, index.format)
            payload = container.read_index_payload(bundle.fd, loc, index.codec, bundle.path)
            if os.pread(bundle.fd, len(expected), end) == expected and \
                    Index.blob_of(payload, bundle.path) == index.to_blob():
                return []
    except PalletError:
        pass
    return [f"the embedded index or its locator after byte {end} is damaged, missing or cut short"]


def _check_job(job: ShardJob) -> list[str]:
    """Check one shard, in a worker or inline."""
    try:
        bundle = job.bundle.open()
    except BundleError as exc:
        return [f"shard {job.shard.number}: {exc}"]
    with bundle:
        return check_shard(bundle, job.entries, job.shard, job.last)


def check_shard(bundle: Bundle, index: Index, shard: Shard, last: bool) -> list[str]:
    """Return the problems of one shard (the ``last`` one ends the archive): hash, decompression, headers, files."""
    if not held_whole(index, shard):
        return _check_streamed_shard(bundle, index, shard, last)
    try:
        compressed = bundle.read_shard(shard)
    except BundleError as exc:
        return [exc.message]
    problems = []
    if content_hash(compressed) != shard.hash:
        problems.append(f"shard {shard.number}: its bytes do not match the index hash; {_holds(index, shard)}")
    try:
        data = bundle.codec.decompress(compressed, shard.raw_size)
    except BundleError as exc:
        return problems + [f"shard {shard.number}: {exc.message}; {_holds(index, shard)}"]
    try:
        check_members(memoryview(data), index, shard, bundle.path, last)
    except CorruptBundleError as exc:
        problems.append(exc.message)
    problems += _contents_problems(index, shard, data)
    if last and not _tail_matches(index, shard, data):
        problems.append(f"shard {shard.number}: the end-of-archive blocks do not match")
    return problems


def _tail_matches(index: Index, shard: Shard, data: bytes) -> bool:
    return data[members_end(index, shard):] == END_OF_ARCHIVE


def _check_streamed_shard(bundle: Bundle, index: Index, shard: Shard, last: bool) -> list[str]:
    """Check a shard not held whole (see bundles.extract.held_whole) as a stream, member by member."""
    problems: list[str] = []
    try:
        stream = bundle.codec.open_stream(RangeReader(bundle.fd, shard.offset, shard.length), SHARD_WINDOW)
        position = 0
        for i in _entry_range(shard):
            position = _check_streamed_member(stream, index, i, position, problems)
            if position < 0:
                break
        rest = _rest_of(stream, shard.raw_size - position) if position >= 0 else b""
        if rest is None:
            problems.append(f"shard {shard.number}: decodes to more than the {shard.raw_size} bytes the index says")
        elif position >= 0 and rest != (END_OF_ARCHIVE if last else b""):
            problems.append(f"shard {shard.number}: the end-of-archive blocks do not match")
    except Exception as exc:  # any decoder failure means damaged bytes; report, do not crash
        problems.append(f"shard {shard.number}: cannot be decompressed ({exc}); {_holds(index, shard)}")
    if hash_range(bundle.fd, shard) != shard.hash:
        problems.insert(0, f"shard {shard.number}: its bytes do not match the index hash; {_holds(index, shard)}")
    return problems


def _rest_of(stream, left: int) -> bytes | None:
    """What is left in ``stream``, where the index says ``left`` bytes remain (at most the end-of-archive
    blocks in a shard that matches): read to its end, so that a codec checks its trailer, or None when it
    holds more than that (nothing past one byte more is decoded)."""
    most = min(max(0, left), len(END_OF_ARCHIVE))
    rest = read_up_to(stream, most + 1)
    return None if len(rest) > most else rest


def _check_streamed_member(stream, index: Index, i: int, position: int, problems: list[str]) -> int:
    """Read entry ``i`` (header, data, padding, by the index's sizes) from ``stream``, which stands at
    ``position`` of the shard's tar bytes; note its problems; return the position after it, or -1 when the
    data ends early."""
    entry, header = index.entry(i), entry_header(index, i)
    if stream.read(len(header)) != header or entry.offset != position or entry.data_offset != position + len(header):
        problems.append(f"{entry.name}: tar header does not match the index")
    if entry.kind != Kind.FILE:
        return position + len(header)
    hasher, remaining = new_hasher(), entry.size
    while remaining:
        chunk = stream.read(min(remaining, 8 << 20))
        if not chunk:
            problems.append(f"{entry.name}: data ends early")
            return -1
        hasher.update(chunk)
        remaining -= len(chunk)
    if hasher.digest() != entry.hash:
        problems.append(f"{entry.name}: content does not match its hash")
    stream.read(-entry.size % 512)          # padding: its bytes are the shard hash's to catch, as when held whole
    return position + len(header) + entry.size + -entry.size % 512


def _holds(index: Index, shard: Shard) -> str:
    names = [os.fsdecode(index.paths[i]) for i in _entry_range(shard)]
    return f"it holds: {', '.join(names[:20])}" + (" ..." if len(names) > 20 else "")


def _entry_range(shard: Shard) -> range:
    return range(shard.first_entry, shard.first_entry + shard.entry_count)


def _contents_problems(index: Index, shard: Shard, data: bytes) -> list[str]:
    """A problem for each file of ``shard`` whose content in its tar bytes ``data`` does not match its hash."""
    engine = native.module()
    if engine is None:
        return [p for i in _entry_range(shard) for p in _content_problems(index, i, data)]
    part = index.slice(shard.first_entry, shard.entry_count)
    bad = engine.content_mismatches(native.as_bytes(data), native.entry_columns(part), native.raw(part.data_offsets),
                                    bytes(part.hashes))
    return [f"{os.fsdecode(part.paths[i])}: content does not match its hash" for i in bad]


def _content_problems(index: Index, i: int, data: bytes) -> list[str]:
    if index.kinds[i] != Kind.FILE:     # (an unknown kind, from a damaged index, is the members check's to name)
        return []
    entry = index.entry(i)
    if entry.kind == Kind.FILE:
        content = memoryview(data)[entry.data_offset:entry.data_offset + entry.size]
        if content_hash(content) != entry.hash:
            return [f"{entry.name}: content does not match its hash"]
    return []


def verify_tree(index: Index, dest: str) -> VerifyReport:
    """Compare the tree under ``dest`` with the index: type, size, mode, mtime, content, link target.

    Anything under ``dest`` that the index does not hold is reported too,
    the marker of an unfinished unpack included.
    """
    report = VerifyReport(entries=len(index))
    root = os.fsencode(dest)
    inodes: dict[int, int] = {}
    for i in range(len(index)):
        if index.kinds[i] > max(Kind):      # a damaged index: no entry type stands for this
            report.problems.append(f"{os.fsdecode(index.paths[i])}: unknown entry type {index.kinds[i]} in the index")
            continue
        entry = index.entry(i)
        path = os.path.join(root, entry.path)
        try:
            st = os.lstat(path)
        except OSError as exc:
            report.problems.append(f"{entry.name}: missing in the destination ({exc.strerror})")
            continue
        report.problems += [f"{entry.name}: {p}" for p in _tree_entry_problems(entry, path, st, inodes)]
    report.problems += _extra_problems(index, root)
    return report


def _extra_problems(index: Index, root: bytes) -> list[str]:
    """Name every path under ``root`` that is not in the index (extra directories are not descended).

    pallet's own state directory means an operation there did not finish.
    """
    known, problems = set(index.paths), []
    state = STATE_DIR.encode()
    for current, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            rel = os.path.relpath(os.path.join(current, name), root)
            if rel == state:
                problems.append(f"{STATE_DIR}: pallet's state of an operation that did not finish here "
                                "(rerun it to finish)")
            elif rel not in known:
                problems.append(f"{os.fsdecode(rel)}: extra in the destination (not in the bundle)")
        dirs[:] = [d for d in dirs if os.path.relpath(os.path.join(current, d), root) in known]
    return problems


def _tree_entry_problems(entry, path: bytes, st: os.stat_result, inodes: dict) -> list[str]:
    expected_type = {Kind.FILE: stat.S_ISREG, Kind.DIR: stat.S_ISDIR, Kind.SYMLINK: stat.S_ISLNK,
                     Kind.HARDLINK: stat.S_ISREG}[entry.kind]
    if not expected_type(st.st_mode):
        return [f"is not a {entry.kind.name.lower()}"]
    problems = []
    if entry.kind == Kind.SYMLINK:
        if os.readlink(path) != entry.link:
            problems.append("symlink target differs")
        return problems
    if entry.kind == Kind.HARDLINK:
        if inodes.get(entry.link_group) != st.st_ino:
            problems.append(f"is not a hard link of {os.fsdecode(entry.link)}")
        return problems
    if entry.link_group >= 0:
        inodes[entry.number] = st.st_ino
    if stat.S_IMODE(st.st_mode) != safe_mode(entry.mode):
        problems.append(f"mode {stat.S_IMODE(st.st_mode):04o}, expected {safe_mode(entry.mode):04o}")
    if st.st_mtime_ns != entry.mtime_ns:
        problems.append("mtime differs")
    if entry.kind == Kind.FILE:
        if st.st_size != entry.size:
            problems.append(f"size {st.st_size}, expected {entry.size}")
        elif _file_hash(path) != entry.hash:
            problems.append("content differs")
    return problems


def _file_hash(path: bytes) -> bytes:
    hasher = new_hasher()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            hasher.update(chunk)
    return hasher.digest()
