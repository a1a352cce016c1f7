"""Communicators: MPI's (the one module that imports mpi4py) and the serial one.

Both are what the unpack driver (bundles.unpacking) and the parallel pack take; the interface they share is
bundles.communicator's.
"""
from __future__ import annotations

import os
from typing import Any

from bundles.communicator import POISON, Communicator, SerialComm, SharedCounter
from bundles.errors import UsageError
from bundles.workers import die_with_parent


class MPIComm:
    """mpi4py's COMM_WORLD; the shared counter is an RMA window on rank 0."""

    name = "mpi"

    def __init__(self) -> None:
        if launched_by_mpi():
            die_with_parent(os.getppid())   # a rank never outlives its launcher: mpirun killed with -9 leaves no orphan
        from mpi4py import MPI      # the only mpi4py import in pallet
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()

    def barrier(self) -> None:
        self._comm.Barrier()

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self._comm.bcast(obj, root=root)

    def allgather(self, obj: Any) -> list:
        return self._comm.allgather(obj)

    def exscan_sum(self, value: int) -> int:
        result = self._comm.exscan(value)
        return 0 if self.rank == 0 or result is None else result

    def counter(self) -> SharedCounter:
        return _WindowCounter(self._mpi, self._comm)


class _WindowCounter:
    def __init__(self, mpi, comm) -> None:
        self._mpi = mpi
        size = mpi.INT64_T.Get_size()
        self._window = mpi.Win.Allocate(size if comm.Get_rank() == 0 else 0, size, comm=comm)
        if comm.Get_rank() == 0:
            self._window.tomemory()[:] = bytes(size)
        comm.Barrier()

    def fetch_add(self, amount: int = 1) -> int:
        mpi = self._mpi
        operand, result = bytearray(amount.to_bytes(8, "little", signed=True)), bytearray(8)
        self._window.Lock(0)
        self._window.Fetch_and_op([operand, mpi.INT64_T], [result, mpi.INT64_T], 0, 0, mpi.SUM)
        self._window.Unlock(0)
        return int.from_bytes(result, "little", signed=True)

    def poison(self) -> None:
        self.fetch_add(POISON)

    def free(self) -> None:
        self._window.Free()


def launched_by_mpi() -> bool:
    """True when this process was started by mpirun/mpiexec/srun as part of a multi-rank job."""
    for variable in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS"):
        value = os.environ.get(variable)
        if value and value.isdigit() and int(value) > 1:
            return True
    return False


def get_communicator(kind: str = "auto") -> Communicator:
    """Return the communicator to use: 'mpi', 'serial', or 'auto' (MPI when launched as several ranks)."""
    if kind == "serial" or (kind == "auto" and not launched_by_mpi()):
        return SerialComm()
    try:
        return MPIComm()
    except ImportError:
        raise UsageError("this job was started as several MPI ranks but mpi4py is not installed",
                         hint="pip install 'pallet[mpi]' (or run without mpirun for one rank)") from None
