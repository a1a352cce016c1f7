"""Unpack a bundle (or a plain .tar/.tar.gz/.tar.zst) into a destination directory."""
from __future__ import annotations

import os
import time
from functools import partial
from dataclasses import dataclass

from . import native
from .extract import ShardOutcome, check_index, extract_shard, finish_tree, make_directories, prepare_destination
from .index import Index
from .jobs import ShardJob, shard_jobs
from .parallel import WorkerPool, jobs_for
from .progress import NoProgress, Progress
from .reader import Bundle
from .state import finish, holding_lock, mark_incomplete


@dataclass(frozen=True)
class UnpackOptions:
    """Workers (0: one per CPU), whether to check hashes while writing, whether the caller already holds
    DEST's lock (see :func:`bundles.state.holding_lock`), and whether to use the bundle's index (without:
    a plain, unverified extraction)."""

    jobs: int = 0
    verify: bool = True
    lock_held: bool = False
    use_index: bool = True


@dataclass(frozen=True)
class UnpackResult:
    """What unpack wrote; ``indexed`` is False for plain archives (nothing verified)."""

    dest: str
    entries: int
    files: int
    file_bytes: int
    shards: int
    indexed: bool
    verified: bool
    seconds: float


def unpack(bundle_path: str | os.PathLike, dest: str | os.PathLike, options: UnpackOptions = UnpackOptions(),
           progress: Progress | None = None) -> UnpackResult:
    """Extract ``bundle_path`` into ``dest`` and return a summary.

    Nothing is written outside ``dest``: an indexed bundle is checked in full
    before anything is written, and every unsafe member is named in one
    UnsafeMemberError. While work is under way ``dest`` holds the marker
    ``.pallet/INCOMPLETE`` (see :mod:`bundles.state`); it is removed, with
    ``.pallet`` unless other unfinished work keeps it, only after the last
    file, link and directory mtime is in place, so a crash leaves the
    destination clearly marked. Rerunning rewrites the same files. DEST is
    locked meanwhile, as push and pull lock it: a second operation there
    stops with DestinationLocked (exit status 4).
    """
    started = time.monotonic()
    dest = os.fspath(dest)
    progress = progress or NoProgress()
    with Bundle.open(bundle_path, options.use_index) as bundle, WorkerPool(_unpack_jobs(bundle.index, options),
                                                                              native.releases_gil()) as pool:
        pool.start()        # the workers start while the index is checked and the directories made
        if bundle.index is not None:
            check_index(bundle.index, bundle.path)
        else:
            from .plain import iter_members             # plain archives only: loaded when one is unpacked
            next(iter_members(bundle), None)            # not a tar archive: fail before touching dest
        prepare_destination(dest)
        with holding_lock(dest, options.lock_held):
            mark_incomplete(dest, f"pallet is unpacking {os.path.abspath(bundle.path)} here; "
                                  "if this file remains, the unpack did not finish: run it again")
            try:
                result = _unpack_into(bundle, dest, options, progress, pool)
            finally:
                progress.finish()
            finish(dest)
    return UnpackResult(**{**result.__dict__, "seconds": time.monotonic() - started})


def _unpack_into(bundle: Bundle, dest: str, options: UnpackOptions, progress: Progress,
                 pool: WorkerPool) -> UnpackResult:
    if bundle.index is None:
        from .plain import extract_plain
        stats = extract_plain(bundle, dest, progress)
        return UnpackResult(dest, stats.entries, stats.files, stats.file_bytes, 0, False, False, 0.0)
    return _unpack_indexed(bundle, dest, options, progress, pool)


def _unpack_jobs(index: Index | None, options: UnpackOptions) -> int:
    """Workers for an indexed bundle (a plain archive is extracted in this thread)."""
    if index is None:
        return 1
    return min(jobs_for(sum(map(shard_cost, index.shards)), options.jobs), max(1, len(index.shards)))


def _unpack_indexed(bundle: Bundle, dest: str, options: UnpackOptions, progress: Progress,
                    pool: WorkerPool) -> UnpackResult:
    index = bundle.index
    progress.start("unpack", len(index), index.total_file_bytes)
    make_directories(index, dest)
    order = sorted(index.shards, key=shard_cost, reverse=True)
    files = nbytes = 0
    for outcome in pool.map(partial(_extract_job, dest=dest, verify=options.verify), shard_jobs(bundle, order),
                            ordered=False):
        files += outcome.files
        nbytes += outcome.file_bytes
        progress.advance(index.shards[outcome.shard].entry_count, outcome.file_bytes)
    finish_tree(index, dest)
    return UnpackResult(dest, len(index), files, nbytes, len(index.shards), True, options.verify, 0.0)


SECONDS_PER_FILE = 50e-6        # a: create + write + close + utime of one small file
SECONDS_PER_BYTE = 1 / 500e6    # b: decompress + write of one byte


def shard_cost(shard) -> float:
    """Estimated seconds to extract a shard: a·files + b·bytes (files dominate small shards)."""
    return SECONDS_PER_FILE * shard.entry_count + SECONDS_PER_BYTE * shard.raw_size


def _extract_job(job: ShardJob, dest: str, verify: bool) -> ShardOutcome:
    """Extract one shard, in a worker or inline."""
    with job.bundle.open() as bundle:
        return extract_shard(bundle, job.entries, job.shard, dest, verify, job.last)
