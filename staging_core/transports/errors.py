"""Transport errors: one class per cause a user can act on, all carrying the command and its stderr."""
from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import TypeAlias

from bundles.errors import PalletError, SetupError, SourceError


_STDERR_LINES = 6     # the far side's last lines shown under a transport error


class TransportError(PalletError):
    """A transfer, listing or remote command failed.

    ``command`` is the argument list that ran (None for library calls),
    ``status`` its exit status, ``stderr`` what it printed (trimmed), and
    ``retryable`` whether running it again may succeed (network trouble,
    not a wrong path). Subclasses name the cause.
    """

    retryable = False
    exit_code = 3     # pallet's own exit status for a failed transport (see docs/cli.md)

    def __init__(self, message: str, path=None, hint=None, command: list[str] | None = None,
                 status: int | None = None, stderr: str = "", retryable: bool | None = None):
        super().__init__(message, path, hint)
        self.command = command
        self.status = status
        self.stderr = stderr.strip()[-2000:]
        if retryable is not None:
            self.retryable = retryable

    def __str__(self) -> str:
        text = super().__str__()
        if self.stderr and self.stderr not in text:
            text += "".join(f"\n  | {line[:300]}" for line in self.stderr.splitlines()[-_STDERR_LINES:])
        return text


class HostUnreachableError(TransportError):
    """The host cannot be reached (DNS, refused, timeout)."""

    retryable = True


class AuthenticationError(TransportError):
    """The host refused our credentials."""


class RemotePathMissingError(TransportError):
    """A path does not exist on the far side."""


class RemotePermissionError(TransportError):
    """The far side denies access to a path."""


class RemoteDiskFullError(TransportError):
    """The far side has no space left."""


class StoppedBySignal(TransportError):
    """A program pallet ran (ssh, rsync, tar) was stopped by SIGINT or SIGTERM: a user's Ctrl-C or `kill`, never
    network trouble, so never retried."""


class NotSupportedError(TransportError):
    """The transport lacks the capability asked for (see its Capabilities)."""


class SourceReadError(SourceError, TransportError):
    """A transfer could not read a file or directory of its source (permission denied, an I/O error there): the
    source's fault, not the transport's, so it exits as every SourceError does, on whichever route met it."""

    exit_code = SourceError.exit_code
    retryable = False


SOURCE_READ_HINT = "make it readable (chmod u+r) or remove it from the source"


def source_read_error(path: str, reason: str, command: list[str] | None = None,
                      status: int | None = None) -> SourceReadError:
    """The SourceReadError for ``path``, which could not be read for ``reason`` (e.g. 'Permission denied')."""
    return SourceReadError(f"cannot read ({reason})", path, SOURCE_READ_HINT, command, status)


def source_side_failure(failed: Mapping[str, PalletError], source_root: str) -> SourceError | None:
    """Of a transfer's per-item failures, the first that is the source's (a SourceError, or a permission or I/O
    error naming a path under ``source_root``) as a SourceReadError (or the SourceError it already was), counting
    the others; None if there is none."""
    root = source_root.rstrip("/") + "/"
    found: list[SourceError] = []
    for item in sorted(failed):
        error = failed[item]
        if isinstance(error, SourceError):
            found.append(error)
        elif isinstance(error, TransportError) and type(error) in (RemotePermissionError, TransportError) \
                and error.path is not None and error.path.startswith(root):
            said = getattr(error, "stderr", "").strip().splitlines()
            found.append(source_read_error(error.path, said[-1] if said else error.message, error.command,
                                           error.status))
    if not found:
        return None
    first = found[0]
    if len(found) > 1:
        first = SourceReadError(f"{first.message}, and {len(found) - 1} more source file(s) cannot be read",
                                first.path, first.hint, getattr(first, "command", None), getattr(first, "status", None))
    return first


class MissingDependencyError(SetupError):
    """A transport needs a program or Python package that is not installed, here or at the far side (a
    setup error, not a transport failure: nothing is retried); the hint says how to install it. ``command``,
    ``status`` and ``stderr`` are those of the command that found it missing, if one did."""

    def __init__(self, message: str, path=None, hint=None, command: list[str] | None = None,
                 status: int | None = None, stderr: str = ""):
        super().__init__(message, path, hint)
        self.command, self.status, self.stderr = command, status, stderr.strip()[-2000:]


# What one failed item of a batch is (TransferResult.failed), and what classify returns: a TransportError, or
# the MissingDependencyError of a far side that lacks a tool pallet needs there.
ItemError: TypeAlias = TransportError | MissingDependencyError


_STOPPING = (signal.SIGINT, signal.SIGTERM)


def _stopping_signal(text: str, status: int | None) -> str:
    """The name of the signal that stopped a program (its negative ``status``, a shell's 128 + N, or the
    words of ssh, "Killed by signal N.", and rsync, "received SIGINT, SIGTERM, or SIGHUP"); '' if none did."""
    for signum in _STOPPING:
        if status in (-signum, 128 + signum) or f"killed by signal {int(signum)}." in text:
            return signum.name
    return "a signal" if "received sigint, sigterm, or sighup" in text else ""


_FIND_REFUSALS = ("unrecognized", "unknown", "invalid", "illegal", "bad arg", "not supported")


def classify(stderr: str, status: int | None, command: list[str] | None, path: str | None,
             fallback: str) -> ItemError:
    """Turn the stderr of ssh/rsync/globus-url-copy into the most specific TransportError (or the
    MissingDependencyError of a far side whose ``find`` has no ``-printf``, as BusyBox's and BSD's have not)."""
    text = stderr.lower()
    stopped_by = _stopping_signal(text, status)
    if stopped_by:
        return StoppedBySignal(f"{fallback}: stopped by {stopped_by}", path, "rerun to resume", command, status,
                               stderr)
    if "-printf" in text and any(word in text for word in _FIND_REFUSALS):
        return MissingDependencyError(
            "the far side's find lacks -printf (GNU findutils needed to list it)", path,
            "install GNU findutils there (e.g. `apk add findutils`, `dnf install findutils`), or put a GNU find "
            "first on the login shell's PATH", command, status, stderr)
    rules = [
        (("could not resolve hostname", "name or service not known", "connection refused", "connection timed out",
          "no route to host", "network is unreachable", "connection closed by", "connection reset"),
         HostUnreachableError, "host unreachable", "check the host name and port, and that you can `ssh` to it"),
        (("permission denied (publickey", "permission denied, please try again", "authentication failed",
          "too many authentication failures", "host key verification failed",
          "valid credentials could not be found", "credential failure"),
         AuthenticationError, "authentication failed",
         "check your keys/agent and ~/.ssh/config, or log in once by hand"),
        (("no space left on device", "disk quota exceeded", "quota exceeded"),
         RemoteDiskFullError, "no space left on the destination", "free space or choose another destination"),
        (("no such file or directory", "does not exist", "file not found", "not a directory", "550-", "550 "),
         RemotePathMissingError, "path does not exist", "check the remote path"),
        (("permission denied", "operation not permitted", "access denied", "read-only file system"),
         RemotePermissionError, "permission denied", "check the permissions of the remote path"),
    ]
    for needles, cls, message, hint in rules:
        if any(n in text for n in needles):
            return cls(message, path, hint, command, status, stderr)
    return TransportError(fallback, path, "see the command's message above", command, status, stderr,
                          retryable=status in (10, 12, 30, 35, 255))     # rsync: socket, stream, timeouts; ssh
