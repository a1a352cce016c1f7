"""Stage-in by the DAG: the first retrieval from a location brings the inputs the workflow named there, in one go."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

from staging_core import RemoteEntry

from .transfers import Request, location


class Prefetch:
    """What the workflow named, and which locations have been prefetched.

    Snakemake asks about every input and output of the jobs it plans before
    it runs any; :meth:`note` keeps each object found to be a remote file. The first retrieval from a location (host and
    top-level directory, as batches group them) is extended by
    :meth:`extend` with the noted objects of that location that are not
    here yet (no local copy with the remote size and mtime), up to
    ``budget`` bytes in all: they arrive in the same operation, with their
    remote mtimes, and Snakemake's later rounds find them present and
    retrieve nothing. Later retrievals from that location are not extended.
    Thread-safe.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self._noted: dict[tuple, dict[str, tuple[Request, int, int]]] = {}
        self._done: set[tuple] = set()
        self._spent = 0
        self._lock = threading.Lock()

    def note(self, request: Request, entry: RemoteEntry) -> None:
        """Keep ``request``, found to be a remote file of ``entry``'s size and mtime, for its location's
        first retrieval."""
        if entry.kind != "f" or self.budget <= 0:
            return
        with self._lock:
            where = location(request)
            if where not in self._done:
                self._noted.setdefault(where, {})[request.query] = (request, entry.size, entry.mtime_ns)

    def extend(self, group: list[Request], log: Callable[[str], None]) -> list[Request]:
        """``group`` and, the first time its location is retrieved, the noted objects of that location still
        missing here (within the budget); ``log`` is told how many were added."""
        where = location(group[0])
        with self._lock:
            if where in self._done:
                return group
            self._done.add(where)
            noted = self._noted.pop(where, {})
            asked = {request.query for request in group}
            extra = []
            for query, (request, size, mtime_ns) in noted.items():
                if query in asked or _present(request.local, size, mtime_ns) or self._spent + size > self.budget:
                    continue
                self._spent += size
                extra.append(request)
        if extra:
            log(f"pallet: prefetching {len(extra)} object(s) that later jobs read, with the {len(group)} "
                f"asked for now, in one operation")
        return group + extra


def _present(local: str, size: int, mtime_ns: int) -> bool:
    try:
        info = os.stat(local)
    except OSError:
        return False
    return info.st_size == size and info.st_mtime_ns >= mtime_ns
