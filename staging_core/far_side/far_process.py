"""A far-side command of pallet's over ssh: its pipes, the summary it answers, and the error it reports."""
from __future__ import annotations

import contextlib
import subprocess
import threading
from typing import BinaryIO, cast

from bundles.errors import PalletError
from mpi_stager.wire import RECEIVER_GONE, SOURCE_MISSING, ReceiveSummary, decode_resume_reply, decode_summary

from staging_core.transports.base import Transport
from staging_core.transports.errors import MissingDependencyError, RemotePathMissingError, classify

_RESUME_HINT = "fix the cause and rerun: shards already finished are not sent again"
_SSH_FAILED = 255
_GRACE_SECONDS = 5


class FarStagerError(PalletError):
    """The far side's `mpi_stager receive` or `mpi_stager send` failed; the message is its own."""


class FarStager:
    """``python -m mpi_stager receive``, ``send`` or ``session`` started over ``transport``: its pipes, summary
    and errors."""

    begun = None        # no stream was begun on it before it became a receiver (see far_side.session.SessionStream)
    writer: threading.Thread | None = None      # a thread of the caller's that writes its input, if any

    def __init__(self, transport: Transport, argv: list[str], url: str):
        self.argv, self.url = argv, url
        self.command = argv[argv.index("mpi_stager") + 1]
        self.process: subprocess.Popen = transport.stream_into(argv)
        self.stdin = cast(BinaryIO, self.process.stdin)         # pipes: stream_into makes all three
        self.stdout = cast(BinaryIO, self.process.stdout)
        self._stderr: list[bytes] = []
        self._interrupted = False
        self._drain = threading.Thread(target=lambda: self._stderr.append(cast(BinaryIO, self.process.stderr).read()),
                                       name="pallet-far-stderr", daemon=True)
        self._drain.start()

    def handshake(self, stream_id: str) -> dict[int, bytes]:
        """Read the receiver's first line: the shards (number -> hash) it already holds for ``stream_id``."""
        self.stdin.flush()
        line = self.stdout.readline()
        if not line:
            raise self.failure()
        return decode_resume_reply(line, stream_id, self.url)

    def summary(self) -> ReceiveSummary:
        """Close the stream, wait for the receiver and return its summary (its last stdout line; SummaryError
        when that is none)."""
        self.stdin.close()
        output = self.stdout.read()
        if self.process.wait() != 0:
            raise self.failure()
        return decode_summary(output, "receive", self.url)

    def failure(self) -> PalletError:
        """The error the far side (or ssh) reported, once it has exited."""
        self.close()
        stderr = self.stderr_text()
        status = self.process.returncode
        if status == _SSH_FAILED:
            return classify(stderr, status, self.argv, self.url, "ssh failed while streaming")
        if self.command == "send" and status == SOURCE_MISSING:
            return RemotePathMissingError("path does not exist", self.url, "check the remote path", self.argv,
                                          status, stderr)
        if "No module named mpi_stager" in stderr or "No module named 'mpi_stager'" in stderr:
            return without_pallet(self.argv, self.url, stderr)
        _, found, error = stderr.partition(f"mpi_stager {self.command}: error: ")
        message = _without_hints(error) if found else (stderr[-2000:] or f"it exited with status {status}")
        role = "sender" if self.command == "send" else "receiver"
        return FarStagerError(f"the far side's {role} failed: {message}", self.url, _RESUME_HINT)

    def stderr_text(self) -> str:
        """What the far side wrote on stderr (complete once it has exited and :meth:`close` returned)."""
        return b"".join(self._stderr).decode(errors="replace").strip()

    def blame(self, local: PalletError | None) -> PalletError:
        """After a failure seen here: the far side's own error if it failed (it is given a few seconds to
        exit once its stdin is closed), else ``local``. A sender that saw its receiver go away exits with
        RECEIVER_GONE: then the cause is here."""
        self.close_input()
        try:
            status = self.process.wait(timeout=_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            status = None
        if local is not None and status in (0, None, RECEIVER_GONE):
            return local
        return self.failure()

    def close(self, timeout: float = 60) -> None:
        """End our side of the stream and wait for the far side (killing ssh if it does not exit in time)."""
        self.close_input()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.abandon()
        self.stdout.close()
        self._drain.join(0 if self._interrupted else _GRACE_SECONDS)   # a lingering far side holds its stderr

    def abandon(self) -> None:
        """Stop now, whatever the far side does: kill the local ssh and close our end of its output. (A
        ControlMaster holds copies of ssh's pipes; with its output closed it closes the channel, and the far
        side ends at its next write.) Our input is left to :meth:`close`: a thread may be writing it."""
        self.process.kill()
        self.process.wait()
        self.stdout.close()

    def interrupt(self) -> None:
        """On an interrupt (SIGINT, SIGTERM): end our input (unless ``writer`` still writes it) and :meth:`abandon`
        the far side, stopping our read of its stderr too; it ends by itself as its input ends or its output
        goes, and is not waited for."""
        self._interrupted = True
        self.close_input()
        stop = getattr(self.process, "stop", None)      # ssh: also ends a read of its stderr that would wait
        if stop is not None:
            stop()
        self.abandon()

    def close_input(self) -> None:
        """End our side of the stream (the far side sees end of input); nothing when that has happened, or while
        ``writer`` (a thread writing our input) still runs: closing would wait for its write."""
        if self.writer is not None and self.writer.is_alive():
            return
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ValueError):
            self.stdin.close()


def _without_hints(message: str) -> str:
    """The far side's error without its hint lines (ours replace them)."""
    return "\n".join(line for line in message.splitlines() if not line.lstrip().startswith("hint:")).strip()


def without_pallet(argv: list[str], url: str, stderr: str) -> MissingDependencyError:
    """The error of a far-side Python (``argv``'s, as ``--remote-python`` named it) that has no pallet."""
    python = argv[argv.index("mpi_stager") - 2] if argv.index("mpi_stager") >= 2 else argv[0]
    return MissingDependencyError(f"the far side's Python ({python}) has no pallet", url,
                                  "drop --remote-python (pallet then uses the far side's own tar and md5sum), or "
                                  "install pallet there: pallet remote install HOST", argv, None, stderr)
