"""One ssh ControlMaster connection: started at once, waited for on first use; the far commands run through it.

A far command's output starts after what the far side's login printed (see login_output.py).
"""
from __future__ import annotations

import io
import os
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
    """``ssh -M -N -f`` to ``endpoint``'s host with ``ssh_options``, its socket in a private directory
    (:attr:`control_dir`, which also holds the transport's temporary files).

    :meth:`start` launches it and returns at once, so that the connection's
    round trips overlap whatever the caller does next (`pallet push` starts
    it before loading its packer). :meth:`ready` starts it if needed and
    waits until it is authenticated, raising the TransportError that
    ``ssh`` reported (host unreachable, key refused); a master that has
    ended meanwhile (it exits after MASTER_IDLE_S without a client, counted
    from its start when it never had one) is started again. :meth:`close`
    ends it and removes its directory; it may be called more than once.
    A transport takes a master over with :meth:`adopt`, which succeeds once,
    and only for the host, user, port and options it was started with.
    Its methods may be called from several threads.
    """

    def __init__(self, endpoint: Endpoint, ssh_options: Sequence[str]):
        self.endpoint, self.ssh_options = endpoint, list(ssh_options)
        self.control_dir = scratch_dir("pallet-ssh-", _SOCKET_ROOT)
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._errors: IO[bytes] | None = None          # the master's stderr, while it connects
        self._ready = self._adopted = False
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
        """Launch the connection unless launched already; do not wait for it."""
        with self._lock:
            self._launch()
        return self

    def ready(self) -> None:
        """Launch the connection if needed and wait until it is up; TransportError if ssh failed."""
        with self._lock:
            if self._ready and os.path.exists(self._socket):
                return
            if self._ready:                 # it ended after idling: connect again
                self._process, self._ready = None, False
            process, errors = self._launch()
            try:
                code = process.wait(timeout=_CONNECT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
            errors.seek(0)
            stderr = errors.read().decode(errors="replace")
            errors.close()
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
            if self._adopted or not same or list(ssh_options) != self.ssh_options:
                return False
            self._adopted = True
            return True

    def close(self) -> None:
        """End the connection (waiting for one still being made) and remove the socket's directory."""
        with self._lock:
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
        return os.path.join(self.control_dir, "cm")

    def _master_argv(self) -> list[str]:
        return ["ssh", *self._port(), "-o", f"ControlPath={self._socket}", "-o", "ControlMaster=yes",
                "-o", f"ControlPersist={MASTER_IDLE_S}", "-o", "BatchMode=yes", *self.ssh_options, *_KEEPALIVE,
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
