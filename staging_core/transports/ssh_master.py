"""One ssh ControlMaster connection: started without waiting, waited for on first use, shared by one transport."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from typing import Sequence

from ..scratch import scratch_dir
from .base import Endpoint
from .errors import classify

MASTER_IDLE_S = 30     # a master without clients exits after this (a killed pallet's too); ready() connects again
_SOCKET_ROOT = "/tmp"  # ControlMaster sockets: a long $TMPDIR would exceed the 108-byte socket path limit
_CONNECT_TIMEOUT_S = 120


def ssh_options_for(given: Sequence[str]) -> list[str]:
    """The ssh arguments pallet uses: ``given`` (``--ssh-option``), then those of ``$PALLET_SSH_OPTIONS``."""
    return [*given, *shlex.split(os.environ.get("PALLET_SSH_OPTIONS", ""))]


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
        self._errors = None
        self._ready = self._adopted = False

    @property
    def destination(self) -> str:
        return f"{self.endpoint.user}@{self.endpoint.host}" if self.endpoint.user else self.endpoint.host

    def client_argv(self) -> list[str]:
        """``ssh`` through this master (never starting one of its own, and never asking for a password should
        the master be gone), ready for a destination and command."""
        return ["ssh", *self._port(), "-o", f"ControlPath={self._socket}", "-o", "ControlMaster=no",
                *self.ssh_options, "-o", "BatchMode=yes"]

    def start(self) -> "SSHMaster":
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
            self._launch()
            try:
                code = self._process.wait(timeout=_CONNECT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                code = self._process.wait()
            self._errors.seek(0)
            stderr = self._errors.read().decode(errors="replace")
            self._errors.close()
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
                    self._errors.close()
                subprocess.run([*self.client_argv(), "-O", "exit", self.destination], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
                self._process, self._ready = None, False
            shutil.rmtree(self.control_dir, ignore_errors=True)

    def _launch(self) -> None:
        if self._process is None:
            self._errors = tempfile.TemporaryFile()
            self._process = subprocess.Popen(self._master_argv(), stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=self._errors)

    @property
    def _socket(self) -> str:
        return os.path.join(self.control_dir, "cm")

    def _master_argv(self) -> list[str]:
        return ["ssh", *self._port(), "-o", f"ControlPath={self._socket}", "-o", "ControlMaster=yes",
                "-o", f"ControlPersist={MASTER_IDLE_S}", "-o", "BatchMode=yes", *self.ssh_options, "-f", "-N",
                self.destination]

    def _port(self) -> list[str]:
        return ["-p", str(self.endpoint.port)] if self.endpoint.port else []
