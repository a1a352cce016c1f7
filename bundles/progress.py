"""The progress interface the bundle operations report to; the CLI renders it."""
from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """Receives progress of one long operation.

    ``start`` is called once with the totals (0 if unknown) and a short
    label; ``advance`` any number of times with increments; ``finish`` once,
    also after a failure. Implementations must be cheap: calls come from the
    coordinating process between shards, never per file.
    """

    def start(self, label: str, total_files: int, total_bytes: int) -> None: ...

    def advance(self, files: int, nbytes: int) -> None: ...

    def finish(self) -> None: ...


class NoProgress:
    """A Progress that shows nothing (the default when output is not a terminal)."""

    def start(self, label: str, total_files: int, total_bytes: int) -> None:
        pass

    def advance(self, files: int, nbytes: int) -> None:
        pass

    def finish(self) -> None:
        pass
