"""What the unpack driver needs from a group of ranks (a communicator), and the one-rank communicator.

The driver (bundles.unpacking.unpack) is written against :class:`Communicator`
only. :class:`SerialComm` is one rank, for a process on its own (it still
extracts with local workers). mpi_stager.comm adds MPI's, the one place
that imports mpi4py; bundles never imports mpi_stager.
"""
from __future__ import annotations

from typing import Any, Protocol

POISON = 1 << 40        # added to a counter to tell every rank to stop taking work


class SharedCounter(Protocol):
    """An atomic integer shared by all ranks (created collectively, freed collectively).

    ``fetch_add(n)`` adds ``n`` and returns the value before; ``poison()``
    makes every later ``fetch_add`` return a value >= POISON, which ranks
    read as "stop taking work".
    """

    def fetch_add(self, amount: int = 1) -> int: ...

    def poison(self) -> None: ...

    def free(self) -> None: ...


class Communicator(Protocol):
    """The collective operations the driver needs; every rank calls them in the same order.

    ``bcast`` returns root's object on every rank, ``allgather`` the list of
    every rank's object by rank, ``exscan_sum`` the sum of the values of
    lower ranks (0 on rank 0), ``counter`` creates a SharedCounter starting
    at 0. ``name`` says which implementation runs.
    """

    rank: int
    size: int
    name: str

    def barrier(self) -> None: ...

    def bcast(self, obj: Any, root: int = 0) -> Any: ...

    def allgather(self, obj: Any) -> list: ...

    def exscan_sum(self, value: int) -> int: ...

    def counter(self) -> SharedCounter: ...


class _LocalCounter:
    def __init__(self) -> None:
        self.value = 0

    def fetch_add(self, amount: int = 1) -> int:
        before, self.value = self.value, self.value + amount
        return before

    def poison(self) -> None:
        self.value += POISON

    def free(self) -> None:
        pass


class SerialComm:
    """One rank: every collective is the identity."""

    rank, size, name = 0, 1, "serial"

    def barrier(self) -> None:
        pass

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather(self, obj: Any) -> list:
        return [obj]

    def exscan_sum(self, value: int) -> int:
        return 0

    def counter(self) -> SharedCounter:
        return _LocalCounter()
