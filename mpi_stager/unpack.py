"""Unpack one bundle with N ranks: rank 0 plans and makes the tree, every rank extracts its shards."""
from __future__ import annotations

import os
import time
from contextlib import ExitStack
from functools import partial
from dataclasses import dataclass, field

from bundles.errors import CorruptBundleError, PalletError
from bundles.extract import check_index, extract_shard, finish_tree, make_directories, prepare_destination
from bundles.index import Index
from bundles.jobs import ShardJob, shard_jobs
from bundles.parallel import WorkerPool, jobs_for
from bundles.reader import Bundle
from bundles.state import INCOMPLETE, STATE_DIR, finish, holding_lock, mark_incomplete, marker_text
from bundles.unpacking import shard_cost

from .comm import POISON, Communicator
from .journal import Journal, new_run_name
from .schedule import assign_shards
from .summaries import StagerSummary


@dataclass(frozen=True)
class StagerOptions:
    """Unpack options: hash checks, journal location (None: under DEST), at most how many worker processes
    one rank alone uses (fewer for a small bundle, none below the size that repays their start), and
    ``keep_state``: leave the journal and DEST/.pallet to a caller that removes them once its whole operation
    has succeeded (pallet push), so that a rerun after the caller dies still skips every finished shard;
    ``lock_held``: the caller holds DEST's lock (see bundles.state.holding_lock), which rank 0 takes otherwise."""

    verify: bool = True
    journal_dir: str | None = None
    workers: int = 1
    keep_state: bool = False
    lock_held: bool = False


@dataclass
class RankReport:
    """What one rank did: shards extracted, files and bytes written, and errors met."""

    rank: int
    shards: list[int] = field(default_factory=list)
    files: int = 0
    file_bytes: int = 0
    errors: list[str] = field(default_factory=list)


class StagerError(PalletError):
    """The unpack failed on one or more ranks; ``summary`` holds every rank's errors."""

    def __init__(self, summary: StagerSummary):
        listed = "\n".join(f"  - {e}" for e in summary.errors[:50])
        more = f"\n  ... and {len(summary.errors) - 50} more" if len(summary.errors) > 50 else ""
        super().__init__(f"unpack failed ({len(summary.errors)} error(s) on {summary.ranks} rank(s)):\n{listed}{more}",
                         summary.dest, f"{STATE_DIR}/{INCOMPLETE} marks it; fix the cause and rerun: "
                         "finished shards are skipped")
        self.summary = summary


def unpack_parallel(comm: Communicator, bundle_path: str, dest: str, options: StagerOptions) -> StagerSummary:
    """Run the unpack on every rank of ``comm``; all ranks return the same summary or raise StagerError."""
    started = time.monotonic()
    bundle = _open_everywhere(comm, bundle_path)
    lock = ExitStack()          # rank 0 holds DEST's lock from the start to the end
    try:
        index = bundle.index
        journal = Journal.for_destination(dest, index, options.journal_dir)
        prepared = comm.bcast(_prepare(bundle, dest, journal, lock, options.lock_held) if comm.rank == 0 else None)
        if isinstance(prepared, PalletError):
            raise prepared
        done_before, run = prepared
        pending = [s for s in index.shards if s.number not in done_before]
        report = _extract_assigned(comm, bundle, dest, journal, pending, run, options)
        reports = comm.allgather(report)
        errors = [e for r in reports for e in r.errors]
        if not errors and comm.rank == 0:
            errors = _finish(index, dest, journal)
        errors = comm.bcast(errors)
        summary = StagerSummary(dest, comm.size, len(index.shards), len(done_before),
                                sum(len(r.shards) for r in reports), sum(r.files for r in reports),
                                sum(r.file_bytes for r in reports), time.monotonic() - started, errors)
        if errors:
            raise StagerError(summary)
        if comm.rank == 0 and not options.keep_state:
            finish(dest, journal.root)
        comm.barrier()
        return summary
    finally:
        lock.close()
        bundle.close()


def _open_everywhere(comm: Communicator, bundle_path: str) -> Bundle:
    try:
        bundle, error = Bundle.open(bundle_path), None
    except PalletError as exc:
        bundle, error = None, str(exc)
    if bundle is not None and bundle.index is None:
        bundle.close()
        bundle, error = None, f"{bundle_path}: has no pallet index; use `pallet unpack` for plain archives"
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise PalletError(errors[0])
    return bundle


def _prepare(bundle: Bundle, dest: str, journal: Journal, lock: ExitStack, lock_held: bool):
    """Rank 0: check, create and lock DEST, the journal and the directory tree; return (done shards, run) or
    the error (a PalletError, sent to every rank)."""
    try:
        check_index(bundle.index, bundle.path)
        prepare_destination(dest)
        lock.enter_context(holding_lock(dest, lock_held))
        elsewhere = journal.name_in(dest) is None
        if elsewhere and marker_text(dest).splitlines()[-1:] != [_journal_line(journal)]:
            journal.forget_all()        # DEST was not left by this journal's run: its records may not hold
        mark_incomplete(dest, f"pallet is unpacking {os.path.abspath(bundle.path)} here; rerun to finish"
                              + ("\n" + _journal_line(journal) if elsewhere else ""), journal.name_in(dest))
        journal.create(dest)
        run = new_run_name()
        adopt_other_bundles(dest, bundle.index, journal, run)
        done = journal.finished_shards(bundle.index)
        make_directories(bundle.index, dest)
        return done, run
    except PalletError as exc:
        return exc


def _journal_line(journal: Journal) -> str:
    """The marker's last line for a journal kept elsewhere (``--journal DIR``): which journal DEST's run keeps."""
    return f"journal: {os.path.abspath(journal.root)}"


def adopt_other_bundles(dest: str, index: Index, journal: Journal, run: str) -> None:
    """Take over an interrupted unpack's records (Journal.take_over) for the shards of this bundle with the
    same hash: the same bytes, so the same entries."""
    def matching(other: Journal) -> dict[int, tuple[bytes, bytes]]:
        recorded = set(other.recorded_shards().values())
        return {s.number: (s.hash, b"") for s in index.shards if s.hash in recorded}
    journal.take_over(dest, run, matching)


def _extract_assigned(comm, bundle, dest, journal, pending, run, options) -> RankReport:
    report = RankReport(comm.rank)
    if comm.size == 1 and options.workers > 1:
        return _extract_with_pool(bundle, dest, journal, pending, run, options, report)
    assignment = assign_shards(pending, comm.size)
    counter = comm.counter()
    try:
        for number in assignment.static[comm.rank]:
            if counter.fetch_add(0) >= POISON:
                break
            if not _extract_one(bundle, dest, journal, number, run, options, report):
                counter.poison()
                break
        while not report.errors:
            ticket = counter.fetch_add(1)
            if ticket >= POISON or ticket >= len(assignment.dynamic):
                break
            if not _extract_one(bundle, dest, journal, assignment.dynamic[ticket], run, options, report):
                counter.poison()
    finally:
        comm.barrier()
        counter.free()
    return report


def _extract_one(bundle, dest, journal, number, run, options, report: RankReport) -> bool:
    """Extract one shard and journal it; on failure record the error and return False."""
    try:
        outcome = extract_shard(bundle, bundle.index, bundle.index.shards[number], dest, options.verify,
                                number == len(bundle.index.shards) - 1)
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
    journal.record_shard(bundle.index, number, run, report.rank)
    report.shards.append(number)
    report.files += outcome.files
    report.file_bytes += outcome.file_bytes
    return True


def _pool_extract(job: ShardJob, dest: str, verify: bool):
    """Extract one shard in a pool worker: (number, outcome, None) or (number, None, error text)."""
    try:
        with job.bundle.open() as bundle:
            return job.shard.number, extract_shard(bundle, job.entries, job.shard, dest, verify, job.last), None
    except PalletError as exc:
        return job.shard.number, None, str(exc)


def _extract_with_pool(bundle, dest, journal, pending, run, options, report: RankReport) -> RankReport:
    """One node without MPI: the same shards, extracted by a pool of worker processes."""
    order = [bundle.index.shards[n] for n in assign_shards(pending, 1).static[0]]
    workers = min(options.workers, jobs_for(sum(map(shard_cost, order)), 0), max(1, len(order)))
    with WorkerPool(workers) as pool:
        results = pool.map(partial(_pool_extract, dest=dest, verify=options.verify), shard_jobs(bundle, order),
                           ordered=False)
        for number, outcome, error in results:
            if error:
                report.errors.append(f"shard {number}: {error}")
                continue
            journal.record_shard(bundle.index, number, run, 0)
            report.shards.append(number)
            report.files += outcome.files
            report.file_bytes += outcome.file_bytes
    return report


def _finish(index, dest: str, journal: Journal) -> list[str]:
    try:
        finish_tree(index, dest)
    except PalletError as exc:
        return [f"rank 0, links and directory metadata: {exc}"]
    return []
