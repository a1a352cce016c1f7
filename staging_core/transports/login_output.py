"""What a far login prints before pallet's command: the marker ending it, a reader that skips it, rsync's -e filter.

Every command pallet runs over ssh first prints a marker of its own
(:class:`Marker`), on stdout and on stderr, then execs the command; whatever
the login printed before it (an ``echo`` in ~/.bashrc, a ForceCommand's
banner) is skipped (:class:`AfterLogin`). A login that ends, or does not
start the command within its time, without printing the marker is reported
(:class:`LoginOutput`) with what it printed. This module imports the
standard library only: rsync runs it by path as its ``-e`` program
(:func:`main`), which skips the login's output before rsync's protocol sees it.
"""
from __future__ import annotations

import errno
import io
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

# Plain classes, not dataclasses, posix_spawn, not subprocess, and re imported only to quote a login: rsync
# starts this module once per transfer, and those imports would double its start-up time.

LOGIN_TIMEOUT_S = 120.0     # a far side must start pallet's command within this (or ssh's ConnectTimeout) after login
FILTER_TAG = "pallet-login-output:"     # the rsync filter's line naming a login that did not run the command
_KEPT = 64 * 1024           # bytes of the login's output kept to quote (stderr: to hand on when no marker came)
_SHOWN = 100                # characters of it a message quotes
_CHUNK = 64 * 1024
_CANCEL_POLL_S = 1.0        # a cancellable read (stderr) looks at its cancel flag this often
# Run by any login shell (sh, bash, zsh, csh, fish): one POSIX sh prints the marker ($0) on both streams, then
# becomes the command ("$@").
_PREFIX = "exec sh -c 'echo \"$0\"; echo \"$0\" >&2; exec \"$@\"' "
_ESCAPES = r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[@-Z\\-_])"     # ANSI CSI, OSC and 2-byte escapes
_CONTROLS = r"[\x00-\x1f\x7f]+"


class Marker:
    """A command's own start marker: ``pallet-`` and random hex (``token``), printed as a line of its own."""

    __slots__ = ("token",)

    def __init__(self, token: str):
        self.token = token

    @classmethod
    def new(cls) -> Marker:
        return cls("pallet-" + os.urandom(12).hex())

    @property
    def line(self) -> bytes:
        return self.token.encode() + b"\n"

    def command(self, words: str) -> str:
        """The remote command line that prints the marker and then runs ``words`` (shell-quoted argv words)."""
        return f"{_PREFIX}{self.token} {words}"


class LoginOutput:
    """What a login printed instead of starting pallet's command: its first bytes (``head``) and ``size``, and
    whether it did not start the command within ``seconds`` (``timed_out``) or ended without running it."""

    __slots__ = ("head", "size", "timed_out", "seconds")

    def __init__(self, head: bytes, size: int, timed_out: bool, seconds: float):
        self.head, self.size, self.timed_out, self.seconds = head, size, timed_out, seconds

    @property
    def shown(self) -> str:
        """The login's output as one short line: escape sequences and control characters dropped."""
        import re
        text = re.sub(_CONTROLS, " ", re.sub(_ESCAPES, "", self.head.decode(errors="replace")))
        text = " ".join(text.split())
        return text if len(text) <= _SHOWN else text[:_SHOWN - 1] + "…"

    def message(self) -> str:
        said = f"printed '{self.shown}'" if self.shown else \
            (f"printed {self.size} bytes of control characters" if self.size else "printed nothing")
        if self.timed_out:
            return f"the far side's login {said} and did not start pallet's command within {self.seconds:g} s"
        return f"the far side's login {said} and ended without running pallet's command"

    def hint(self) -> str:
        if self.timed_out:
            return ("make ~/.bashrc (and any ForceCommand) there quick and quiet for non-interactive shells, or "
                    "allow more time with --ssh-option=-oConnectTimeout=SECONDS")
        return ("a ForceCommand or login script there must run the command ssh is given ($SSH_ORIGINAL_COMMAND); "
                "log in by hand to see what it wants, or ask the site")


class AfterLogin(io.RawIOBase):
    """A far command's stdout or stderr (``raw``, an unbuffered pipe) from just after ``marker`` on.

    What came before the marker is the login's: it is skipped, its first
    bytes kept in :attr:`login`. Reading the marker must end by ``deadline``
    (a time.monotonic() value; None: no limit). When the stream ends, or
    the deadline passes, before the marker, ``fail`` (given a LoginOutput)
    returns the exception to raise; without ``fail`` (stderr) the stream is
    handed on whole instead. :meth:`cancel` makes a blocked read end as at
    end of stream, within about a second: a far side stuck in its login
    keeps our end of its stderr open after its ssh is killed.
    """

    def __init__(self, raw, marker: bytes, deadline: float | None = None,
                 fail: Callable[[LoginOutput], BaseException] | None = None, started: float | None = None):
        super().__init__()
        self._raw, self._fd, self._marker = raw, raw.fileno(), marker
        self._deadline, self._fail = deadline, fail
        self._started_at = time.monotonic() if started is None else started
        self._pending = b""
        self._past = False              # the marker was read (or the stream ended before it)
        self._head = bytearray()
        self._size = 0
        self._cancelled = threading.Event()
        self.marked = False             # the marker came
        self.login = b""                # the first bytes the login printed before the marker

    def readable(self) -> bool:
        return True

    @property
    def raw_fd(self) -> int:
        """The pipe's descriptor, for a caller that has taken :meth:`start`'s bytes and reads on by itself."""
        return self._fd

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a far command's output is read through pallet's reader, not its descriptor")

    def cancel(self) -> None:
        """End reads (blocked ones too) as at end of stream."""
        self._cancelled.set()

    def readinto(self, buffer) -> int:
        if not self._past:
            self._skip_login()
        if self._pending:
            count = min(len(buffer), len(self._pending))
            buffer[:count] = self._pending[:count]
            self._pending = self._pending[count:]
            return count
        if self._fail is None:          # stderr: cancellable
            return self._cancellable_readinto(buffer)
        return self._raw.readinto(buffer)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()

    def start(self) -> bytes:
        """Skip the login's output (at once if that is done); the bytes read past the marker, now ours."""
        if not self._past:
            self._skip_login()
        pending, self._pending = self._pending, b""
        return pending

    def _skip_login(self) -> None:
        held, size = b"", len(self._marker)
        while True:
            chunk = self._chunk()
            if not chunk:
                self._keep(held)
                self._past, self.login = True, bytes(self._head)
                if chunk is None and self._fail is not None:       # a deadline is given with ``fail`` only
                    raise self._fail(self._report(timed_out=True))
                if self._fail is not None and self._size:
                    raise self._fail(self._report(timed_out=False))
                if self._fail is None:
                    self._pending = self.login
                return
            window = held + chunk
            at = window.find(self._marker)
            if at >= 0:
                self._keep(window[:at])
                self._pending, self._past, self.marked = window[at + size:], True, True
                self.login = bytes(self._head)
                if self._fail is not None:
                    self._drop_echoed_marker()
                return
            cut = max(0, len(window) - (size - 1))
            self._keep(window[:cut])
            held = window[cut:]

    def _drop_echoed_marker(self) -> None:
        """Drop the marker's second copy when it follows the first on stdout: a login that sends the command's
        stderr to its stdout (``2>&1``) passes on the copy meant for stderr. Deciding may take a read, as long
        as the command's own first bytes could be the copy's beginning; the command is running by then, and is
        waited for as any read waits."""
        line = self._marker
        while len(self._pending) < len(line) and line.startswith(self._pending):
            more = os.read(self._fd, _CHUNK)
            if not more:
                return
            self._pending += more
        if self._pending.startswith(line):
            self._pending = self._pending[len(line):]

    def _chunk(self) -> bytes | None:
        """The next bytes before the marker: b'' at end of stream, None past the deadline."""
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0 or not _readable(self._fd, left):
                return None
        elif self._fail is None and not self._wait_cancellable():
            return b""
        return os.read(self._fd, _CHUNK)

    def _cancellable_readinto(self, buffer) -> int:
        if not self._wait_cancellable():
            return 0
        return self._raw.readinto(buffer)

    def _wait_cancellable(self) -> bool:
        """Wait until the pipe is readable: False once cancelled."""
        while not self._cancelled.is_set():
            if _readable(self._fd, _CANCEL_POLL_S):
                return True
        return False

    def _keep(self, data: bytes) -> None:
        self._size += len(data)
        if len(self._head) < _KEPT:
            self._head += data[:_KEPT - len(self._head)]

    def _report(self, timed_out: bool) -> LoginOutput:
        allowed = 0.0 if self._deadline is None else round(self._deadline - self._started_at, 1)
        return LoginOutput(bytes(self._head), self._size, timed_out, allowed)


def _readable(fd: int, seconds: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, int(seconds * 1000))))


# ---------------------------------------------------------------- rsync's -e program

class _LoginFailed(Exception):
    def __init__(self, login: LoginOutput):
        super().__init__(login.message())
        self.login = login


def filter_line(login: LoginOutput) -> str:
    """The rsync filter's report on stderr of a login that did not run rsync (ssh.py turns it into an error)."""
    return f"{FILTER_TAG} {'timeout' if login.timed_out else 'ended'}\t{login.message()}"


def main(argv: list[str] | None = None) -> int:
    """``python login_output.py TOKEN SECONDS SSH-ARGV...``: run ssh (``--rsync-path`` made the far side print
    TOKEN's marker before rsync) on our stdin, and relay its stdout and stderr from after the marker. The exit
    status is ssh's; 255 after a login that did not start rsync, named on stderr by :func:`filter_line`."""
    args = sys.argv[1:] if argv is None else argv
    marker, seconds, command, started = Marker(args[0]), float(args[1]), args[2:], time.monotonic()
    os.set_blocking(1, True)            # rsync hands its -e program a non-blocking socket
    # rsync signals its -e program (SIGUSR1) as it exits on an error, and does not wait for it: the far side's
    # messages still come, on ssh's stderr, and are relayed until they end (as a master-held ssh's stderr is).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    (out, out_w), (err, err_w) = os.pipe(), os.pipe()       # not inherited: only their dup2 copies are
    pid = os.posix_spawnp(command[0], command, os.environ,
                          file_actions=[(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)],
                          setsigdef=(signal.SIGUSR1, signal.SIGPIPE, signal.SIGXFSZ))
    os.close(out_w)
    os.close(err_w)
    errors = AfterLogin(io.FileIO(err, "rb"), marker.line)
    relay = threading.Thread(target=_relay_errors, args=(errors,), daemon=True)
    relay.start()
    output = AfterLogin(io.FileIO(out, "rb"), marker.line, started + seconds, _LoginFailed, started)
    failed = None
    try:
        _relay_output(output)
    except _LoginFailed as login:
        failed = login.login
        os.write(2, (filter_line(failed) + "\n").encode(errors="replace"))     # before rsync sees our end
        os.kill(pid, signal.SIGKILL)
        errors.cancel()
    os.close(1)
    relay.join()
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return 255 if failed is not None or status < 0 else status


def _relay_output(source: AfterLogin) -> None:
    """Copy ssh's stdout from after the marker to ours (by splice(2) where the kernel can)."""
    try:
        _write_all(1, source.start())
        splice = hasattr(os, "splice")
        while True:
            moved = _splice(source.raw_fd, 1) if splice else None
            if moved is None:
                splice = False
                data = os.read(source.raw_fd, _CHUNK)
                _write_all(1, data)
                moved = len(data)
            if not moved:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass                                # rsync went away; ssh sees its stdin end


def _relay_errors(source: AfterLogin) -> None:
    """Copy ssh's stderr from after the marker (all of it when none came) to ours."""
    buffer = bytearray(_CHUNK)
    try:
        _write_all(2, source.start())
        while count := source.readinto(buffer):
            _write_all(2, buffer[:count])
    except OSError:
        pass


def _splice(source: int, target: int) -> int | None:
    """Bytes moved from the pipe ``source`` to ``target`` by one splice(2) (0 at its end); None where the kernel
    cannot splice these two."""
    try:
        return os.splice(source, target, _CHUNK)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOSYS):
            return None
        raise


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


if __name__ == "__main__":
    sys.exit(main())
