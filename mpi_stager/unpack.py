"""`python -m mpi_stager unpack`: the one unpack driver (bundles.unpacking.unpack) on every rank of a communicator.

It runs with mpi_stager's options and summary (the JSON a push or a Slurm job reads back, see mpi_stager.wire).
"""
from __future__ import annotations

from dataclasses import dataclass

from bundles.unpacking import UnpackOptions, unpack

from .comm import Communicator
from .wire import StagerSummary


@dataclass(frozen=True)
class StagerOptions:
    """Unpack options: hash checks, journal location (None: under DEST), at most how many worker processes
    (threads with the native engine) one rank alone uses (fewer for a small bundle, none below the size that
    repays their start), and ``keep_state``: leave the journal and DEST/.pallet to a caller that removes them
    once its whole operation has succeeded (pallet push), so that a rerun after the caller dies still skips
    every finished shard; ``lock_held``: the caller holds DEST's lock (see bundles.state.holding_lock), which
    rank 0 takes otherwise."""

    verify: bool = True
    journal_dir: str | None = None
    workers: int = 1
    keep_state: bool = False
    lock_held: bool = False

    def unpack_options(self) -> UnpackOptions:
        return UnpackOptions(verify=self.verify, lock_held=self.lock_held, max_jobs=max(1, self.workers),
                             journal_dir=self.journal_dir, keep_state=self.keep_state)


def unpack_parallel(comm: Communicator, bundle_path: str, dest: str, options: StagerOptions) -> StagerSummary:
    """Unpack with every rank of ``comm``; all ranks return the same summary, or raise: the error itself when
    one rank works alone, bundles.unpacking.UnpackError naming every rank's errors when several do."""
    result = unpack(bundle_path, dest, options.unpack_options(), comm=comm)
    return StagerSummary(dest=result.dest, ranks=result.ranks, shards_total=result.shards,
                         shards_skipped=result.shards_skipped, shards_done=result.shards_done, files=result.files,
                         file_bytes=result.file_bytes, seconds=result.seconds)
