"""The one unpack driver: a bundle (or a plain .tar/.tar.gz/.tar.zst) into a destination, resumably.

`pallet unpack`, `pallet pull`, a local push and `python -m mpi_stager
unpack` (serially or under mpirun/srun) all call :func:`unpack`; they differ
only in the communicator they pass (none: one rank, see
bundles.communicator; MPI's comes from mpi_stager.comm) and in their
options. Rank 0 checks the index, locks and marks DEST, reads the journal
(bundles.journal) and makes the directory tree; the shards the journal does
not list are extracted (one rank alone: by its local workers; several:
longest-processing-time first, then handed out on demand) and journaled one
by one; after that rank 0 makes the links, applies directory metadata and
removes DEST/.pallet.
"""
from __future__ import annotations

import heapq
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TypeVar, cast

from . import native
from .communicator import POISON, Communicator, SerialComm
from .errors import CorruptBundleError, PalletError
from .extract import check_index, extract_shard, finish_tree, make_directories, prepare_destination
from .extract_common import ShardOutcome
from .index import Index, Shard
from .jobs import ShardJob, shard_jobs
from .journal import Journal, new_run_name
from .parallel import WorkerPool, jobs_for
from .progress import NoProgress, Progress
from .reader import Bundle
from .state import INCOMPLETE, STATE_DIR, finish, holding_lock, mark_incomplete, marker_text

T = TypeVar("T")


@dataclass(frozen=True)
class UnpackOptions:
    """How to unpack.

    ``jobs``: the worker processes (threads with the native engine) of a
    rank that works alone: 0 one per CPU, or none when the work is too small
    to repay their start; N > 0 exactly N (fewer for fewer shards).
    ``max_jobs`` (0: none) bounds the automatic choice, as ``mpi_stager
    unpack --workers N`` does. With several ranks each extracts one shard at
    a time. ``verify``: check shard and file hashes while writing.
    ``lock_held``: the caller holds DEST's lock (see
    :func:`bundles.state.holding_lock`), which rank 0 takes otherwise.
    ``use_index``: without, the bundle is extracted as a plain tar,
    unverified and without a journal. ``journal_dir``: where the journal
    lives (None: DEST/.pallet/journal-ID). ``keep_state``: leave the journal
    and DEST/.pallet to a caller that removes them once its whole operation
    has succeeded (pallet push), so that a rerun after the caller dies still
    skips every finished shard.
    """

    jobs: int = 0
    verify: bool = True
    lock_held: bool = False
    use_index: bool = True
    max_jobs: int = 0
    journal_dir: str | None = None
    keep_state: bool = False


@dataclass(frozen=True)
class UnpackResult:
    """What unpack did, the same on every rank: ``entries`` and ``shards`` in the bundle, ``files`` and
    ``file_bytes`` written by this run, ``shards_skipped`` shards an earlier run had finished (the journal),
    ``shards_done`` those this run extracted, with ``ranks`` ranks; ``indexed`` is False for plain archives
    (nothing verified, nothing journaled)."""

    dest: str
    entries: int
    files: int
    file_bytes: int
    shards: int
    indexed: bool
    verified: bool
    seconds: float
    shards_skipped: int = 0
    shards_done: int = 0
    ranks: int = 1


class UnpackError(PalletError):
    """The unpack failed on one or more of several ranks: ``errors`` holds every rank's, ``result`` what was done.
    (A rank working alone raises the error itself.)"""

    def __init__(self, result: UnpackResult, errors: list[str]):
        listed = "\n".join(f"  - {e}" for e in errors[:50])
        more = f"\n  ... and {len(errors) - 50} more" if len(errors) > 50 else ""
        super().__init__(f"unpack failed ({len(errors)} error(s) on {result.ranks} rank(s)):\n{listed}{more}",
                         result.dest, f"{STATE_DIR}/{INCOMPLETE} marks it; fix the cause and rerun: finished shards "
                         "are skipped")
        self.result = result
        self.errors = errors


def unpack(bundle_path: str | os.PathLike, dest: str | os.PathLike, options: UnpackOptions = UnpackOptions(),
           progress: Progress | None = None, comm: Communicator | None = None) -> UnpackResult:
    """Extract ``bundle_path`` into ``dest`` with every rank of ``comm`` (default: this process alone) and
    return the same summary on every rank.

    Nothing is written outside ``dest``: an indexed bundle is checked in full
    before anything is written, and every unsafe member is named in one
    UnsafeMemberError. While work is under way ``dest`` holds the marker
    ``.pallet/INCOMPLETE`` (see :mod:`bundles.state`) and, from the first
    finished shard on, the journal ``.pallet/journal-ID`` (see
    :mod:`bundles.journal`); both are removed, with ``.pallet`` unless other
    unfinished work keeps it, only after the last file, link and directory
    mtime is in place, so a crash leaves the destination clearly marked and
    a rerun extracts only the shards the journal does not list. DEST is
    locked meanwhile, as push and pull lock it: a second operation there
    stops with DestinationLocked (exit status 4). A rank working alone
    raises the error it met; several raise UnpackError naming every rank's.
    """
    started = time.monotonic()
    comm = comm or SerialComm()
    dest = os.fspath(dest)
    progress = (progress or NoProgress()) if comm.rank == 0 else NoProgress()
    bundle = _open_everywhere(comm, os.fspath(bundle_path), options.use_index)
    with ExitStack() as stack:          # closed in reverse: the workers, then DEST's lock, the progress, the bundle
        stack.callback(bundle.close)
        stack.callback(progress.finish)
        locked = stack.enter_context(ExitStack())   # rank 0 holds DEST's lock in it until no worker writes
        pool = stack.enter_context(WorkerPool(_jobs(bundle.index, options, comm.size), native.releases_gil()))
        pool.start()        # the workers start while the index is checked and the directories made
        if bundle.index is None:
            result = _unpack_plain(comm, bundle, dest, options, progress, locked)
        else:
            result = _unpack_indexed(comm, bundle, bundle.index, dest, options, progress, pool, locked)
    return replace(result, seconds=time.monotonic() - started)


def _open_everywhere(comm: Communicator, bundle_path: str, use_index: bool) -> Bundle:
    """The bundle, opened on every rank; the error of the first rank that cannot open it is raised on all."""
    try:
        bundle, error = Bundle.open(bundle_path, use_index), None
    except PalletError as exc:
        bundle, error = None, exc
    errors = [e for e in comm.allgather(None if error is None else str(error)) if e]
    if errors:
        if bundle is not None:
            bundle.close()
        raise error or PalletError(errors[0])
    assert bundle is not None
    return bundle


def _root_only(comm: Communicator, work: Callable[[], T]) -> T:
    """``work()`` run on rank 0, its value given to every rank; its PalletError is raised on every rank."""
    outcome: T | PalletError | None = None
    if comm.rank == 0:
        try:
            outcome = work()
        except PalletError as exc:
            outcome = exc
        except Exception as exc:        # a bug or an unwrapped OS error must not leave the other ranks waiting
            if comm.size == 1:
                raise
            outcome = PalletError(f"rank 0: unexpected {type(exc).__name__}: {exc}")
    outcome = comm.bcast(outcome)
    if isinstance(outcome, PalletError):
        raise outcome
    return cast(T, outcome)


def _marker(bundle: Bundle) -> str:
    return (f"pallet is unpacking {os.path.abspath(bundle.path)} here; if this file remains, the unpack did not "
            "finish: run it again")


# ---------------------------------------------------------------- plain archives

def _unpack_plain(comm: Communicator, bundle: Bundle, dest: str, options: UnpackOptions, progress: Progress,
                  locked: ExitStack) -> UnpackResult:
    """A plain archive (or a bundle read without its index): rank 0 extracts it in stream order, unverified. It
    has no shards, so no journal: a rerun extracts it again, and first drops every journal in DEST/.pallet."""
    def extract() -> UnpackResult:
        from .plain import extract_plain, iter_members      # loaded only when a plain archive is unpacked
        next(iter_members(bundle), None)                     # not a tar archive: fail before touching dest
        prepare_destination(dest)
        locked.enter_context(holding_lock(dest, options.lock_held))
        mark_incomplete(dest, _marker(bundle))
        stats = extract_plain(bundle, dest, progress)
        if not options.keep_state:
            finish(dest)
        return UnpackResult(dest, stats.entries, stats.files, stats.file_bytes, 0, False, False, 0.0,
                            ranks=comm.size)
    return _root_only(comm, extract)


# ---------------------------------------------------------------- indexed bundles

@dataclass
class RankReport:
    """What one rank did: shards extracted, files and bytes written, and errors met."""

    rank: int
    shards: list[int] = field(default_factory=list)
    files: int = 0
    file_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, outcome: ShardOutcome) -> None:
        self.shards.append(outcome.shard)
        self.files += outcome.files
        self.file_bytes += outcome.file_bytes


def _unpack_indexed(comm: Communicator, bundle: Bundle, index: Index, dest: str, options: UnpackOptions,
                    progress: Progress, pool: WorkerPool, locked: ExitStack) -> UnpackResult:
    journal = Journal.for_destination(dest, index, options.journal_dir)
    done, run = _root_only(comm, lambda: _prepare(bundle, index, dest, journal, options, locked))
    pending = [s for s in index.shards if s.number not in done]
    progress.start("unpack", len(index), index.total_file_bytes)
    progress.advance(sum(index.shards[n].entry_count for n in done), sum(index.shards[n].file_bytes for n in done))
    if comm.size == 1:      # errors are raised as they are met
        report = _extract_alone(bundle, index, dest, journal, pending, run, options, progress, pool)
    else:
        report = _extract_on_ranks(comm, bundle, index, dest, journal, pending, run, options, progress)
    reports = comm.allgather(report)
    errors = [e for r in reports for e in r.errors]
    if not errors:
        try:
            _root_only(comm, lambda: finish_tree(index, dest))
        except PalletError as exc:
            if comm.size == 1:
                raise
            errors = [f"rank 0, links and directory metadata: {exc}"]
    result = UnpackResult(dest, len(index), sum(r.files for r in reports), sum(r.file_bytes for r in reports),
                          len(index.shards), True, options.verify, 0.0, len(done),
                          sum(len(r.shards) for r in reports), comm.size)
    if errors:
        raise UnpackError(result, errors)
    _root_only(comm, lambda: None if options.keep_state else finish(dest, journal.root))
    return result


def _prepare(bundle: Bundle, index: Index, dest: str, journal: Journal, options: UnpackOptions,
             locked: ExitStack) -> tuple[set[int], str]:
    """Rank 0: check the index, create, lock (until ``locked`` closes) and mark DEST, read the journal, make
    the directory tree; return the shards finished before and this run's name."""
    check_index(index, bundle.path)
    prepare_destination(dest)
    locked.enter_context(holding_lock(dest, options.lock_held))
    elsewhere = journal.name_in(dest) is None
    if elsewhere and marker_text(dest).splitlines()[-1:] != [_journal_line(journal)]:
        journal.forget_all()        # DEST was not left by this journal's run: its records may not hold
    mark_incomplete(dest, _marker(bundle) + ("\n" + _journal_line(journal) if elsewhere else ""),
                    journal.name_in(dest))
    journal.check()                 # its directories appear with the first record; one there must be trusted
    run = new_run_name()
    _adopt_other_bundles(dest, index, journal, run)
    done = journal.finished_shards(index)
    make_directories(index, dest)
    return done, run


def _journal_line(journal: Journal) -> str:
    """The marker's last line for a journal kept elsewhere (``--journal DIR``): which journal DEST's run keeps."""
    return f"journal: {os.path.abspath(journal.root)}"


def _adopt_other_bundles(dest: str, index: Index, journal: Journal, run: str) -> None:
    """Take over an interrupted unpack's records (Journal.take_over) for the shards of this bundle with the
    same hash: the same bytes, so the same entries."""
    def matching(other: Journal) -> dict[int, tuple[bytes, bytes]]:
        recorded = set(other.recorded_shards().values())
        return {s.number: (s.hash, b"") for s in index.shards if s.hash in recorded}
    journal.take_over(dest, run, matching)


def _extract_alone(bundle: Bundle, index: Index, dest: str, journal: Journal, pending: list[Shard], run: str,
                   options: UnpackOptions, progress: Progress, pool: WorkerPool) -> RankReport:
    """One rank: the pending shards, costliest first, by the pool's workers (inline when it has none), each
    journaled as it finishes; the first error stops the work and is raised."""
    report = RankReport(0)
    order = [index.shards[n] for n in assign_shards(pending, 1).static[0]]
    for outcome in pool.map(partial(_extract_job, dest=dest, verify=options.verify), shard_jobs(bundle, order),
                            ordered=False):
        journal.record_shard(index, outcome.shard, run, 0)
        report.add(outcome)
        progress.advance(index.shards[outcome.shard].entry_count, outcome.file_bytes)
    return report


def _extract_job(job: ShardJob, dest: str, verify: bool) -> ShardOutcome:
    """Extract one shard, in a worker or inline."""
    with job.bundle.open() as bundle:
        return extract_shard(bundle, job.entries, job.shard, dest, verify, job.last)


def _extract_on_ranks(comm: Communicator, bundle: Bundle, index: Index, dest: str, journal: Journal,
                      pending: list[Shard], run: str, options: UnpackOptions, progress: Progress) -> RankReport:
    """Several ranks: each extracts its static share, then takes shards from the dynamic tail until none is
    left; an error on any rank poisons the shared counter, so every rank stops taking work."""
    report = RankReport(comm.rank)
    assignment = assign_shards(pending, comm.size)
    counter = comm.counter()
    try:
        for number in assignment.static[comm.rank]:
            if counter.fetch_add(0) >= POISON:
                break
            if not _extract_one(bundle, index, dest, journal, number, run, options, progress, report):
                counter.poison()
                break
        while not report.errors:
            ticket = counter.fetch_add(1)
            if ticket >= POISON or ticket >= len(assignment.dynamic):
                break
            if not _extract_one(bundle, index, dest, journal, assignment.dynamic[ticket], run, options, progress,
                                report):
                counter.poison()
    finally:
        comm.barrier()
        counter.free()
    return report


def _extract_one(bundle: Bundle, index: Index, dest: str, journal: Journal, number: int, run: str,
                 options: UnpackOptions, progress: Progress, report: RankReport) -> bool:
    """Extract one shard and journal it; on failure record the error and return False (never raise: the other
    ranks would wait for this one forever)."""
    try:
        outcome = extract_shard(bundle, index, index.shards[number], dest, options.verify,
                                number == len(index.shards) - 1)
        journal.record_shard(index, number, run, report.rank)
    except CorruptBundleError as exc:
        report.errors.append(f"rank {report.rank}, shard {number}: {exc.message}; files: "
                             + ", ".join(exc.problems[:10]) + (" ..." if len(exc.problems) > 10 else ""))
        return False
    except PalletError as exc:
        report.errors.append(f"rank {report.rank}, shard {number}: {exc}")
        return False
    except Exception as exc:  # a bug or an unwrapped OS error must not hang the other ranks
        report.errors.append(f"rank {report.rank}, shard {number}: unexpected {type(exc).__name__}: {exc}")
        return False
    report.add(outcome)
    progress.advance(index.shards[number].entry_count, outcome.file_bytes)
    return True


def _jobs(index: Index | None, options: UnpackOptions, ranks: int) -> int:
    """Workers of a rank working alone on an indexed bundle (a plain archive is extracted in this thread, and
    each of several ranks extracts its shards itself)."""
    if index is None or ranks > 1:
        return 1
    jobs = jobs_for(sum(map(shard_cost, index.shards)), options.jobs)
    if options.jobs <= 0 and options.max_jobs > 0:
        jobs = min(jobs, options.max_jobs)
    return min(jobs, max(1, len(index.shards)))


# ---------------------------------------------------------------- cost model and shard assignment

SECONDS_PER_FILE = 50e-6        # a: create + write + close + utime of one small file
SECONDS_PER_BYTE = 1 / 500e6    # b: decompress + write of one byte


def shard_cost(shard: Shard) -> float:
    """Estimated seconds to extract a shard: a·files + b·bytes (files dominate small shards)."""
    return SECONDS_PER_FILE * shard.entry_count + SECONDS_PER_BYTE * shard.raw_size


@dataclass(frozen=True)
class Assignment:
    """``static[r]`` lists the shards rank r does first; ``dynamic`` is handed out on demand, in order."""

    static: list[list[int]]
    dynamic: list[int]


def assign_shards(shards: list[Shard], ranks: int, dynamic_share: float = 0.25) -> Assignment:
    """Assign shards to ``ranks`` ranks, the same on every rank (a pure function).

    Shards are sorted by decreasing cost; those making up the first
    ``1 - dynamic_share`` of the total cost go to the least-loaded rank
    (LPT), the cheaper rest are handed out dynamically to whichever rank is
    free first, which evens out ranks that run slower than the model says.
    """
    order = sorted(shards, key=lambda s: (-shard_cost(s), s.number))
    if ranks <= 1:
        return Assignment([[s.number for s in order]], [])
    total = sum(shard_cost(s) for s in order)
    loads = [(0.0, rank) for rank in range(ranks)]
    static: list[list[int]] = [[] for _ in range(ranks)]
    assigned = 0.0
    split = len(order)
    for position, shard in enumerate(order):
        if assigned >= (1 - dynamic_share) * total and position >= ranks:
            split = position
            break
        load, rank = heapq.heappop(loads)
        static[rank].append(shard.number)
        heapq.heappush(loads, (load + shard_cost(shard), rank))
        assigned += shard_cost(shard)
    return Assignment(static, [s.number for s in order[split:]])
