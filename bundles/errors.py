"""The single exception hierarchy shared by every pallet layer."""
from __future__ import annotations

import os
import signal


class PalletError(Exception):
    """Base of every error pallet raises on purpose.

    ``path`` names the file or URL concerned (may be None) and ``hint`` tells
    the user how to fix it. ``str()`` renders both, so a CLI can print the
    error as is.
    """

    exit_code = 1

    def __init__(self, message: str, path: str | bytes | os.PathLike | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.path = None if path is None else os.fsdecode(path)
        self.hint = hint

    def __reduce__(self):
        # Keep path, hint and extra fields when errors cross process boundaries.
        return (_rebuild, (type(self), self.args, self.__dict__))

    def __str__(self) -> str:
        text = self.message if self.path is None else f"{self.path}: {self.message}"
        return text if not self.hint else f"{text}\n  hint: {self.hint}"


def _rebuild(cls, args, state):
    error = Exception.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class UsageError(PalletError):
    """The command line or the arguments of a call make no sense."""

    exit_code = 2


class SourceError(PalletError):
    """A source tree or file cannot be read as asked (missing, unreadable, changed)."""


class DestinationError(PalletError):
    """A destination cannot be written (not writable, not a directory, disk full)."""


class DestinationLocked(DestinationError):
    """Another pallet operation holds the destination's lock (an flock on the directory itself)."""

    exit_code = 4


class BundleError(PalletError):
    """A bundle cannot be read: not an archive, truncated, or of an unknown format."""


class CorruptBundleError(BundleError):
    """A bundle's bytes do not match its index (flipped bytes, wrong hashes)."""

    def __init__(self, message: str, path=None, hint=None, problems: list[str] | None = None):
        super().__init__(message, path, hint)
        self.problems = problems or []

    def __str__(self) -> str:
        lines = [super().__str__()] + [f"  - {p}" for p in self.problems[:50]]
        if len(self.problems) > 50:
            lines.append(f"  ... and {len(self.problems) - 50} more")
        return "\n".join(lines)


class StreamError(BundleError):
    """A bundle stream is malformed, cut short, or disagrees with its own skeleton or index."""


class UnsafeMemberError(BundleError):
    """An archive holds members that would escape or endanger the destination."""

    def __init__(self, members: list[tuple[str, str]], path=None):
        self.members = members
        listed = "\n".join(f"  - {name!r}: {why}" for name, why in members[:50])
        more = f"\n  ... and {len(members) - 50} more" if len(members) > 50 else ""
        super().__init__(
            f"refusing to extract {len(members)} unsafe member(s):\n{listed}{more}",
            path,
            "the archive was not made by a trusted tool; nothing was written for these members",
        )

    def __str__(self) -> str:
        return PalletError.__str__(self)


class WorkerError(PalletError):
    """A worker process of a pool ended without answering (killed, out of memory, or broken install)."""


class SummaryError(PalletError):
    """A far side's JSON summary cannot be read: none printed, damaged, incomplete, or of a newer version than
    this pallet knows (mpi_stager.wire)."""


class SetupError(PalletError):
    """Something pallet needs on this machine is missing (a library, a kernel feature, an optional extra)."""


class Interrupted(KeyboardInterrupt):
    """pallet was stopped by SIGINT (Ctrl-C) or SIGTERM; ``exit_code`` is 128 + the signal's number (130, 143).
    A KeyboardInterrupt, so that no ``except Exception`` takes it for a failure; what was done is kept (DEST stays
    marked INCOMPLETE) and a rerun resumes."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
