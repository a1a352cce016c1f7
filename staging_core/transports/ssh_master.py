"""One ssh ControlMaster connection: started at once, waited for on first use; the far commands run through it.

A far command's output starts after what the far side's login printed (see login_output.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import io
import os
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

from bundles.errors import UsageError

from ..scratch import scratch_dir
from . import login_output
from .base import Endpoint
from .errors import TransportError, classify
from .login_output import AfterLogin, LoginOutput, Marker
from .ssh_socket import (check_private, listening, master_answers, session_directory, socket_path,
                         users_control_path)

MASTER_IDLE_S = 30     # a master without clients exits after this (a killed pallet's too); ready() connects again
_SOCKET_ROOT = "/tmp"  # ControlMaster sockets: a long $TMPDIR would exceed the 108-byte socket path limit
_CONNECT_TIMEOUT_S = 120
_READ_BUFFER = 64 * 1024
# A connection whose far end stops answering ends after about a minute (the user's own -o ServerAlive... win).
_KEEPALIVE = ("-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4")


class LoginOutputError(TransportError):
    """The far side's login (~/.bashrc, a ForceCommand) printed something and did not run pallet's command: it
    ended, or did not start it in time. The message quotes what it printed."""


def login_error(login: LoginOutput, url: str, command: list[str] | None = None) -> LoginOutputError:
    return LoginOutputError(login.message(), url, login.hint(), command)


def login_timeout(ssh_options: Sequence[str]) -> float:
    """Seconds a far side has to start pallet's command after ssh asked for it: ssh's ``ConnectTimeout`` when
    ``ssh_options`` set it (``-o ConnectTimeout=N``), else LOGIN_TIMEOUT_S."""
    words = list(ssh_options)
    for n, word in enumerate(words):
        setting = word[2:] if word.startswith("-o") and len(word) > 2 else \
            (words[n + 1] if word == "-o" and n + 1 < len(words) else "")
        key, _, value = setting.replace("=", " ", 1).partition(" ")
        if key.lower() == "connecttimeout" and value.strip().isdigit() and int(value) > 0:
            return float(value)
    return login_output.LOGIN_TIMEOUT_S


def ssh_options_for(given: Sequence[str]) -> list[str]:
    """The ssh arguments pallet uses: ``given`` (``--ssh-option``), then those of ``$PALLET_SSH_OPTIONS``, split
    as a shell splits them (UsageError naming the variable when they cannot be, e.g. an unbalanced quote)."""
    try:
        extra = shlex.split(os.environ.get("PALLET_SSH_OPTIONS", ""))
    except ValueError as exc:
        raise UsageError(f"$PALLET_SSH_OPTIONS cannot be split as a shell would: {exc}",
                         hint="balance its quotes, as in PALLET_SSH_OPTIONS='-o \"ProxyJump=me@gate\"'") from None
    return [*given, *extra]


class SSHMaster:
    """``ssh -M -N -f`` to ``endpoint``'s host with ``ssh_options``.

    :meth:`start` launches it and returns at once, so that the connection's
    round trips overlap whatever the caller does next (`pallet push` starts
    it before loading its packer). :meth:`ready` starts it if needed and
    waits until it is authenticated, raising the TransportError that
    ``ssh`` reported (host unreachable, key refused); a master that has
    ended meanwhile is started again.

    Where it lives and how long:
    - A master the user's ssh configuration keeps (its ControlPath, as
      ``ssh -G`` expands it, answers ``ssh -O check``) is used as it is,
      and never ended by pallet.
    - With ``keep_s`` > 0 its socket is in this user's directory of kept
      connections (:func:`ssh_socket.session_directory`, checked to be
      private before each use), one per user, host, port and options, and
      it outlives this process until ``keep_s`` seconds pass without a
      client (ssh's ControlPersist), so that later operations and later
      `pallet` commands start without a handshake. Only one process starts
      it at a time (a lock on that directory); the others then use it.
    - Else its socket is in a private directory of this process, and it ends
      after MASTER_IDLE_S without a client (counted from its start when it
      never had one), or at :meth:`close`, which also removes the directory.

    :meth:`close` may be called more than once. A transport takes a master
    over with :meth:`adopt` (only for the host, user, port and options it
    was started with): once, unless the master is ``shared`` (a host
    session's, closed by its owner) or kept. Its methods may be called from
    several threads.
    """

    def __init__(self, endpoint: Endpoint, ssh_options: Sequence[str], keep_s: float = 0.0, shared: bool = False):
        self.endpoint, self.ssh_options, self.keep_s, self.shared = endpoint, list(ssh_options), keep_s, shared
        self.control_dir = session_directory() if keep_s > 0 else scratch_dir("pallet-ssh-", _SOCKET_ROOT)
        self._socket_path = socket_path(self.control_dir, endpoint, self.ssh_options) if keep_s > 0 else \
            os.path.join(self.control_dir, "cm")
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._errors: IO[bytes] | None = None          # the master's stderr, while it connects
        self._ready = self._adopted = self._users = False
        self._launching: int | None = None              # the kept-connections directory, locked while launching
        self.login_timeout_s = login_timeout(self.ssh_options)

    @property
    def destination(self) -> str:
        host = self.endpoint.host
        if host is None:            # parse_url gives every ssh URL a host: an Endpoint made by hand may lack one
            raise UsageError(f"{self.endpoint.url()} names no host", hint="write ssh://[user@]HOST/absolute/path")
        return f"{self.endpoint.user}@{host}" if self.endpoint.user else host

    def client_argv(self) -> list[str]:
        """``ssh`` through this master (never starting one of its own, and never asking for a password should
        the master be gone), ready for a destination and command."""
        return ["ssh", *self._port(), "-o", f"ControlPath={self._socket}", "-o", "ControlMaster=no",
                *self.ssh_options, "-o", "BatchMode=yes"]

    def command(self, argv: Sequence[str], stdin=subprocess.PIPE) -> FarProcess:
        """Start ``argv`` there through this master (which must be ready): its stdout and stderr begin after
        what the login printed. A login that ends, or does not start it within :attr:`login_timeout_s`, after
        printing something is a LoginOutputError at the first read of stdout."""
        marker = Marker.new()
        return FarProcess([*self.client_argv(), self.destination, "--", marker.command(shlex.join(argv))], marker,
                          self.login_timeout_s, lambda login: login_error(login, self.endpoint.url(), list(argv)),
                          stdin=stdin)

    def rsync_shell(self) -> list[str]:
        """rsync's ``-e`` and ``--rsync-path`` through this master: the far rsync starts after a marker, and the
        ``-e`` program (login_output.py, run with this Python) drops what the login printed before it."""
        marker = Marker.new()
        rsh = [sys.executable, "-I", "-S", login_output.__file__, marker.token, f"{self.login_timeout_s:g}",
               *self.client_argv()]
        return ["-e", shlex.join(rsh), f"--rsync-path={marker.command('rsync')}"]

    def start(self) -> SSHMaster:
        """Launch the connection unless launched already, or found running; do not wait for it."""
        with self._lock:
            if not self._ready and not self._found_running():
                self._launch()
        return self

    def ready(self) -> None:
        """Launch the connection if needed and wait until it is up; TransportError if ssh failed."""
        with self._lock:
            if self._ready and listening(self._socket):
                return
            if self._ready:                 # it ended (idle, or killed): connect again
                self._process, self._ready = None, False
                self._remove_dead_socket()
            if self._process is None and self._found_running():
                self._ready = True
                return
            process, errors = self._launch()
            try:
                code = process.wait(timeout=_CONNECT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
            errors.seek(0)
            stderr = errors.read().decode(errors="replace")
            errors.close()
            self._unlock_launch()
            if code != 0:
                self._process = None        # a later call tries again
                raise classify(stderr, code, self._master_argv(), self.endpoint.url(),
                               f"cannot connect to {self.destination}")
            self._ready = True

    def adopt(self, endpoint: Endpoint, ssh_options: Sequence[str]) -> bool:
        """Take this master over for a transport to ``endpoint`` with ``ssh_options``: True once, when they are
        those it was started for."""
        same = (endpoint.user, endpoint.host, endpoint.port) == (self.endpoint.user, self.endpoint.host,
                                                                 self.endpoint.port)
        with self._lock:
            if not same or list(ssh_options) != self.ssh_options or (self._adopted and not self.kept):
                return False
            self._adopted = True
            return True

    @property
    def kept(self) -> bool:
        """Whether the connection outlives this object (kept, or the user's own): :meth:`close` leaves it."""
        return self.keep_s > 0 or self.shared or self._users

    def release(self) -> None:
        """What a transport that adopted this master calls when it closes: :meth:`close`, unless the master is
        ``shared`` (its owner closes it)."""
        if not self.shared:
            self.close()

    def close(self) -> None:
        """End the connection (waiting for one still being made) and remove the socket's directory; a kept or
        the user's own connection is left running (a launch still under way is stopped)."""
        with self._lock:
            if self.keep_s > 0 or self._users:
                self._stop_launch()
                return
            if self._process is not None:
                if not self._ready:         # still connecting (a command that failed early): stop it
                    self._process.kill()
                    self._process.wait()
                    if self._errors is not None:
                        self._errors.close()
                subprocess.run([*self.client_argv(), "-O", "exit", self.destination], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
                self._process, self._ready = None, False
            shutil.rmtree(self.control_dir, ignore_errors=True)

    def _found_running(self) -> bool:
        """Whether a master is there already to be used: the user's own, or (``keep_s``) a kept one, checked to
        be private. When none is, a kept master's launch is prepared: the directory of kept connections is
        locked (until :meth:`ready` has waited for it) and a dead master's socket removed."""
        if not self._users:
            theirs = users_control_path([*self._base_argv(), self.destination])
            if theirs and listening(theirs) and master_answers(self._base_argv(), theirs, self.destination):
                self._socket_path, self._users = theirs, True
                return True
        if self.keep_s <= 0:
            return False
        if self._launching is None:
            check_private(self.control_dir, directory=True)
            self._launching = os.open(self.control_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fcntl.flock(self._launching, fcntl.LOCK_EX)
        if os.path.lexists(self._socket):
            check_private(self._socket, directory=False)
            if listening(self._socket):
                self._unlock_launch()
                return True
            os.unlink(self._socket)             # a master that died without removing it
        return False

    def _remove_dead_socket(self) -> None:
        """Remove the socket of a master that died (kill -9 leaves it): ssh would not start a master over it. The
        user's own is theirs to tidy; a kept one is checked to be ours first."""
        if self._users or not os.path.lexists(self._socket):
            return
        if self.keep_s > 0:
            check_private(self._socket, directory=False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._socket)

    def _unlock_launch(self) -> None:
        if self._launching is not None:
            os.close(self._launching)
            self._launching = None

    def _stop_launch(self) -> None:
        """Stop a launch that :meth:`ready` has not waited for (the caller gave up before connecting)."""
        if self._process is not None and not self._ready:
            self._process.kill()
            self._process.wait()
            self._process = None
            if self._errors is not None:
                self._errors.close()
        self._unlock_launch()

    def _base_argv(self) -> list[str]:
        return ["ssh", *self._port(), *self.ssh_options, "-o", "BatchMode=yes"]

    def _launch(self) -> tuple[subprocess.Popen, IO[bytes]]:
        """The master's process and the file its stderr goes to: launched now unless launched already."""
        if self._process is None or self._errors is None:
            # kept open past this call, for ready() to read and close once ssh has connected
            self._errors = tempfile.TemporaryFile()  # noqa: SIM115
            self._process = subprocess.Popen(self._master_argv(), stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=self._errors)
        return self._process, self._errors

    @property
    def _socket(self) -> str:
        return self._socket_path

    def _master_argv(self) -> list[str]:
        persist = max(1, round(self.keep_s)) if self.keep_s > 0 else MASTER_IDLE_S
        return ["ssh", *self._port(), "-o", f"ControlPath={self._socket}", "-o", "ControlMaster=yes",
                "-o", f"ControlPersist={persist}", "-o", "BatchMode=yes", *self.ssh_options, *_KEEPALIVE,
                "-f", "-N", self.destination]

    def _port(self) -> list[str]:
        return ["-p", str(self.endpoint.port)] if self.endpoint.port else []


class FarProcess(subprocess.Popen):
    """A far command started through ssh (``argv``, whose remote command prints ``marker`` first, see
    login_output.Marker.command): ``stdout`` and ``stderr`` read from after the marker (login_output.AfterLogin).

    The marker must arrive on stdout within ``timeout_s`` of the start;
    else, or when the far side ends before it after printing something,
    the first read of stdout kills ssh and raises ``fail(LoginOutput)``.
    :meth:`communicate` reads through these streams too.
    """

    # stdout and stderr are pipes (Popen gives buffered readers), replaced by readers of what follows the marker
    stdout: io.BufferedReader
    stderr: io.BufferedReader

    def __init__(self, argv: list[str], marker: Marker, timeout_s: float,
                 fail: Callable[[LoginOutput], BaseException], stdin=subprocess.PIPE):
        started = time.monotonic()
        super().__init__(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._out = AfterLogin(self.stdout.detach(), marker.line, started + timeout_s, self._failed, started)
        self._err = AfterLogin(self.stderr.detach(), marker.line)
        self._fail = fail
        self.stdout, self.stderr = io.BufferedReader(self._out, _READ_BUFFER), io.BufferedReader(self._err)

    def output_ended(self) -> bool:
        """Whether the far command's output can be read now without waiting: between the requests of a
        request-answer protocol, only its end (or a far side that broke the protocol) makes it so."""
        readable, _, _ = select.select([self._out.raw_fd], [], [], 0)
        return bool(readable)

    @property
    def marked(self) -> bool:
        """The far side printed the marker: pallet's command ran there."""
        return self._out.marked

    def _failed(self, login: LoginOutput) -> BaseException:
        """Stop what is left of the command; the error to raise."""
        self.stop()
        return self._fail(login)

    def stop(self) -> None:
        """Kill ssh and end our reads of its stderr (a far side stuck in its login would hold it open)."""
        self.kill()
        self._err.cancel()

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Write ``input`` (then end stdin), read stdout and stderr to their ends, wait; ``(stdout, stderr)``.
        ``timeout`` is Popen's argument and unused: the login's time is limited (see the class), the command's
        is its own."""
        errors: list[bytes] = []
        threads = [threading.Thread(target=lambda: errors.append(self.stderr.read()), daemon=True,
                                    name="pallet-ssh-stderr")]
        if self.stdin is not None:
            threads.append(threading.Thread(target=_feed, args=(self.stdin, input or b""), daemon=True,
                                            name="pallet-ssh-stdin"))
        for thread in threads:
            thread.start()
        try:
            output = self.stdout.read()
        except BaseException:
            self.stop()
            threads[0].join()           # stderr; a write to a far side stuck in its login may never end
            self.wait()
            raise
        for thread in threads:
            thread.join()
        self.wait()
        return output, b"".join(errors)


def _feed(pipe, data: bytes) -> None:
    try:
        if data:
            pipe.write(data)
        pipe.close()
    except (BrokenPipeError, ConnectionResetError, ValueError):
        pass                            # the far side stopped reading: its status says why
